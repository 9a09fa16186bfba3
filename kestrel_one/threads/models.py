"""Threads of work inside a project, and their ordered, gap-free events."""

from __future__ import annotations

from django.db import models

from kestrel_one.common.ids import PublicIdField
from policies import Mode


class Thread(models.Model):
    """One conversation or task in a project; actions and events hang off it."""

    MODES = [(mode.value, mode.value) for mode in Mode]

    class Status(models.TextChoices):
        OPEN = "open"
        # Takes no new action or plan; what was already queued or running still finishes.
        ENDED = "ended"

    public_id = PublicIdField("thr")
    organization = models.ForeignKey(
        "tenancy.Organization", on_delete=models.CASCADE, related_name="threads"
    )
    project = models.ForeignKey("tenancy.Project", on_delete=models.CASCADE, related_name="threads")
    title = models.CharField(max_length=200)
    mode = models.CharField(max_length=8, choices=MODES, default=Mode.AGENT.value)
    status = models.CharField(max_length=8, choices=Status.choices, default=Status.OPEN)
    ended_at = models.DateTimeField(null=True, blank=True)
    # The last event sequence handed out; locking the thread row serializes appends, which
    # keeps the sequence gap-free under concurrent requests.
    last_event_sequence = models.BigIntegerField(default=0)
    created_by = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        indexes = [models.Index(fields=["project", "public_id"])]

    def __str__(self) -> str:
        return self.title


class ThreadEvent(models.Model):
    """Something that happened in a thread, in order: requested, decided, started, finished."""

    thread = models.ForeignKey(Thread, on_delete=models.CASCADE, related_name="events")
    organization = models.ForeignKey(
        "tenancy.Organization", on_delete=models.CASCADE, related_name="+"
    )
    sequence = models.BigIntegerField()
    kind = models.CharField(max_length=40)
    action = models.ForeignKey(
        "execution.Action", null=True, blank=True, on_delete=models.CASCADE, related_name="events"
    )
    # Redacted and bounded before it is stored (kestrel_one.common.redaction).
    data = models.JSONField(default=dict)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["thread", "sequence"], name="event_sequence_per_thread")
        ]
        ordering = ["thread_id", "sequence"]

    def __str__(self) -> str:
        return f"{self.thread_id}#{self.sequence} {self.kind}"
