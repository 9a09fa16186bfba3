"""A narrowing published while an action waits, or while it is approved or sent: every
command is signed under the versions current as it is signed (docs/api.md, Approval)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from kestrel_one.accounts.principal import Principal, PrincipalKind, system_principal
from kestrel_one.audit.models import AuditRecord
from kestrel_one.common.errors import Conflict
from kestrel_one.execution import services
from kestrel_one.execution.approvals import approval_decide
from kestrel_one.execution.keys import control_public_key_pem
from kestrel_one.execution.models import Action, Approval
from kestrel_one.execution.services import action_request, calls_sweep
from kestrel_one.governance.selectors import policy_version_label
from kestrel_one.governance.services import policy_publish_project
from kestrel_one.tenancy.models import Project
from kestrel_one.threads.services import thread_create
from policies import Mode
from runners.contract.tokens import verify_command
from tests.execution.test_actions_api import action_url, awaiting

# What the project may do: shell.exec with a person's approval, or (narrowed) not at all.
WITH_APPROVAL = {
    "capabilities": {
        "fs.read": {"paths": ["**"]},
        "fs.write": {"paths": ["src/**"]},
        "shell.exec": {"approval": "always", "limits": {"timeout_s": 60}},
        "code.exec": {"limits": {"timeout_s": 30}},
    }
}
NO_SHELL = {"capabilities": {"fs.read": {"paths": ["**"]}, "fs.write": {"paths": ["src/**"]}}}
NO_WRITES = {"capabilities": {"fs.read": {"paths": ["**"]}}}


@pytest.fixture
def broker(monkeypatch):
    """Records every command sent, decoded (the real broker is not needed to judge them)."""
    sent = []
    monkeypatch.setattr(
        "kestrel_one.celery.app.send_task", lambda name, args, **_: sent.append(args[0])
    )
    return sent


def claims(command: str):
    return verify_command(command, control_public_key=control_public_key_pem(), pool="default")


def principal(actor) -> Principal:
    return Principal(PrincipalKind.TOKEN, user=actor.user, token=actor.token)


def publish(project, document):
    return policy_publish_project(
        actor=system_principal("tests"), project=project, document=document
    )


@pytest.mark.spec("POL-3", "POL-6")
def test_an_approval_after_a_narrowing_ends_the_action_denied(world, broker):
    thread, action_id = awaiting(world)
    narrowed = publish(world.project, NO_SHELL)
    response = world["admin"].client().post(action_url(world, thread, action_id, "/approve"))
    assert response.status_code == 409, response.content
    assert narrowed.public_id in response.json()["error"]["message"]
    action = Action.objects.get(public_id=action_id)
    assert action.state == "denied"
    assert action.error["code"] == "policy_denies"
    assert narrowed.public_id in action.error["message"]
    assert action.decision["outcome"] == "deny"
    assert action.policy_version == policy_version_label(project=world.project, mode=Mode.AGENT)
    assert not Approval.objects.filter(action=action).exists()
    assert broker == []
    assert AuditRecord.objects.filter(action="action.redecide", outcome="deny").count() == 1


def _queued_unsent(world, tool: str, args: dict) -> Action:
    """An allowed action whose command never reached the broker (its send is lost): the
    request's own send runs after commit, which a test's transaction never reaches."""
    thread = thread_create(
        actor=system_principal("tests"), project=world.project, title="t", mode="agent"
    )
    action = action_request(actor=principal(world["owner"]), thread=thread, tool=tool, args=args)
    assert action.state == "queued" and action.attempt == 1
    Action.objects.filter(pk=action.pk).update(created_at=timezone.now() - timedelta(minutes=5))
    return action


@pytest.mark.spec("POL-3", "POL-6")
def test_the_sweep_decides_again_and_never_resigns_a_denied_action(world, broker):
    publish(world.project, WITH_APPROVAL)
    action = _queued_unsent(world, "fs.write", {"path": "src/a.py", "content": "x"})
    narrowed = publish(world.project, NO_WRITES)
    assert calls_sweep()["redispatched"] == 0
    action.refresh_from_db()
    assert action.state == "denied" and action.finished_at is not None
    assert action.error["code"] == "policy_denies"
    assert narrowed.public_id in action.error["message"]
    assert action.attempt == 1, "never signed again"
    assert broker == []


@pytest.mark.spec("POL-6")
def test_the_sweep_signs_an_allowed_action_under_the_current_version(world, broker):
    publish(world.project, WITH_APPROVAL)
    action = _queued_unsent(world, "code.python", {"code": "print(1)"})
    old_version = action.policy_version
    narrowed = {**WITH_APPROVAL["capabilities"], "code.exec": {"limits": {"timeout_s": 7}}}
    publish(world.project, {"capabilities": narrowed})
    assert calls_sweep()["redispatched"] == 1
    action.refresh_from_db()
    now = policy_version_label(project=world.project, mode=Mode.AGENT)
    assert action.state == "queued" and action.policy_version == now != old_version
    [command] = broker
    signed = claims(command)
    assert signed.policy_version == now and signed.limits["timeout_s"] == 7


@pytest.mark.spec("POL-6")
def test_an_approved_action_the_new_version_wants_approved_again_is_cancelled(world, broker):
    _, action_id = awaiting(world)
    action = Action.objects.get(public_id=action_id)
    # Approved, but its command lost before it was sent (the dispatch runs after commit).
    approval_decide(actor=principal(world["admin"]), action=action, approve=True)
    Action.objects.filter(pk=action.pk).update(created_at=timezone.now() - timedelta(minutes=5))
    publish(world.project, WITH_APPROVAL)
    assert calls_sweep()["redispatched"] == 0
    action.refresh_from_db()
    assert action.state == "cancelled" and action.error["code"] == "policy_changed"
    assert broker == []


@pytest.mark.spec("POL-3", "POL-6")
@pytest.mark.django_db(transaction=True)
def test_approvals_racing_narrowings_never_send_a_command_the_current_policy_denies(
    world, broker, monkeypatch
):
    """Each round, a person approves while a narrowing that denies the call is published.
    Whichever wins, no command is signed under versions that are not the current ones."""
    signed_under_stale, real_sign = [], services._signed_command

    def checked_sign(action):
        # Read on the signing transaction's own connection: it sees every committed publish.
        now = policy_version_label(project=action.project, mode=Mode(action.mode))
        if now != action.policy_version:
            signed_under_stale.append((action.public_id, action.policy_version, now))
        return real_sign(action)

    monkeypatch.setattr(services, "_signed_command", checked_sign)
    project = Project.objects.get(pk=world.project.pk)
    outcomes = []
    for _ in range(15):
        publish(project, WITH_APPROVAL)
        _, action_id = awaiting(world)
        action = Action.objects.get(public_id=action_id)
        barrier = threading.Barrier(2)

        def approve(action=action, barrier=barrier):
            barrier.wait()
            try:
                approval_decide(actor=principal(world["admin"]), action=action, approve=True)
            except Conflict:
                pass  # the narrowing won: the action is denied (checked below)
            finally:
                connection.close()

        def narrow(barrier=barrier):
            barrier.wait()
            try:
                publish(project, NO_SHELL)
            finally:
                connection.close()

        workers = [threading.Thread(target=approve), threading.Thread(target=narrow)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        action.refresh_from_db()
        outcomes.append((action.state, (action.error or {}).get("code")))
    assert signed_under_stale == []
    # The approval won (queued, sent) or the narrowing did (denied by the re-decision).
    assert set(outcomes) <= {("queued", None), ("denied", "policy_denies")}, outcomes
    # Every command sent went out under the version with approval, before the narrowing.
    for command in broker:
        assert claims(command).policy_version.count("prj:") == 1
    assert len(broker) + Action.objects.filter(state="denied").count() == 15
