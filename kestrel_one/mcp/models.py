"""Installed MCP servers, their recorded (pinned) tools, discoveries and risk acceptances.

docs/mcp.md has the whole picture: an org admin installs a server into an Environment by
image digest (custom) or by name (managed); a runner starts it once and lists its tools
(a *discovery*), which are recorded with the digest of each definition; only recorded,
enabled tools can be called, and a definition that later differs disables that tool until
an admin reviews it. Egress entries are bound to the image and profile they were authored
for; unrestricted networking exists only as an expiring, justified risk acceptance.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

from kestrel_one.common.ids import PublicIdField
from kestrel_one.common.injection import injection_flags


class McpServerQuerySet(models.QuerySet):
    def for_org(self, organization) -> McpServerQuerySet:
        return self.filter(organization=organization)

    def installed(self) -> McpServerQuerySet:
        return self.exclude(state=McpServer.State.REMOVED)


class McpServer(models.Model):
    """One MCP server installed in one Environment of an organization."""

    class Kind(models.TextChoices):
        # Any local image the admin names by digest (REPO@sha256:...).
        CUSTOM = "custom"
        # An image Kestrel builds and ships (deploy/images/mcp-*), by name.
        MANAGED = "managed"

    class State(models.TextChoices):
        # Installed (or its image changed, or an admin asked for a refresh): a runner is
        # starting it to list its tools. Not callable until the first discovery succeeds.
        DISCOVERING = "discovering"
        # Its tools are recorded; recorded, enabled tools can be called.
        READY = "ready"
        # The first discovery failed (image missing on the engine, the server did not speak
        # MCP): ``error`` says why; an admin fixes the image and refreshes.
        FAILED = "failed"
        # Uninstalled: kept for the records and audit, never callable again.
        REMOVED = "removed"

    public_id = PublicIdField("mcp")
    organization = models.ForeignKey(
        "tenancy.Organization", on_delete=models.CASCADE, related_name="mcp_servers"
    )
    environment = models.ForeignKey(
        "tenancy.Environment", on_delete=models.CASCADE, related_name="mcp_servers"
    )
    # What policies call it (mcp.call ``servers``): unique among the Environment's installed
    # servers (runners.contract.mcp.SERVER_NAME).
    name = models.CharField(max_length=63)
    kind = models.CharField(max_length=10, choices=Kind.choices)
    # For a managed server: which one (filesystem, git, time).
    managed = models.CharField(max_length=32, blank=True)
    # What the admin gave (REPO@sha256:DIGEST), or the managed image's name.
    reference = models.CharField(max_length=512)
    # The image id the container is created from (sha256:...): for a custom server the
    # digest given, verified against the engine by the discovery; for a managed one the id
    # the runner's engine has for the managed image, recorded by the discovery.
    image_id = models.CharField(max_length=71, blank=True)
    # The server's argv (empty: the image's own entrypoint and command).
    command = models.JSONField(default=list)
    # How the project's workspace is mounted: none, ro or rw (runners.contract.mcp).
    workspace = models.CharField(max_length=4, default="none")
    # Container limits: memory_mb, cpus, pids, tmp_mb.
    limits = models.JSONField(default=dict)
    state = models.CharField(max_length=12, choices=State.choices, default=State.DISCOVERING)
    # Why the last discovery failed: {"code", "message"}; null otherwise.
    error = models.JSONField(null=True, blank=True)
    # The egress allowlist as authored: [{"host", "port", "protocol"}], exact entries only.
    egress = models.JSONField(default=list)
    # What the egress grant was authored (approved) for: a new image or profile voids it
    # until an admin approves the entries again (MCP-2).
    egress_image_id = models.CharField(max_length=71, blank=True)
    egress_profile_sha256 = models.CharField(max_length=64, blank=True)
    egress_approved_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    egress_approved_at = models.DateTimeField(null=True, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    discovered_at = models.DateTimeField(null=True, blank=True)

    objects = McpServerQuerySet.as_manager()

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["environment", "name"],
                condition=~Q(state="removed"),
                name="one_installed_mcp_server_name_per_environment",
            ),
            models.CheckConstraint(
                condition=Q(kind="custom", managed="") | Q(kind="managed") & ~Q(managed=""),
                name="mcp_server_managed_name_only_for_managed",
            ),
        ]
        indexes = [models.Index(fields=["organization", "public_id"])]

    def __str__(self) -> str:
        return f"{self.public_id} {self.name} ({self.reference})"


class McpTool(models.Model):
    """One tool of a server, as recorded by a discovery (pinned): only these can be called."""

    class State(models.TextChoices):
        # Recorded and unchanged since: callable (under policy).
        ENABLED = "enabled"
        # The server now defines it differently (``pending_*``): disabled until an admin
        # reviews the difference and accepts the new definition (or the server reverts).
        CHANGED = "changed"
        # Listed for the first time by a refresh or a call after install: not callable until
        # an admin accepts it.
        NEW = "new"
        # No longer listed by the server.
        REMOVED = "removed"
        # Its name or definition cannot be used (a name policies cannot name, a schema that is
        # not a valid JSON Schema, over the size bounds): recorded to be shown, never callable.
        UNUSABLE = "unusable"

    server = models.ForeignKey(McpServer, on_delete=models.CASCADE, related_name="tools")
    name = models.CharField(max_length=256)
    # The recorded definition (runners.contract.mcp.tool_definition) and its digest.
    definition = models.JSONField(default=dict)
    definition_sha256 = models.CharField(max_length=64)
    state = models.CharField(max_length=10, choices=State.choices, default=State.ENABLED)
    # Why it is unusable, when it is.
    unusable_reason = models.CharField(max_length=500, blank=True)
    # An admin marked it dangerous (it then needs the policy's ``dangerous`` opt-in whatever
    # its annotations say). An admin can add danger, never remove what annotations declare.
    marked_dangerous = models.BooleanField(default=False)
    # A changed (or new) definition awaiting review, as the server now lists it.
    pending_definition = models.JSONField(null=True, blank=True)
    pending_sha256 = models.CharField(max_length=64, blank=True)
    pending_seen_at = models.DateTimeField(null=True, blank=True)
    # Why the pending definition cannot be called, when it cannot (as for ``unusable_reason``):
    # one over the size bounds is stored by name only, so the reason cannot be found again from
    # what is stored, and accepting it records the tool unusable.
    pending_unusable_reason = models.CharField(max_length=500, blank=True)
    recorded_at = models.DateTimeField(default=timezone.now)
    reviewed_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    reviewed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["server", "name"], name="one_mcp_tool_per_name")
        ]
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.server.name}.{self.name} ({self.state})"

    @property
    def annotations(self) -> dict:
        value = self.definition.get("annotations")
        return value if isinstance(value, dict) else {}

    @property
    def input_schema(self) -> dict:
        value = self.definition.get("inputSchema")
        return value if isinstance(value, dict) else {"type": "object"}

    @property
    def flags(self) -> list[str]:
        """The injection patterns its recorded definition matches (``injection_flags``).
        Read from the text each time, never stored: a tool recorded before a pattern (or the
        hidden-character flag) existed is flagged as every other. Descriptions and schemas
        are untrusted text: shown to admins with these flags, never followed (POL-5)."""
        return injection_flags(self.definition)

    @property
    def pending_flags(self) -> list[str]:
        """As ``flags``, for the pending definition; one that cannot be called says why."""
        if self.pending_definition is None:
            return []
        reason = self.pending_unusable_reason
        return injection_flags(self.pending_definition) + (
            [f"unusable: {reason[:200]}"] if reason else []
        )

    @property
    def dangerous(self) -> bool:
        """POL-8: from the record, never from the caller. A tool is dangerous when an admin
        marked it, when its annotations say it is destructive, or when they do not say it is
        read-only (MCP's defaults: a tool not marked read-only may write, and a writing tool
        is destructive unless it says otherwise)."""
        hints = self.annotations
        return (
            self.marked_dangerous
            or hints.get("destructiveHint") is True
            or hints.get("readOnlyHint") is not True
        )


class McpDiscovery(models.Model):
    """One start of a server by a runner to list its tools (install, image change, refresh)."""

    class State(models.TextChoices):
        PENDING = "pending"
        DONE = "done"
        FAILED = "failed"

    public_id = PublicIdField("mdi")
    organization = models.ForeignKey(
        "tenancy.Organization", on_delete=models.CASCADE, related_name="+"
    )
    server = models.ForeignKey(McpServer, on_delete=models.CASCADE, related_name="discoveries")
    # The profile the runner was asked to start (its digest binds the answer to it).
    profile_sha256 = models.CharField(max_length=64)
    # The signed request's digest: the runner's signed answer must name it.
    request_digest = models.CharField(max_length=64, blank=True)
    pool = models.CharField(max_length=64)
    state = models.CharField(max_length=8, choices=State.choices, default=State.PENDING)
    error = models.JSONField(null=True, blank=True)
    # What changed, for the admin: {"added": [...], "changed": [...], "removed": [...]}.
    summary = models.JSONField(default=dict)
    requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    runner = models.ForeignKey(
        "execution.Runner", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    # Past this, a pending discovery is failed by the sweep (no runner answered).
    deadline_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.public_id} {self.state}"


class McpRiskAcceptanceQuerySet(models.QuerySet):
    def in_force(self, now=None) -> McpRiskAcceptanceQuerySet:
        now = now or timezone.now()
        return self.filter(withdrawn_at__isnull=True, voided_at__isnull=True, expires_at__gt=now)


class McpRiskAcceptance(models.Model):
    """An org admin's recorded decision to run a custom server with unrestricted (bridge)
    networking (MCP-4): justified, expiring, bound to the image and profile it was made for,
    withdrawable. The server is back to network-off once it expires, is withdrawn, or the
    image or profile changes; a change voids it for good (``voided_at``): changing back does
    not bring it back, only a person's new acceptance does."""

    public_id = PublicIdField("rsk")
    organization = models.ForeignKey(
        "tenancy.Organization", on_delete=models.CASCADE, related_name="+"
    )
    server = models.ForeignKey(McpServer, on_delete=models.CASCADE, related_name="risk_acceptances")
    justification = models.TextField()
    expires_at = models.DateTimeField()
    # What the acceptance covers: a new image or profile is a new decision.
    image_id = models.CharField(max_length=71)
    profile_sha256 = models.CharField(max_length=64)
    accepted_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    withdrawn_at = models.DateTimeField(null=True, blank=True)
    withdrawn_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # When a change of the server's image or profile (or its removal) ended it.
    voided_at = models.DateTimeField(null=True, blank=True)
    # When the sweep recorded its expiry in the audit log (once).
    expiry_recorded_at = models.DateTimeField(null=True, blank=True)

    objects = McpRiskAcceptanceQuerySet.as_manager()

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=~Q(justification=""), name="mcp_risk_acceptance_has_justification"
            )
        ]

    def __str__(self) -> str:
        return f"{self.public_id} {self.server_id} until {self.expires_at}"
