"""Runners, the actions they execute, and the receipts that record what happened."""

from __future__ import annotations

from django.db import models

from kestrel_one.common.ids import PublicIdField


class RunnerPool(models.Model):
    """A runner pool: shared by every organization, or dedicated to one (its runners then
    serve that organization's calls only, and only its calls are routed there)."""

    name = models.CharField(max_length=64, unique=True)
    # Null: a shared pool (the platform's, or the single-host runner's).
    organization = models.ForeignKey(
        "tenancy.Organization",
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="runner_pools",
    )
    # This organization's calls go to this pool instead of KESTREL_DEFAULT_POOL.
    routes_calls = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["organization"],
                condition=models.Q(routes_calls=True),
                name="one_call_pool_per_organization",
            ),
            models.CheckConstraint(
                condition=models.Q(routes_calls=False) | models.Q(organization__isnull=False),
                name="only_a_dedicated_pool_routes_calls",
            ),
        ]

    def __str__(self) -> str:
        return self.name


class Runner(models.Model):
    """An enrolled runner identity: its pool and public key; the private key never leaves it."""

    public_id = PublicIdField("run")
    # Null: a platform runner serving every organization's calls in its pool.
    organization = models.ForeignKey(
        "tenancy.Organization",
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="runners",
    )
    pool = models.CharField(max_length=64)
    name = models.CharField(max_length=100, blank=True)
    public_key = models.TextField()
    enrolled_by = models.CharField(max_length=64)
    enrolled_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    # When a verified heartbeat or report of this runner last arrived (runners.heartbeat).
    last_seen_at = models.DateTimeField(null=True, blank=True)
    # The sandbox backend its last heartbeat named: "docker", "bubblewrap" or "none".
    sandbox = models.CharField(max_length=32, blank=True, default="")
    # SHA-256 (hex) of the password of the runner's own broker user (named by its public
    # id): enough to recreate the user after a broker restart, never to log in as it.
    broker_password_sha256 = models.CharField(max_length=64, blank=True, default="")

    def __str__(self) -> str:
        return f"{self.public_id} ({self.pool})"


class ActionState(models.TextChoices):
    DENIED = "denied"
    AWAITING_APPROVAL = "awaiting_approval"
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


TERMINAL_STATES = frozenset(
    {
        ActionState.DENIED,
        ActionState.SUCCEEDED,
        ActionState.FAILED,
        ActionState.CANCELLED,
        ActionState.EXPIRED,
    }
)


