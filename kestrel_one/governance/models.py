"""Published policy documents: immutable, content-hashed versions."""

from __future__ import annotations

from django.db import models
from django.db.models import Q

from kestrel_one.common.ids import PublicIdField


class PolicyVersion(models.Model):
    """One published policy document of an environment or a project; never changed after.

    The database holds it to that too (governance migration 0002): an ``UPDATE`` is refused,
    and a ``DELETE`` only passes inside ``erasing("policy")``, when its owner is deleted.
    """

    public_id = PublicIdField("pol")
    organization = models.ForeignKey(
        "tenancy.Organization", on_delete=models.CASCADE, related_name="policy_versions"
    )
    environment = models.ForeignKey(
        "tenancy.Environment",
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="policy_versions",
    )
    project = models.ForeignKey(
        "tenancy.Project",
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="policy_versions",
    )
    # The canonical document (policies.Policy.to_document()) and the SHA-256 of its
    # canonical JSON, which is what decisions and receipts record.
    document = models.JSONField()
    sha256 = models.CharField(max_length=64)
    # The version this one replaced, of the same owner. DO_NOTHING: versions are never
    # updated (a database trigger refuses it), and a version and its predecessor are only
    # ever deleted together, with their owner.
    previous = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.DO_NOTHING, related_name="+"
    )
    created_by = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=(Q(environment__isnull=False) & Q(project__isnull=True))
                | (Q(environment__isnull=True) & Q(project__isnull=False)),
                name="policy_version_has_one_owner",
            )
        ]
        indexes = [models.Index(fields=["organization", "public_id"])]

    def __str__(self) -> str:
        return f"{self.public_id} ({self.sha256[:12]})"

    def save(self, *args, **kwargs):
        if self.pk is not None:
            raise ValueError("policy versions are immutable; publish a new version instead")
        super().save(*args, **kwargs)


class PolicyDraft(models.Model):
    """The one unpublished policy document an environment or a project is being edited
    towards: saved as written, valid, and replaced by each save until it is published."""

    organization = models.ForeignKey(
        "tenancy.Organization", on_delete=models.CASCADE, related_name="policy_drafts"
    )
    environment = models.OneToOneField(
        "tenancy.Environment",
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="policy_draft",
    )
    project = models.OneToOneField(
        "tenancy.Project",
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="policy_draft",
    )
    # The JSON text as its author wrote it (what the editor shows and what is published, so
    # that repeated keys and list positions stay visible to the strict parser), and the
    # canonical document and content hash it parsed to when it was saved.
    text = models.TextField()
    document = models.JSONField()
    sha256 = models.CharField(max_length=64)
    # The published version the draft was saved against (public id and hash), so the editor
    # can say when someone published since.
    base_version = models.CharField(max_length=40, blank=True, default="")
    base_sha256 = models.CharField(max_length=64, blank=True, default="")
    updated_by = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=(Q(environment__isnull=False) & Q(project__isnull=True))
                | (Q(environment__isnull=True) & Q(project__isnull=False)),
                name="policy_draft_has_one_owner",
            )
        ]

    def __str__(self) -> str:
        owner = (
            f"environment {self.environment_id}"
            if self.environment_id
            else f"project {self.project_id}"
        )
        return f"draft of {owner} ({self.sha256[:12]})"


class Surface(models.TextChoices):
    """The surfaces a request can come through; each is one term of the effective policy."""

    API = "api", "REST API"
    CONSOLE = "console", "Console"
    MCP = "mcp", "MCP endpoint"


class SurfacePolicyVersion(models.Model):
    """One published policy of one surface of an organization; never changed after.

    The surface's current policy is its newest version; with none, the surface grants every
    capability. Like ``PolicyVersion`` the database refuses an ``UPDATE``, and a ``DELETE``
    outside ``erasing("policy")`` (governance migration 0004).
    """

    public_id = PublicIdField("spv")
    organization = models.ForeignKey(
        "tenancy.Organization", on_delete=models.CASCADE, related_name="surface_policy_versions"
    )
    surface = models.CharField(max_length=16, choices=Surface.choices)
    # The canonical document (policies.Policy.to_document()) and the SHA-256 of its
    # canonical JSON.
    document = models.JSONField()
    sha256 = models.CharField(max_length=64)
    # The version of the same organization and surface this one replaced.
    previous = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.DO_NOTHING, related_name="+"
    )
    created_by = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["organization", "surface", "-id"])]

    def __str__(self) -> str:
        return f"{self.public_id} ({self.surface}, {self.sha256[:12]})"

    def save(self, *args, **kwargs):
        if self.pk is not None:
            raise ValueError("policy versions are immutable; publish a new version instead")
        super().save(*args, **kwargs)
