"""Retention of the artifacts app's own tables: each organization's settings, and the trim of
its artifacts, checkpoints and share links. The sweep that calls every app's trim in order is
``kestrel_one.execution.retention``."""

from __future__ import annotations

from datetime import datetime

from django.db import transaction
from django.db.models import Q

from kestrel_one.artifacts.models import (
    Artifact,
    ArtifactKind,
    Checkpoint,
    OrganizationRetention,
    ShareLink,
)
from kestrel_one.audit.services import audit_record

RETENTION_FIELDS = ("events_days", "artifacts_days", "checkpoints_days", "audit_days")


@transaction.atomic
def retention_update(*, actor, organization, values: dict) -> OrganizationRetention:
    retention, _ = OrganizationRetention.objects.select_for_update().get_or_create(
        organization=organization
    )
    before = {name: getattr(retention, name) for name in RETENTION_FIELDS}
    for name in RETENTION_FIELDS:
        setattr(retention, name, values[name])
    retention.updated_by = actor.actor_id
    retention.save()
    audit_record(
        organization=organization,
        actor=actor,
        action="retention.update",
        data={"before": before, "after": {name: values[name] for name in RETENTION_FIELDS}},
    )
    return retention


def retention_for_sweep(organization) -> OrganizationRetention:
    """The organization's retention, or the defaults when it never set one."""
    retention = OrganizationRetention.objects.filter(organization=organization).first()
    return retention or OrganizationRetention(organization=organization)


def checkpoints_trim(*, organization, before: datetime) -> list[str]:
    """Delete checkpoints older than ``before`` (their archives with them); their ids."""
    checkpoints = Checkpoint.objects.filter(organization=organization, created_at__lt=before)
    checkpoint_ids = list(checkpoints.values_list("public_id", flat=True))
    # Deleting the archive deletes the checkpoint row (one-to-one, cascade).
    Artifact.objects.filter(checkpoint__in=checkpoints).delete()
    return checkpoint_ids


def artifacts_trim(*, organization, before: datetime) -> list[str]:
    """Delete artifacts other than checkpoint archives older than ``before``; their ids."""
    artifacts = Artifact.objects.filter(organization=organization, created_at__lt=before).exclude(
        kind=ArtifactKind.CHECKPOINT
    )
    artifact_ids = list(artifacts.values_list("public_id", flat=True))
    artifacts.delete()
    return artifact_ids


def share_links_trim(*, organization, now: datetime) -> int:
    """Delete share links that have expired; how many."""
    deleted, _ = ShareLink.objects.filter(
        Q(organization=organization) & Q(expires_at__lt=now)
    ).delete()
    return deleted
