"""``execution.signals.action_ended``: sent once, after commit, from every terminal transition
(what the broker's answer to a waiting workload hangs on, CRED-3)."""

from __future__ import annotations

import pytest
from django.db import transaction

from kestrel_one.accounts.principal import Principal, PrincipalKind
from kestrel_one.execution.approvals import approval_decide
from kestrel_one.execution.models import ActionState
from kestrel_one.execution.services import (
    APPROVAL_EXPIRED,
    action_dispatch,
    action_request,
    end_action,
    report_ingest,
)
from kestrel_one.execution.signals import action_ended
from runners.contract.tokens import sign_result

pytestmark = pytest.mark.spec("CRED-3")


@pytest.fixture
def ended():
    seen: list[tuple[str, str]] = []

    def record(sender, public_id, state, **kwargs):
        seen.append((public_id, state))

    action_ended.connect(record, dispatch_uid="test-action-ended")
    yield seen
    action_ended.disconnect(dispatch_uid="test-action-ended")


def agent(world) -> Principal:
    owner = world["owner"]
    return Principal(PrincipalKind.TOKEN, user=owner.user, token=owner.token)


def person(world) -> Principal:
    return Principal(PrincipalKind.SESSION, user=world["owner"].user)


def test_denied_at_request_and_denied_by_a_person_each_send_it_once_after_commit(
    world, thread, ended, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True):
        denied = action_request(
            actor=agent(world),
            thread=thread,
            tool="fs.write",
            args={"path": "etc/x", "content": ""},
        )
        assert ended == []  # not before the transaction commits
    assert denied.state == ActionState.DENIED
    assert ended == [(denied.public_id, "denied")]

    with django_capture_on_commit_callbacks(execute=True):
        waiting = action_request(
            actor=agent(world), thread=thread, tool="shell.exec", args={"argv": ["true"]}
        )
    assert waiting.state == ActionState.AWAITING_APPROVAL and len(ended) == 1
    with django_capture_on_commit_callbacks(execute=True):
        approval_decide(actor=person(world), action=waiting, approve=False)
    assert ended[1:] == [(waiting.public_id, "denied")]


def test_expiry_and_a_rolled_back_ending(world, thread, ended, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        waiting = action_request(
            actor=agent(world), thread=thread, tool="shell.exec", args={"argv": ["true"]}
        )
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        with pytest.raises(RuntimeError), transaction.atomic():
            end_action(
                waiting, ActionState.AWAITING_APPROVAL, ActionState.EXPIRED, *APPROVAL_EXPIRED
            )
            raise RuntimeError("rolled back")
    assert callbacks == [] and ended == []
    with django_capture_on_commit_callbacks(execute=True):
        assert end_action(
            waiting, ActionState.AWAITING_APPROVAL, ActionState.EXPIRED, *APPROVAL_EXPIRED
        )
        # A second ending moves nothing and sends nothing.
        assert not end_action(
            waiting, ActionState.AWAITING_APPROVAL, ActionState.EXPIRED, *APPROVAL_EXPIRED
        )
    assert ended == [(waiting.public_id, "expired")]


def test_a_recorded_finish_sends_it(world, thread, runner, runner_key, ended, monkeypatch,
                                    django_capture_on_commit_callbacks):  # fmt: skip
    monkeypatch.setattr("kestrel_one.celery.app.send_task", lambda *args, **kwargs: None)
    action = action_request(
        actor=agent(world), thread=thread, tool="fs.read", args={"path": "src/main.py"}
    )
    assert action.state == ActionState.QUEUED
    assert action_dispatch(action_id=action.pk)
    action.refresh_from_db()
    token = sign_result(
        {
            "call_id": action.public_id,
            "command_digest": action.command_digest,
            "attempt": action.attempt,
            "event": "finished",
            "outcome": "failed",
            "result": None,
            "error": {"code": "not_found", "message": "no such file"},
            "sandbox": "workspace",
            "started_at": None,
            "finished_at": None,
        },
        runner_key,
        runner.public_id,
    )
    with django_capture_on_commit_callbacks(execute=True):
        assert report_ingest(token) == "failed"
        assert report_ingest(token) == "duplicate-finish"
    assert ended == [(action.public_id, "failed")]
