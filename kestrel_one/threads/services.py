"""Writes for threads and their events."""

from __future__ import annotations

from django.db import transaction

from kestrel_one.common.redaction import bounded
from kestrel_one.threads.models import Thread, ThreadEvent
from kestrel_one.threads.notify import action_changed
from kestrel_one.webhooks.services import webhook_emit_thread_event

EVENT_DATA_MAX_BYTES = 4096


@transaction.atomic
def event_append(*, thread: Thread, kind: str, data: dict, action=None) -> ThreadEvent:
    """Append the thread's next event; the row lock keeps the sequence ordered and gap-free."""
    locked = Thread.objects.select_for_update().only("pk", "last_event_sequence").get(pk=thread.pk)
    sequence = locked.last_event_sequence + 1
    Thread.objects.filter(pk=thread.pk).update(last_event_sequence=sequence)
    event = ThreadEvent.objects.create(
        thread=thread,
        organization_id=thread.organization_id,
        sequence=sequence,
        kind=kind,
        action=action,
        data=bounded(data, max_bytes=EVENT_DATA_MAX_BYTES),
    )
    # The webhook outbox row is written in this same transaction (kestrel_one.webhooks).
    webhook_emit_thread_event(event=event)
    if action is not None:
        action_changed(action.public_id)  # wakes ?wait= long polls after commit
    return event


@transaction.atomic
def thread_create(*, actor, project, title: str, mode: str) -> Thread:
    from kestrel_one.audit.services import audit_record

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
