"""The model gateway's records: per-project token budgets, the budget's running totals per
UTC day and month, and one usage record per model call (its reservation, then its usage).

How a call spends budget (docs/gateway.md): before the provider is called, the call's
upper bound of tokens is *reserved* in the project's day and month windows by one
conditional ``UPDATE`` each (``used + reserved + n <= limit``), so concurrent calls can
never reserve past a limit; after the call the reservation is *settled*: the reserved
tokens are released and the provider's reported usage is added to ``used``. A reservation
that no worker settles (the worker died) *expires* and is charged in full.
"""

from __future__ import annotations

from django.db import models

from kestrel_one.common.ids import PublicIdField


class ModelBudget(models.Model):
    """A project's token budget for model calls; a null limit is no limit on that period."""

    organization = models.ForeignKey(
        "tenancy.Organization", on_delete=models.CASCADE, related_name="+"
    )
    project = models.OneToOneField(
        "tenancy.Project", on_delete=models.CASCADE, related_name="model_budget"
    )
    # Tokens (input + output, as the providers report them) per UTC calendar day and month.
    tokens_per_day = models.PositiveBigIntegerField(null=True, blank=True)
    tokens_per_month = models.PositiveBigIntegerField(null=True, blank=True)
    updated_by = models.CharField(max_length=64)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"budget of {self.project_id}: {self.tokens_per_day}/day {self.tokens_per_month}/mo"


class BudgetPeriod(models.TextChoices):
    DAY = "day"
    MONTH = "month"


class BudgetWindow(models.Model):
    """One project's tokens used and reserved in one UTC day or month.

    The row is what concurrent reservations serialize on: each is a conditional UPDATE of
    it, which PostgreSQL re-checks against the latest committed totals after the row lock.
    """

    organization = models.ForeignKey(
        "tenancy.Organization", on_delete=models.CASCADE, related_name="+"
    )
    project = models.ForeignKey(
        "tenancy.Project", on_delete=models.CASCADE, related_name="budget_windows"
    )
    period = models.CharField(max_length=8, choices=BudgetPeriod.choices)
    # The first day of the period: the day itself, or the first of the month.
    starts_on = models.DateField()
    used = models.BigIntegerField(default=0)
    reserved = models.BigIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["project", "period", "starts_on"], name="one_budget_window_per_period"
            ),
            models.CheckConstraint(
                condition=models.Q(used__gte=0, reserved__gte=0),
                name="budget_window_not_negative",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.project_id} {self.period} {self.starts_on}: {self.used}+{self.reserved}"


class UsageState(models.TextChoices):
    RESERVED = "reserved"
    SETTLED = "settled"
    # Nobody settled it before ``expires_at`` (the worker died): charged in full.
    EXPIRED = "expired"


class ModelUsage(models.Model):
    """One model call through the gateway: who made it, to which model, what it reserved and
    what the provider reported. Sizes and hashes of the exchange, never its content."""

    public_id = PublicIdField("mdu")
    organization = models.ForeignKey(
        "tenancy.Organization", on_delete=models.CASCADE, related_name="+"
    )
    project = models.ForeignKey(
        "tenancy.Project", on_delete=models.CASCADE, related_name="model_usages"
    )
    # The model.invoke action, for calls made as a tool; null for the endpoint's calls.
    action = models.ForeignKey(
        "execution.Action", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # "tool" (model.invoke) or "endpoint" (the OpenAI-compatible API).
    surface = models.CharField(max_length=16)
    provider = models.CharField(max_length=32)
    # The provider's model name ("gpt-4o-mini"); the policy names it "openai/gpt-4o-mini".
    model = models.CharField(max_length=128)
    stream = models.BooleanField(default=False)
    requested_by = models.CharField(max_length=64)
    # The policy versions the call was judged under (an endpoint call's own decision, a tool
    # call's action's).
    policy_version = models.CharField(max_length=255, blank=True)
    credential = models.CharField(max_length=40, blank=True)
    state = models.CharField(max_length=10, choices=UsageState.choices)
    # The windows the reservation was taken in: settling touches these, even after midnight.
    day = models.DateField()
    month = models.DateField()
    reserved_tokens = models.BigIntegerField()
    input_tokens = models.BigIntegerField(null=True, blank=True)
    output_tokens = models.BigIntegerField(null=True, blank=True)
    # What the budget was charged when the reservation settled or expired.
    charged_tokens = models.BigIntegerField(null=True, blank=True)
    # "succeeded", "upstream_error", "failed" (nothing or no answer), "expired".
    outcome = models.CharField(max_length=16, blank=True)
    upstream_status = models.PositiveSmallIntegerField(null=True, blank=True)
    error_code = models.CharField(max_length=40, blank=True)
    request_bytes = models.PositiveIntegerField(default=0)
    request_sha256 = models.CharField(max_length=64, blank=True)
    response_bytes = models.PositiveBigIntegerField(default=0)
    response_sha256 = models.CharField(max_length=64, blank=True)
    duration_ms = models.PositiveIntegerField(null=True, blank=True)
    expires_at = models.DateTimeField()
    created_at = models.DateTimeField(auto_now_add=True)
    settled_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            models.Index(fields=["state", "expires_at"]),
            models.Index(fields=["project", "-created_at"]),
        ]

    def __str__(self) -> str:
        return f"{self.public_id} {self.provider}/{self.model} {self.state}"
