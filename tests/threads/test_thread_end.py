"""Ending a thread over HTTP: who may, what it records, what it refuses afterwards, and the
signed notice the runners of the thread's pools get after commit."""

from __future__ import annotations

import logging

import kombu.exceptions
import pytest
from django.conf import settings

from kestrel_one.audit.models import AuditRecord
from kestrel_one.execution.keys import control_private_key
from kestrel_one.execution.models import Action, Approval, IdempotencyKey, Plan
from kestrel_one.threads.models import Thread, ThreadEvent
from runners.contract.names import control_exchange
from runners.contract.tokens import (
    CommandRefused,
    public_key_pem,
    verify_command,
    verify_control_message,
)

BASE = "/api/v1/orgs/acme/projects/{prj}/threads/{thr}"


def thread_url(world, thread=None, suffix: str = "") -> str:
    thread = thread or world.thread
    return BASE.format(prj=world.project.public_id, thr=thread.public_id) + suffix


def end(client, world, thread=None):
    return client.post(thread_url(world, thread, "/end"), {}, format="json")


def written_rows() -> dict[str, int]:
    """Row counts of everything a request on a thread could write."""
    return {
        "actions": Action.objects.count(),
        "events": ThreadEvent.objects.count(),
        "audit": AuditRecord.objects.count(),
        "plans": Plan.objects.count(),
        "approvals": Approval.objects.count(),
        "idempotency": IdempotencyKey.objects.count(),
    }


@pytest.fixture
def sent(monkeypatch):
    """Stands in for the broker: records every message the control plane sends."""
    messages = []
    monkeypatch.setattr("kestrel_one.celery.app.send_task", lambda *a, **k: messages.append((a, k)))
    return messages


def test_member_ends_a_thread_with_an_event_and_an_audit_record(
    world, sent, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True):
        response = end(world["member"].client(), world)

    assert response.status_code == 200, response.content
    body = response.json()
    assert body["id"] == world.thread.public_id
    assert body["status"] == "ended" and body["ended_at"]
    world.thread.refresh_from_db()
    assert world.thread.status == Thread.Status.ENDED
    last = world.thread.events.order_by("-sequence").first()
    assert last.kind == "thread.ended"
    assert last.sequence == world.thread.last_event_sequence
    record = AuditRecord.objects.get(action="thread.end", target_id=world.thread.public_id)
    assert record.actor_id == world["member"].token.public_id
    assert record.organization_id == world.org.pk
    shown = world["viewer"].client().get(thread_url(world)).json()
    assert (shown["status"], shown["ended_at"]) == ("ended", body["ended_at"])
    assert len(sent) == 1  # the thread's one pool was told, after commit


def test_ending_an_ended_thread_changes_and_sends_nothing(
    world, sent, django_capture_on_commit_callbacks
):
    first = end(world["owner"].client(), world)
    rows = written_rows()
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        again = end(world["member"].client(), world)

    assert again.status_code == 200
    assert again.json() == first.json()
    assert written_rows() == rows
    assert callbacks == [] and sent == []


def test_a_new_thread_is_open(world):
    response = (
        world["member"]
        .client()
        .post(
            f"/api/v1/orgs/acme/projects/{world.project.public_id}/threads",
            {"title": "fresh", "mode": "agent"},
            format="json",
        )
    )
    assert response.status_code == 201
    assert (response.json()["status"], response.json()["ended_at"]) == ("open", None)


@pytest.mark.parametrize("idempotency_key", [None, "retry-1"])
def test_an_action_on_an_ended_thread_is_refused_and_writes_nothing(world, sent, idempotency_key):
    end(world["owner"].client(), world)
    rows = written_rows()
    headers = {"HTTP_IDEMPOTENCY_KEY": idempotency_key} if idempotency_key else {}
    response = (
        world["member"]
        .client()
        .post(
            thread_url(world, suffix="/actions"),
            {"tool": "fs.read", "args": {"path": "README.md"}},
            format="json",
            **headers,
        )
    )

    assert response.status_code == 409, response.content
    error = response.json()["error"]
    assert error["code"] == "thread_ended"
    assert "ended" in error["message"]
    assert written_rows() == rows
    assert sent == []


