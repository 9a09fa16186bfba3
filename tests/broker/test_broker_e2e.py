"""The control plane's checks on brokered requests (CRED-3), with a real Docker runner worker
and a real control worker: forged, unsigned and replayed requests, and requests for calls
that do not run on the signing runner, are refused. The workload's own calls through the
broker are in test_broker_adapters_e2e.py."""

from __future__ import annotations

import json
import time

import pytest
import redis
from django.conf import settings
from django.db import connection

from kestrel_one.accounts.principal import Principal, PrincipalKind, system_principal
from kestrel_one.audit.models import AuditRecord
from kestrel_one.credentials.services import credential_create
from kestrel_one.execution.enrollment import runner_enroll
from kestrel_one.execution.keys import control_public_key_pem
from kestrel_one.execution.models import Action, ActionState
from kestrel_one.execution.services import action_request
from kestrel_one.governance.services import surface_policy_publish
from kestrel_one.sandbox_broker.models import BrokeredRequest
from runners.contract.adapter_broker import (
    new_request_id,
    reply_key,
    sign_adapter_request,
    verify_adapter_answer,
)
from runners.contract.names import ADAPTER_REQUEST_TASK, REPORT_QUEUE
from runners.contract.tokens import generate_private_key_pem, public_key_pem
from tests.execution.workers import governed_thread, real_workers

RUNNER_ID = "run_BROKERE2E00000000000000000"
pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.docker,
    pytest.mark.spec("CRED-3"),
]

POLICY = {
    "capabilities": {
        "shell.exec": {"limits": {"timeout_s": 30, "memory_mb": 256, "pids": 64}},
    }
}
ADAPTER_GRANT = {"approval": "never", "adapters": {"github": {"operations": ["issues.list"]}}}


@pytest.fixture(scope="module")
def workers(django_db_setup, django_db_blocker, tmp_path_factory, docker_backend):
    with django_db_blocker.unblock():
        database = connection.settings_dict
    with real_workers(
        tmp_path_factory.mktemp("broker"), runner_id=RUNNER_ID, database=database
    ) as files:
        yield files


@pytest.fixture
def e2e(workers, world):
    thread = governed_thread(workers, world.org, runner_id=RUNNER_ID, policy=POLICY, name="brk")
    owner = world["owner"]
    return {
        "thread": thread,
        "actor": Principal(PrincipalKind.TOKEN, user=owner.user, token=owner.token),
        "logs": workers["logs"],
        "key": workers["key"].read_bytes(),
    }


def request(e2e, args: dict) -> Action:
    action = action_request(actor=e2e["actor"], thread=e2e["thread"], tool="shell.exec", args=args)
    assert action.state == ActionState.QUEUED, action.decision
    return action


def wait_for(e2e, action: Action, states) -> Action:
    for _ in range(600):  # bounded: 600 polls of 0.2 s
        action.refresh_from_db()
        if action.state in states:
            return action
        time.sleep(0.2)
    logs = "".join(
        (e2e["logs"] / n).read_text()[-4000:] for n in ("runner.log", "control.log", "reports.log")
    )
    raise AssertionError(f"{action.public_id} stayed {action.state}; logs:\n{logs}")


def finished(e2e, action: Action) -> Action:
    return wait_for(e2e, action, {ActionState.SUCCEEDED, ActionState.FAILED})


def broker_redis() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL)


def send_request(token: str) -> None:
    from kestrel_one.celery import app

    app.send_task(ADAPTER_REQUEST_TASK, args=[token], queue=REPORT_QUEUE)


def signed(
    e2e,
    action: Action,
    *,
    key: bytes | None = None,
    request_id: str | None = None,
    args: dict | None = None,
):
    request_id = request_id or new_request_id()
    token = sign_adapter_request(
        call_id=action.public_id,
        command_digest=action.command_digest,
        request={"adapter": "github", "operation": "issues.list", "args": args or {}},
        private_key=key or e2e["key"],
        runner_id=RUNNER_ID,
        lifetime_s=60,
        request_id=request_id,
    )
    return request_id, token


def answer_to(request_id: str, action: Action, *, timeout: float = 30):
    popped = broker_redis().brpop([reply_key("default", request_id)], timeout=timeout)
    if popped is None:
        return None
    return verify_adapter_answer(
        popped[1].decode(),
        control_public_key=control_public_key_pem(),
        pool="default",
        request_id=request_id,
        call_id=action.public_id,
    )


