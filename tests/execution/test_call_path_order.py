"""What a call's transactions leave for after commit, and in which order (docs/performance.md,
"The governed path, stage by stage").

Commit hooks run in the order they were registered. The hooks that start the next step of
the call go first: the signed command before the request chains its audit record, and the
notice that wakes a waiting request before the receivers of ``action_ended``. A call's
events are numbered in one statement per transaction, however many it appends.
"""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from kestrel_one.accounts.principal import Principal, PrincipalKind
from kestrel_one.audit.models import AuditRecord
from kestrel_one.execution.models import ActionState
from kestrel_one.execution.services import action_request, report_ingest
from kestrel_one.execution.signals import action_ended
from kestrel_one.threads.models import ThreadEvent
from tests.execution.reports import report

SEQUENCE_STATEMENT = "SET last_event_sequence = last_event_sequence +"


def principal_of(actor) -> Principal:
    return Principal(PrincipalKind.TOKEN, user=actor.user, token=actor.token)


def sequence_statements(captured) -> int:
    return sum(SEQUENCE_STATEMENT in query["sql"] for query in captured.captured_queries)


@pytest.fixture
def sent(monkeypatch):
    """A broker stand-in: each command sent, with whether the request's audit record was
    already chained when it was sent."""
    sent = []

    def send_task(name, args, queue):
        pending = AuditRecord.objects.filter(
            action="action.request", sequence__isnull=True
        ).exists()
        sent.append({"task": name, "token": args[0], "audit_pending": pending})

    monkeypatch.setattr("kestrel_one.celery.app.send_task", send_task)
    return sent


def request_write(world, thread):
    return action_request(
        actor=principal_of(world["owner"]),
        thread=thread,
        tool="fs.write",
        args={"path": "src/main.py", "content": "print('hi')\n"},
    )


def test_the_command_goes_to_the_broker_before_the_audit_record_is_chained(
    world, thread, sent, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True):
        action = request_write(world, thread)

    assert action.state == ActionState.QUEUED
    assert [entry["task"] for entry in sent] == ["runner.execute"]
    # Sent first: the record was still pending then, and chained by the hooks after it.
    assert sent[0]["audit_pending"] is True
    record = AuditRecord.objects.get(action="action.request", target_id=action.public_id)
    assert record.sequence is not None


def test_a_request_numbers_its_two_events_in_one_statement(world, thread, sent):
    with CaptureQueriesContext(connection) as captured:
        action = request_write(world, thread)

    assert sequence_statements(captured) == 1
    events = list(
        ThreadEvent.objects.filter(action=action).order_by("sequence").values("kind", "sequence")
    )
    assert [event["kind"] for event in events] == ["action.requested", "action.decided"]
    first = events[0]["sequence"]
    assert [event["sequence"] for event in events] == [first, first + 1]
    # Gap-free after the thread's own first event.
    assert list(ThreadEvent.objects.filter(thread=thread).values_list("sequence", flat=True)) == [
        1,
        2,
        3,
    ]


def test_a_report_wakes_the_waiting_request_before_the_ending_receivers_run(
    world, thread, sent, runner, runner_key, monkeypatch, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True):
        action = request_write(world, thread)
    action.refresh_from_db()
    order = []
    monkeypatch.setattr(
        "kestrel_one.threads.notify._publish", lambda public_id: order.append(("notice", public_id))
    )

    def ended(sender, public_id, **kwargs):
        order.append(("ended", public_id))

    action_ended.connect(ended, dispatch_uid="test-call-path-order")
    try:
        with (
            django_capture_on_commit_callbacks(execute=True),
            CaptureQueriesContext(connection) as captured,
        ):
            assert report_ingest(report(action, runner, runner_key)) == "succeeded"
    finally:
        action_ended.disconnect(dispatch_uid="test-call-path-order")

    assert order == [("notice", action.public_id), ("ended", action.public_id)]
    # Never reported started: its start and its finish, numbered in one statement, in order.
    assert sequence_statements(captured) == 1
    events = ThreadEvent.objects.filter(action=action).order_by("sequence")
    kinds = list(events.values_list("kind", flat=True))
    assert kinds == ["action.requested", "action.decided", "action.started", "action.finished"]
    sequences = list(
        ThreadEvent.objects.filter(thread=thread)
        .order_by("sequence")
        .values_list("sequence", flat=True)
    )
    assert sequences == list(range(1, len(sequences) + 1))
