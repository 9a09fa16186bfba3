"""A broker that does not answer: a call that would run is refused at once (503) and not
recorded; a denial is still a denial and a call needing approval still waits for a person;
an approved call that cannot be dispatched says so, and is sent when the broker is back."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from kestrel_one.audit.models import AuditRecord
from kestrel_one.execution.models import Action, IdempotencyKey
from kestrel_one.execution.services import calls_sweep
from tests.execution.test_actions_api import action_url, new_thread, request_action
from tests.support import free_port


@pytest.fixture
def sent(monkeypatch):
    """Every command handed to the broker (none may be while it does not answer)."""
    commands = []
    monkeypatch.setattr("kestrel_one.celery.app.send_task", lambda *a, **k: commands.append(a))
    return commands


class Broker:
    def __init__(self, settings, how: str):
        self.settings = settings
        self.how = how
        self.real = (settings.REDIS_URL, settings.CELERY_BROKER_URL)

    def stop(self) -> None:
        if self.how == "unreachable":  # a port nobody listens on
            self.settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"
        else:  # none configured at all
            self.settings.REDIS_URL = None
        self.settings.CELERY_BROKER_URL = self.settings.REDIS_URL

    def start(self) -> None:
        self.settings.REDIS_URL, self.settings.CELERY_BROKER_URL = self.real


@pytest.fixture(params=["unreachable", "not configured"])
def broker_down(settings, request):
    broker = Broker(settings, request.param)  # ``settings`` puts the real one back afterwards
    broker.stop()
    return broker


def test_a_call_that_would_run_is_refused_at_once_and_not_recorded(world, broker_down, sent):
    member = world["member"].client()
    thread = new_thread(member, world, "agent")
    before = Action.objects.count()
    response = member.post(
        f"/api/v1/orgs/acme/projects/{world.project.public_id}/threads/{thread}/actions?wait=60",
        {"tool": "fs.write", "args": {"path": "src/a.py", "content": "x"}},
        format="json",
        HTTP_IDEMPOTENCY_KEY="first-try",
    )
    # Without the check the call was recorded as queued and the request waited all 60 s.
    assert response.status_code == 503, response.content
    error = response.json()["error"]
    assert error["code"] == "unavailable" and "broker" in error["message"]
    assert Action.objects.count() == before
    assert not IdempotencyKey.objects.filter(key="first-try").exists()
    assert sent == []


def test_a_denial_is_still_a_denial_with_no_broker(world, broker_down, sent):
    member = world["member"].client()
    thread = new_thread(member, world, "agent")
    # The environment allows writes under src/** and out/** only.
    response = request_action(member, world, thread, "fs.write", {"path": "etc/x", "content": "x"})
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["state"] == "denied" and body["decision"]["outcome"] == "deny"
    assert body["decision"]["reasons"]
    record = AuditRecord.objects.get(action="action.request", target_id=body["id"])
    assert record.outcome == "deny"
    assert sent == []


def test_a_call_needing_approval_waits_then_is_sent_when_the_broker_is_back(
    world, broker_down, sent, django_capture_on_commit_callbacks
):
    member = world["member"].client()
    thread = new_thread(member, world, "agent")
    requested = request_action(member, world, thread, "shell.exec", {"argv": ["make"]})
    assert requested.status_code == 201 and requested.json()["state"] == "awaiting_approval"
    action = requested.json()["id"]

    with django_capture_on_commit_callbacks(execute=True):
        approved = world["admin"].client().post(action_url(world, thread, action, "/approve"))
    assert approved.status_code == 200, approved.content
    body = world["admin"].client().get(action_url(world, thread, action)).json()
    assert body["state"] == "queued" and body["dispatched_at"] is None
    assert body["error"]["code"] == "dispatch_pending"
    assert sent == []

    broker_down.start()
    Action.objects.filter(public_id=action).update(created_at=timezone.now() - timedelta(minutes=1))
    assert calls_sweep()["redispatched"] == 1
    assert len(sent) == 1 and sent[0][0] == "runner.execute"
    body = world["admin"].client().get(action_url(world, thread, action)).json()
    assert body["dispatched_at"] is not None and body["error"] is None
