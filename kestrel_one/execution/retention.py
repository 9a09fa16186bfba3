"""The retention sweep: the one module that says when each app trims its own tables.

Each app owns the trim of its tables (``artifacts.retention``, ``threads.services``,
``audit.services.audit_trim``, and actions here); this sweep reads an organization's
retention, calls them in order, and records what went in the organization's audit log.
It lives in execution because "a call still pending" (kept whatever its age) is execution's.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import OuterRef, Q
from django.utils import timezone

from kestrel_one.accounts.principal import system_principal
from kestrel_one.artifacts.retention import (
    RETENTION_FIELDS,
    artifacts_trim,
    checkpoints_trim,
    retention_for_sweep,
    share_links_trim,
)
from kestrel_one.audit.models import AuditRecord
from kestrel_one.audit.services import audit_record, audit_trim
from kestrel_one.execution.models import TERMINAL_STATES, Action, ActionState
from kestrel_one.tenancy.models import Organization
from kestrel_one.threads.services import events_trim, threads_trim
from kestrel_one.webhooks.services import webhook_messages_trim

# Which ids a retention sweep names in its audit record (the counts are always complete).
SWEEP_AUDIT_MAX_IDS = 50
PENDING_STATES = [state.value for state in ActionState if state not in TERMINAL_STATES]


def retention_sweep(*, now: datetime | None = None) -> dict[str, dict]:
    """Sweep every organization; each in its own transaction, so one failure stops one."""
    now = now or timezone.now()
    swept = {}
    for organization in Organization.objects.order_by("pk"):
        swept[organization.slug] = retention_sweep_organization(organization=organization, now=now)
    return swept


def actions_trim(*, organization, before: datetime) -> int:
    """Delete finished actions (with their receipts) older than ``before``; how many."""
    old_actions = Action.objects.filter(
        Q(finished_at__lt=before) | Q(finished_at__isnull=True, created_at__lt=before),
        organization=organization,
        state__in=list(TERMINAL_STATES),
    )
    deleted = old_actions.count()
    old_actions.delete()
    return deleted


@transaction.atomic
def retention_sweep_organization(*, organization, now: datetime) -> dict:
    """Delete what this organization keeps no longer, and record the sweep in its audit log.

    - Checkpoints older than ``checkpoints_days`` (their archives with them).
    - Other artifacts older than ``artifacts_days``.
    - Threads whose last event is older than ``events_days`` and with no call still pending:
      the whole thread (events, actions, decisions, receipts, plans, share links).
    - In threads still in use: events, and finished actions with their receipts, older than
      ``events_days``. The replay then says where the kept history starts.
    - Share links that have expired.
    - Webhook messages older than ``events_days`` (their bodies are events' data) that no
      delivery still waits to send, with their deliveries.
    - The audit log's records older than ``audit_days``, by the audit app's own trim, which
      keeps the remaining chain verifiable.

    Files leave the storage after this transaction commits. One audit record per sweep that
    deleted anything gives the counts and the deleted artifact, checkpoint and thread ids.
    """
    retention = retention_for_sweep(organization)
    events_cutoff = now - timedelta(days=retention.events_days)

    checkpoint_ids = checkpoints_trim(
        organization=organization, before=now - timedelta(days=retention.checkpoints_days)
    )
    artifact_ids = artifacts_trim(
        organization=organization, before=now - timedelta(days=retention.artifacts_days)
    )
    thread_ids = threads_trim(
        organization=organization,
        before=events_cutoff,
        busy=Action.objects.filter(thread=OuterRef("pk"), state__in=PENDING_STATES),
    )
    actions_deleted = actions_trim(organization=organization, before=events_cutoff)
    events_deleted = events_trim(
        organization=organization,
        before=events_cutoff,
        keep=Q(action__state__in=PENDING_STATES),
    )
    shares_deleted = share_links_trim(organization=organization, now=now)
    messages_deleted = webhook_messages_trim(organization=organization, before=events_cutoff)

    counts = {
        "checkpoints": len(checkpoint_ids),
        "artifacts": len(artifact_ids),
        "threads": len(thread_ids),
        "actions": actions_deleted,
        "events": events_deleted,
        "share_links": shares_deleted,
        "webhook_messages": messages_deleted,
    }
    if any(counts.values()):
        audit_record(
            organization=organization,
            actor=system_principal("retention"),
            action="retention.sweep",
            data={
                "now": now.isoformat(),
                "retention": {name: getattr(retention, name) for name in RETENTION_FIELDS},
                "deleted": counts,
                "checkpoints": checkpoint_ids[:SWEEP_AUDIT_MAX_IDS],
                "artifacts": artifact_ids[:SWEEP_AUDIT_MAX_IDS],
                "threads": thread_ids[:SWEEP_AUDIT_MAX_IDS],
            },
        )
    counts["audit_records"] = _audit_trim(
        organization=organization, before=now - timedelta(days=retention.audit_days)
    )
    return counts


def _audit_trim(*, organization, before: datetime) -> int:
    """Trim the audit chain through the audit app's own service; this sweep only says when.
    It is asked only when something is due, since each trim appends its own record."""
    if not AuditRecord.objects.filter(organization=organization, created_at__lt=before).exists():
        return 0
    record = audit_trim(
        organization=organization, actor=system_principal("retention"), before=before
    )
    return int((record.data or {}).get("deleted", 0))
