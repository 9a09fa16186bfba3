"""Records that outlive a call: artifacts, checkpoints, share links and retention settings."""

from __future__ import annotations

from django.db import models
from django.db.models import Q
from django.utils import timezone

from kestrel_one.common.ids import PublicIdField


class ArtifactKind(models.TextChoices):
    STDOUT = "stdout"
    STDERR = "stderr"
    CHECKPOINT = "checkpoint"
    FILE = "file"


class Artifact(models.Model):
    """A file a tool produced (output past the inline cap, a declared output, a checkpoint
    archive), kept in the artifact storage with its size, content type and SHA-256."""

    public_id = PublicIdField("art")
    organization = models.ForeignKey(
        "tenancy.Organization", on_delete=models.CASCADE, related_name="+"
    )
    project = models.ForeignKey(
        "tenancy.Project", on_delete=models.CASCADE, related_name="artifacts"
    )
    # SET_NULL: artifacts follow their own retention, not their thread's or action's.
    thread = models.ForeignKey(
        "threads.Thread",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="artifacts",
    )
    action = models.ForeignKey(
        "execution.Action",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="artifacts",
    )
    kind = models.CharField(max_length=16, choices=ArtifactKind.choices)
    # The download file name; never used as a storage path.
    name = models.CharField(max_length=255)
    content_type = models.CharField(max_length=100)
    size = models.BigIntegerField()
    sha256 = models.CharField(max_length=64)
    # Where the bytes live in the artifact storage: built from public ids only.
    storage_name = models.CharField(max_length=255)
    created_by = models.CharField(max_length=64)
    # A default rather than auto_now_add, so retention tests can travel in time explicitly.
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [
            models.Index(fields=["organization", "created_at"]),
            models.Index(fields=["project", "public_id"]),
        ]

    def __str__(self) -> str:
        return f"{self.public_id} {self.name}"


class Checkpoint(models.Model):
    """A snapshot of one project's workspace taken by a runner, stored as an artifact."""

    public_id = PublicIdField("chk")
    organization = models.ForeignKey(
        "tenancy.Organization", on_delete=models.CASCADE, related_name="+"
    )
    project = models.ForeignKey(
        "tenancy.Project", on_delete=models.CASCADE, related_name="checkpoints"
    )
    thread = models.ForeignKey(
        "threads.Thread",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="checkpoints",
    )
    # The workspace.checkpoint call that took it.
    action = models.ForeignKey(
        "execution.Action", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # Deleting the archive deletes the checkpoint: one cannot exist without the other.
    artifact = models.OneToOneField(Artifact, on_delete=models.CASCADE, related_name="checkpoint")
    files = models.PositiveIntegerField()
    # Uncompressed bytes of the files in the archive.
    content_bytes = models.BigIntegerField()
    created_by = models.CharField(max_length=64)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [models.Index(fields=["project", "public_id"])]

    def __str__(self) -> str:
        return f"{self.public_id} of {self.project_id}"


class ShareLink(models.Model):
    """A revocable, expiring link that lets whoever holds its token read exactly one
    artifact or one thread's replay, and nothing around it (TEN-6)."""

    public_id = PublicIdField("shr")
    organization = models.ForeignKey(
        "tenancy.Organization", on_delete=models.CASCADE, related_name="+"
    )
    # The shared object's project, so that listing links follows project visibility.
    project = models.ForeignKey("tenancy.Project", on_delete=models.CASCADE, related_name="+")
    artifact = models.ForeignKey(
        Artifact, null=True, blank=True, on_delete=models.CASCADE, related_name="shares"
    )
    thread = models.ForeignKey(
        "threads.Thread", null=True, blank=True, on_delete=models.CASCADE, related_name="shares"
    )
    # SHA-256 of the token: the token itself is shown once, when the link is made.
    token_hash = models.CharField(max_length=64, unique=True)
    created_by = models.CharField(max_length=64)
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()
    revoked_at = models.DateTimeField(null=True, blank=True)
    revoked_by = models.CharField(max_length=64, blank=True)
    # How often the link was used (each request through it) and when last, so whoever shared
    # it can see whether it was opened. Counted here, not audited: holders are anonymous.
    uses = models.PositiveBigIntegerField(default=0)
    last_used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=(Q(artifact__isnull=False) & Q(thread__isnull=True))
                | (Q(artifact__isnull=True) & Q(thread__isnull=False)),
                name="share_link_names_exactly_one_object",
            )
        ]

    def __str__(self) -> str:
        return self.public_id


class OrganizationRetention(models.Model):
    """How many days an organization keeps events and replay data, artifacts, checkpoints
    and its audit log; the retention sweep deletes what is older (AUD-6)."""

    organization = models.OneToOneField(
        "tenancy.Organization", on_delete=models.CASCADE, related_name="retention"
    )
    events_days = models.PositiveIntegerField(default=90)
    artifacts_days = models.PositiveIntegerField(default=90)
    checkpoints_days = models.PositiveIntegerField(default=30)
    audit_days = models.PositiveIntegerField(default=365)
    updated_by = models.CharField(max_length=64, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"retention of {self.organization_id}"
