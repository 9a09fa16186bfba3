"""The idempotency record of adapter calls (CRED-5)."""

from __future__ import annotations

from django.db import models


class AdapterInvocation(models.Model):
    """One idempotency key of one adapter operation in one organization: taken before the
    upstream request is made, then holding the first answer, which every later call with the
    same key gets instead of a second request."""

    class State(models.TextChoices):
        # Taken; the request is being made (or its worker died making it: unknown after
        # the lease).
        PENDING = "pending"
        # The first answer (an HTTP status and body, or an error after the request may have
        # reached the provider) is recorded.
        ANSWERED = "answered"

    organization = models.ForeignKey(
        "tenancy.Organization", on_delete=models.CASCADE, related_name="+"
    )
    adapter = models.CharField(max_length=64)
    operation = models.CharField(max_length=128)
    idempotency_key = models.CharField(max_length=128)
    # Over the operation's arguments and the credential reference (adapters.checks).
    request_digest = models.CharField(max_length=64)
    # The action that took the key and made the request.
    action = models.ForeignKey(
        "execution.Action", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    state = models.CharField(max_length=10, choices=State.choices, default=State.PENDING)
    # How the first call ended, and its evidence (hashes and sizes). The answer itself is
    # the first action's result and error, read from it on a replay: so the organization's
    # retention, which trims actions, trims it too (the key then keeps only hashes).
    outcome = models.CharField(max_length=16, blank=True)
    evidence = models.JSONField(default=dict)
    # A pending key whose worker has not answered by then has an unknown outcome.
    lease_until = models.DateTimeField()
    created_at = models.DateTimeField(auto_now_add=True)
    answered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["organization", "adapter", "operation", "idempotency_key"],
                name="one_invocation_per_idempotency_key",
            )
        ]

    def __str__(self) -> str:
        return f"{self.adapter}.{self.operation}:{self.idempotency_key} {self.state}"