class Action(models.Model):
    """One requested tool call: its exact arguments, the decision, and where it stands.

    ``public_id`` is also the call id: it is the command's ``jti`` and the runner's
    idempotency key.
    """

    public_id = PublicIdField("act")
    organization = models.ForeignKey(
        "tenancy.Organization", on_delete=models.CASCADE, related_name="+"
    )
    environment = models.ForeignKey(
        "tenancy.Environment", on_delete=models.CASCADE, related_name="+"
    )
    project = models.ForeignKey("tenancy.Project", on_delete=models.CASCADE, related_name="actions")
    thread = models.ForeignKey("threads.Thread", on_delete=models.CASCADE, related_name="actions")
    tool = models.CharField(max_length=64)
    # Redacted (kestrel_one.execution.arguments): what every surface shows.
    args = models.JSONField()
    # The exact arguments, encrypted, only while a command may still be signed from them.
    sealed_args = models.TextField(blank=True, default="")
    # Over the exact arguments, which the runner receives in the signed command.
    args_digest = models.CharField(max_length=64)
    # Binds organization, environment, project, thread, tool, canonical arguments and policy
    # version: approvals, commands and receipts refer to exactly this.
    action_digest = models.CharField(max_length=64)
    mode = models.CharField(max_length=8)
    # The surface the call came through (api, console, mcp): its surface policy is one term
    # of the effective policy, so a re-decision judges the action on the same surface.
    surface = models.CharField(max_length=16, default="api")
    state = models.CharField(max_length=20, choices=ActionState.choices)
    decision = models.JSONField(default=dict)
    policy_version = models.CharField(max_length=255)
    limits = models.JSONField(default=dict)
    requested_by = models.CharField(max_length=64)
    requested_by_token = models.ForeignKey(
        "accounts.ApiToken", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # The requesting token's lineage (accounts.ApiToken.lineage), kept even if the token goes:
    # no token of that lineage may approve this action.
    requested_by_lineage = models.CharField(max_length=40, blank=True, default="")
    requested_by_user = models.ForeignKey(
        "accounts.User", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    pool = models.CharField(max_length=64)
    runner = models.ForeignKey(
        Runner, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    attempt = models.PositiveIntegerField(default=0)
    command_digest = models.CharField(max_length=64, blank=True)
    dispatched_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # After this the sweep ends a call whose runner went silent.
    deadline_at = models.DateTimeField(null=True, blank=True)
    result = models.JSONField(null=True, blank=True)
    error = models.JSONField(null=True, blank=True)
    # Named explicitly by the request; checked to belong to this thread and to match exactly.
    plan = models.ForeignKey(
        "execution.Plan", null=True, blank=True, on_delete=models.SET_NULL, related_name="actions"
    )
    plan_step = models.PositiveIntegerField(null=True, blank=True)
    # Known prompt-injection patterns seen in the arguments or the tool's output. Shown to
    # approvers; they never change what is allowed, in either direction.
    flags = models.JSONField(default=list)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        indexes = [
            models.Index(fields=["thread", "public_id"]),
            models.Index(fields=["state", "deadline_at"]),
            # The console's inbox and its navigation count: an organization's actions in one
            # state, newest first, read as an index range whatever the history's size.
            models.Index(
                fields=["organization", "state", "-created_at", "-id"],
                name="action_org_state_newest",
            ),
            # The inbox's list and its counts (``selectors.actions_awaiting_decision``): only
            # the actions awaiting approval, newest first per organization, carrying what the
            # query filters on besides the thread, so counting them reads the index alone.
            models.Index(
                fields=["organization", "-created_at", "-id"],
                include=["project", "thread", "requested_by_lineage"],
                condition=models.Q(state="awaiting_approval"),
                name="action_awaiting_newest",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.public_id} {self.tool} {self.state}"


class Receipt(models.Model):
    """What a runner reported for one call, verified: the durable record of an execution."""

    public_id = PublicIdField("rcp")
    action = models.OneToOneField(Action, on_delete=models.CASCADE, related_name="receipt")
    organization = models.ForeignKey(
        "tenancy.Organization", on_delete=models.CASCADE, related_name="+"
    )
    call_id = models.CharField(max_length=40)
    tool = models.CharField(max_length=64)
    args = models.JSONField()
    args_digest = models.CharField(max_length=64)
    action_digest = models.CharField(max_length=64)
    # Organization, environment, project and thread public ids the call was bound to.
    scope = models.JSONField()
    outcome = models.CharField(max_length=16)
    result = models.JSONField(null=True, blank=True)
    error = models.JSONField(null=True, blank=True)
    policy_version = models.CharField(max_length=255)
    decision = models.JSONField(default=dict)
    runner = models.CharField(max_length=40, blank=True)
    sandbox = models.CharField(max_length=32, blank=True)
    command_digest = models.CharField(max_length=64, blank=True)
    report_digest = models.CharField(max_length=64, blank=True)
    # A control-tier call's evidence (``runner`` is then "control-tier"): for adapter.invoke
    # the resource, the request's hash, the response's status, hash and size, the credential
    # record and fingerprint used (``released``); never a credential.
    evidence = models.JSONField(default=dict, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.public_id} for {self.call_id}"


class Approval(models.Model):
    """A person's decision on one action, bound to that action's exact digest."""

    public_id = PublicIdField("apr")
    organization = models.ForeignKey(
        "tenancy.Organization", on_delete=models.CASCADE, related_name="+"
    )
    # One decision per action: a second approval, or an approval after a denial, is refused.
    action = models.OneToOneField(Action, on_delete=models.CASCADE, related_name="approval")
    action_digest = models.CharField(max_length=64)
    decision = models.CharField(
        max_length=8, choices=[("approved", "approved"), ("denied", "denied")]
    )
    reason = models.TextField(blank=True, max_length=2000)
    decided_by = models.ForeignKey("accounts.User", on_delete=models.PROTECT, related_name="+")
    decided_by_token = models.ForeignKey(
        "accounts.ApiToken", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.public_id} {self.decision} {self.action_id}"


class Plan(models.Model):
    """An ordered list of proposed tool calls; executable only once a person accepts it."""

    STATES = [(s, s) for s in ("proposed", "accepted", "rejected")]

    public_id = PublicIdField("pln")
    organization = models.ForeignKey(
        "tenancy.Organization", on_delete=models.CASCADE, related_name="+"
    )
    thread = models.ForeignKey("threads.Thread", on_delete=models.CASCADE, related_name="plans")
    # [{"tool", "args" (canonical), "args_digest", "uses"}, ...]; each action naming a step
    # uses it once, and a step runs at most ``uses`` times (1 when absent).
    steps = models.JSONField()
    state = models.CharField(max_length=10, choices=STATES, default="proposed")
    proposed_by = models.CharField(max_length=64)
    proposed_by_token = models.ForeignKey(
        "accounts.ApiToken", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # The proposing token's lineage: no token of it may accept this plan.
    proposed_by_lineage = models.CharField(max_length=40, blank=True, default="")
    accepted_by = models.ForeignKey(
        "accounts.User", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    accepted_at = models.DateTimeField(null=True, blank=True)
    flags = models.JSONField(default=list)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.public_id} ({self.state})"


class Verification(models.Model):
    """Whether a task was accepted, on what evidence: kept apart from the receipt's observed
    effects, which alone never make a task accepted (AUD-4)."""

    public_id = PublicIdField("ver")
    organization = models.ForeignKey(
        "tenancy.Organization", on_delete=models.CASCADE, related_name="+"
    )
    action = models.ForeignKey(Action, on_delete=models.CASCADE, related_name="verifications")
    accepted = models.BooleanField()
    evidence = models.TextField(max_length=10000)
    # A person (user public id) or a named check ("check:<name>").
    verified_by = models.CharField(max_length=64)
    check_name = models.CharField(max_length=100, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.public_id} accepted={self.accepted}"


class IdempotencyKey(models.Model):
    """The first response to a request sent with an Idempotency-Key, kept for replays."""

    organization = models.ForeignKey(
        "tenancy.Organization", on_delete=models.CASCADE, related_name="+"
    )
    # Keys are per caller: two callers may use the same key without colliding.
    actor_id = models.CharField(max_length=64)
    key = models.CharField(max_length=255)
    request_digest = models.CharField(max_length=64)
    action = models.ForeignKey(
        Action, null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    response_status = models.PositiveSmallIntegerField(null=True, blank=True)
    response_body = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["organization", "actor_id", "key"], name="idempotency_key_per_caller"
            )
        ]
        indexes = [models.Index(fields=["created_at"])]

    def __str__(self) -> str:
        return f"{self.actor_id}:{self.key}"


class DeletedProject(models.Model):
    """A deleted project whose workspace runner hosts must not keep.

    Written in the deletion's transaction; the project's own rows are gone. A host that
    missed the ``project.delete`` broadcast lists the workspace in its next inventory
    (runners.contract.inventory), and the control plane sends the message again from this
    record. Kept: it holds only the ids a signed ``project.delete`` names, no name or data.
    """

    project_public_id = models.CharField(max_length=128, unique=True)
    organization_public_id = models.CharField(max_length=128)
    environment_public_id = models.CharField(max_length=128)
    deleted_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.project_public_id

    def control_scope(self) -> dict:
        """What a ``project.delete`` control message about it names."""
        return {
            "org": self.organization_public_id,
            "env": self.environment_public_id,
            "prj": self.project_public_id,
            "thr": None,
        }