def test_a_plan_on_an_ended_thread_is_refused_and_cannot_be_accepted(world, sent):
    owner = world["owner"].client()
    end(owner, world, world.plan_thread)
    rows = written_rows()

    proposed = owner.post(
        thread_url(world, world.plan_thread, "/plans"),
        {"steps": [{"tool": "fs.read", "args": {"path": "README.md"}}]},
        format="json",
    )
    accepted = owner.post(
        thread_url(world, world.plan_thread, f"/plans/{world.plan.public_id}/accept"),
        {},
        format="json",
    )

    for response in (proposed, accepted):
        assert response.status_code == 409, response.content
        assert response.json()["error"]["code"] == "thread_ended"
    assert written_rows() == rows
    world.plan.refresh_from_db()
    assert world.plan.state == "proposed"


def test_an_awaiting_action_cannot_be_approved_after_the_end_but_can_be_denied(world, sent):
    owner = world["owner"].client()
    end(owner, world)
    action_url = thread_url(world, suffix=f"/actions/{world.action.public_id}")

    approved = owner.post(f"{action_url}/approve", {}, format="json")
    assert approved.status_code == 409
    assert approved.json()["error"]["code"] == "thread_ended"
    world.action.refresh_from_db()
    assert world.action.state == "awaiting_approval"

    denied = owner.post(f"{action_url}/deny", {"reason": "thread is over"}, format="json")
    assert denied.status_code == 200, denied.content
    assert denied.json()["state"] == "denied"


def test_a_queued_action_is_left_to_finish(world, sent):
    queued = world.action
    Action.objects.filter(pk=queued.pk).update(state="running")
    end(world["owner"].client(), world)
    queued.refresh_from_db()
    assert queued.state == "running"  # the runner's report still records it normally


@pytest.mark.parametrize("name", ["viewer", "limited", "outsider", "anonymous"])
def test_callers_without_write_access_cannot_end_a_thread(world, sent, name):
    rows = written_rows()
    response = end(world[name].client(), world)
    expected = {"viewer": 403, "limited": 404, "outsider": 404, "anonymous": 401}[name]
    assert response.status_code == expected
    world.thread.refresh_from_db()
    assert world.thread.status == Thread.Status.OPEN
    # A member's 403 is itself audited as a refusal; nothing else is written.
    after = written_rows()
    if name == "viewer":
        assert AuditRecord.objects.filter(outcome="refused").exists()
        after["audit"] = rows["audit"]
    assert after == rows


def test_runners_get_a_signed_thread_end_notice_on_a_fanout_exchange(
    world, sent, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True):
        end(world["owner"].client(), world)

    ((args, options),) = sent
    assert args[0] == "runner.control"
    pool = settings.KESTREL_DEFAULT_POOL
    assert options["exchange"].name == control_exchange(pool)
    assert options["exchange"].type == "fanout"
    assert options["routing_key"] == control_exchange(pool)
    (token,) = options["args"]
    control_public = public_key_pem(control_private_key())
    message = verify_control_message(token, control_public_key=control_public, pool=pool)
    assert message.type == "thread.end"
    assert (message.org, message.env, message.prj, message.thr) == (
        world.org.public_id,
        world.environment.public_id,
        world.project.public_id,
        world.thread.public_id,
    )
    assert message.exp - message.iat <= 120
    # It can never pass for a command.
    with pytest.raises(CommandRefused):
        verify_command(token, control_public_key=control_public, pool=pool)


def test_a_thread_without_actions_sends_no_notice(world, sent, django_capture_on_commit_callbacks):
    owner = world["owner"].client()
    created = owner.post(
        f"/api/v1/orgs/acme/projects/{world.project.public_id}/threads",
        {"title": "idle", "mode": "agent"},
        format="json",
    ).json()
    thread = Thread.objects.get(public_id=created["id"])
    with django_capture_on_commit_callbacks(execute=True):
        assert end(owner, world, thread).status_code == 200
    assert sent == []


def test_a_broker_failure_does_not_fail_the_end_and_logs_no_token(
    world, monkeypatch, caplog, django_capture_on_commit_callbacks
):
    tokens = []

    def unreachable(*args, **kwargs):
        tokens.extend(kwargs["args"])
        raise kombu.exceptions.OperationalError("Error 111 connecting to broker")

    monkeypatch.setattr("kestrel_one.celery.app.send_task", unreachable)
    with caplog.at_level(logging.WARNING), django_capture_on_commit_callbacks(execute=True):
        response = end(world["owner"].client(), world)

    assert response.status_code == 200
    assert response.json()["status"] == "ended"
    assert tokens, "the notice was attempted"
    assert "not sent" in caplog.text and "OperationalError" in caplog.text
    assert not any(token in caplog.text for token in tokens)
    assert not any(token.split(".")[2] in caplog.text for token in tokens)
