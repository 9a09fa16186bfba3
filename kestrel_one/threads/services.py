"""Writes for threads and their events."""

from __future__ import annotations

from django.db import transaction
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from kestrel_one.audit.services import audit_record
from kestrel_one.common.errors import ThreadEnded
from kestrel_one.common.redaction import bounded
from kestrel_one.threads.models import Thread, ThreadEvent
from kestrel_one.threads.notify import action_changed
from kestrel_one.threads.signals import thread_ended
from kestrel_one.webhooks.services import webhook_emit_thread_event

EVENT_DATA_MAX_BYTES = 4096


def event_append(*, thread: Thread, kind: str, data: dict, action=None) -> ThreadEvent:
    """Append the thread's next event; the row lock keeps the sequence ordered and gap-free."""
    return events_append(thread=thread, events=[(kind, data)], action=action)[0]


# No savepoint when called inside a transaction (every caller but tests): nothing catches
# its errors to go on, and a savepoint is two more round trips for each of a call's events.
@transaction.atomic(savepoint=False)
def events_append(
    *, thread: Thread, events: list[tuple[str, dict]], action=None
) -> list[ThreadEvent]:
    """Append ``events`` (kind, data), in order, as the thread's next events, all about
    ``action`` if given: their numbers in one statement and their rows in one insert."""
    if not events:
        return []
    last = _take_event_sequences(thread, len(events))
    first = last - len(events) + 1
    rows = ThreadEvent.objects.bulk_create(
        [
            ThreadEvent(
                thread=thread,
                organization_id=thread.organization_id,
                sequence=first + index,
                kind=kind,
                action=action,
                data=bounded(data, max_bytes=EVENT_DATA_MAX_BYTES),
            )
            for index, (kind, data) in enumerate(events)
        ]
    )
    for event in rows:
        # The webhook outbox row is written in this same transaction (kestrel_one.webhooks).
        webhook_emit_thread_event(event=event)
    if action is not None:
        action_changed(action.public_id)  # wakes ?wait= long polls after commit
    return rows


def _take_event_sequences(thread: Thread, count: int) -> int:
    """Take the thread's next ``count`` event numbers in one statement; returns the last.
    The UPDATE holds the thread's row lock until the transaction ends, so numbers are taken
    in commit order, with no gap."""
    connection = transaction.get_connection()
    if not connection.in_atomic_block:
        raise RuntimeError("event_append must run inside the write's transaction")
    table = connection.ops.quote_name(Thread._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {table} SET last_event_sequence = last_event_sequence + %s "  # noqa: S608
            "WHERE id = %s RETURNING last_event_sequence",
            [count, thread.pk],
        )
        return cursor.fetchone()[0]


@transaction.atomic
def thread_create(*, actor, project, title: str, mode: str) -> Thread:
    thread = Thread.objects.create(
        organization=project.organization,
        project=project,
        title=title,
        mode=mode,
        created_by=actor.actor_id,
    )
    event_append(thread=thread, kind="thread.created", data={"title": title, "mode": mode})
    audit_record(
        organization=project.organization,
        actor=actor,
        action="thread.create",
        target=thread,
        data={"project": project.public_id, "mode": mode},
    )
    return thread


THREAD_ENDED_MESSAGE = (
    "This thread has ended; it takes no new actions or plans. Start a new thread to continue."
)


def thread_require_open(*, thread: Thread) -> None:
    """Refuse work on an ended thread, holding the thread's row lock until commit.

    Call it inside the write's transaction, before the first write: ``thread_end`` takes the
    same lock, so a request and an end are ordered, and a request that passed this check is
    committed before the thread can end (and is then left to finish).
    """
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("thread_require_open must run inside the write's transaction")
    status = Thread.objects.select_for_update().values_list("status", flat=True).get(pk=thread.pk)
    if status != Thread.Status.OPEN:
        raise ThreadEnded(THREAD_ENDED_MESSAGE)


@transaction.atomic
def thread_end(*, actor, thread: Thread) -> Thread:
    """End a thread: it takes no new action or plan, and runners drop what they keep for it.

    Idempotent: ending an ended thread changes and records nothing. Actions already queued
    or running finish and are recorded as usual. After commit, every runner pool the
    thread's actions were sent to gets a signed ``thread.end`` notice: the execution app
    registers that on ``thread_ended`` (``kestrel_one.execution.control``); losing it costs
    only time, the runners' idle timeout removes the containers anyway.
    """
    locked = (
        Thread.objects.select_for_update(of=("self",))
        .select_related("project__environment", "organization")
        .get(pk=thread.pk)
    )
    if locked.status == Thread.Status.ENDED:
        return locked
    locked.status = Thread.Status.ENDED
    locked.ended_at = timezone.now()
    locked.save(update_fields=["status", "ended_at", "updated_at"])
    event_append(thread=locked, kind="thread.ended", data={"ended_at": locked.ended_at.isoformat()})
    audit_record(
        organization=locked.organization,
        actor=actor,
        action="thread.end",
        target=locked,
        data={"project": locked.project.public_id},
    )
    thread_ended.send(sender=Thread, thread=locked)
    locked.refresh_from_db()
    return locked


# --- retention (called by kestrel_one.execution.retention) --------------------------------


def threads_trim(*, organization, before, busy) -> list[str]:
    """Delete whole threads (events, actions, decisions, receipts, plans, share links) whose
    last event is older than ``before``, except those ``busy`` names: a subquery on
    ``OuterRef("pk")`` the caller owns (threads with a call still pending). Their ids."""
    recent_event = ThreadEvent.objects.filter(thread=OuterRef("pk"), created_at__gte=before)
    threads = Thread.objects.filter(organization=organization, created_at__lt=before).filter(
        ~Exists(recent_event), ~Exists(busy)
    )
    thread_ids = list(threads.values_list("public_id", flat=True))
    threads.delete()
    return thread_ids


def events_trim(*, organization, before, keep: Q) -> int:
    """Delete events older than ``before`` in threads still in use, except those ``keep``
    matches (the caller's: events of calls still pending); how many."""
    deleted, _ = (
        ThreadEvent.objects.filter(organization=organization, created_at__lt=before)
        .exclude(keep)
        .delete()
    )
    return deleted