def test_a_forged_or_unsigned_request_is_refused_and_the_real_one_answered(e2e):
    running = request(e2e, {"argv": ["sleep", "25"]})
    running = wait_for(e2e, running, {ActionState.RUNNING})
    forged_id, forged = signed(e2e, running, key=generate_private_key_pem())
    for token in ("not-a-token", "a.b.c", forged):
        send_request(token)
    # The genuine request, sent last: the control worker takes them in order.
    genuine_id, genuine = signed(e2e, running)
    send_request(genuine)
    answer = answer_to(genuine_id, running)
    assert answer is not None and answer.call_id == running.public_id
    assert broker_redis().llen(reply_key("default", forged_id)) == 0
    assert not BrokeredRequest.objects.filter(request_id=forged_id).exists()
    assert BrokeredRequest.objects.filter(request_id=genuine_id, parent=running).count() == 1
    # The same request id again (a replay, or the broker's message delivered twice): no
    # second child, and no second answer that the first waiter could take for its own.
    send_request(genuine)
    probe_id, probe = signed(e2e, running)
    send_request(probe)
    assert answer_to(probe_id, running) is not None
    assert BrokeredRequest.objects.filter(request_id=genuine_id).count() == 1
    assert broker_redis().llen(reply_key("default", genuine_id)) == 0
    # Another enrolled runner of the same pool, with its own valid key, asking for this call:
    # it is not running there.
    other_key = generate_private_key_pem()
    other = runner_enroll(
        actor=system_principal("tests"),
        pool="default",
        public_key_pem=public_key_pem(other_key).decode(),
    )
    other_id = new_request_id()
    send_request(
        sign_adapter_request(
            call_id=running.public_id,
            command_digest=running.command_digest,
            request={"adapter": "github", "operation": "issues.list", "args": {}},
            private_key=other_key,
            runner_id=other.public_id,
            lifetime_s=60,
            request_id=other_id,
        )
    )
    refused = answer_to(other_id, running)
    assert refused.outcome == "refused" and refused.error["code"] == "call_not_running"
    assert not BrokeredRequest.objects.filter(request_id=other_id).exists()
    finished(e2e, running)


def test_a_request_naming_a_call_not_running_on_that_runner_is_refused(e2e):
    done = finished(e2e, request(e2e, {"argv": ["true"]}))
    request_id, token = signed(e2e, done)
    send_request(token)
    answer = answer_to(request_id, done)
    assert answer is not None
    assert answer.outcome == "refused" and answer.action is None
    assert answer.error["code"] == "call_not_running"
    assert not BrokeredRequest.objects.filter(parent=done).exists()
    assert not Action.objects.filter(thread=done.thread, tool="adapter.invoke").exists()
    assert AuditRecord.objects.filter(
        action="adapter.broker_request_refused", target_id=done.public_id
    ).exists()
    # A call id that was never sent at all.
    ghost = Action(public_id="act_01GHOSTGHOSTGHOSTGHOSTGHOS", command_digest="0" * 64)
    request_id, token = signed(e2e, ghost)
    send_request(token)
    assert answer_to(request_id, ghost).error["code"] == "call_not_running"
    json.dumps(answer.error)  # plain JSON, as the workload receives it


@pytest.mark.spec("POL-2")
def test_a_brokered_call_is_judged_on_the_surface_its_parent_came_through(workers, world):
    """The workload's adapter call is requested as its parent's requester, so it meets the
    same policy terms, the parent's surface among them. An mcp surface policy that grants
    shell.exec but no adapter.invoke denies the adapter call of a script started over MCP,
    although the environment grants it (and the api surface, with no policy, would too)."""
    policy = {"capabilities": {**POLICY["capabilities"], "adapter.invoke": ADAPTER_GRANT}}
    thread = governed_thread(workers, world.org, runner_id=RUNNER_ID, policy=policy, name="srf")
    owner = world["owner"]
    actor = Principal(PrincipalKind.TOKEN, user=owner.user, token=owner.token)
    # Never used: the call is denied before any adapter worker would decrypt it.
    credential_create(
        actor=system_principal("tests"),
        organization=world.org,
        name="github",
        adapter="github",
        secret="ghp_" + "s" * 36,
    )
    version = surface_policy_publish(
        actor=Principal(PrincipalKind.SESSION, user=owner.user),
        organization=world.org,
        surface="mcp",
        document={"capabilities": {"shell.exec": POLICY["capabilities"]["shell.exec"]}},
    )
    parent = action_request(
        actor=actor, thread=thread, tool="shell.exec", args={"argv": ["sleep", "25"]}, surface="mcp"
    )
    assert parent.state == ActionState.QUEUED, parent.decision
    e2e = {"logs": workers["logs"], "key": workers["key"].read_bytes()}
    parent = wait_for(e2e, parent, {ActionState.RUNNING})
    request_id, token = signed(e2e, parent, args={"owner": "acme", "repo": "widgets"})
    send_request(token)
    answer = answer_to(request_id, parent)
    assert answer is not None
    child = BrokeredRequest.objects.get(request_id=request_id).child
    assert child is not None, answer.error
    assert child.surface == "mcp"
    assert child.state == ActionState.DENIED
    assert f"mcp surface policy ({version.public_id})" in child.decision["reasons"][0]
    # Its parent ends before the test does: a report ingested while the database is flushed
    # for the next test deadlocks with the flush.
    finished(e2e, parent)
