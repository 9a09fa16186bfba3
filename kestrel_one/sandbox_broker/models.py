"""A workload's adapter request through the broker beside its sandbox, and its child action."""

from __future__ import annotations

from django.db import models


class BrokeredRequest(models.Model):
    """One signed request a runner's broker forwarded from a running call (the parent), and
    the ``adapter.invoke`` action it became (the child) in the parent's thread.

    ``request_id`` is single use: a replayed request is refused. The answer goes to the
    pool's reply list (``runners.contract.adapter_broker.reply_key``) once, when the child
    ends (``answered_at``), or at once when no child could be requested.
    """

    request_id = models.CharField(max_length=40, unique=True)
    organization = models.ForeignKey(
        "tenancy.Organization", on_delete=models.CASCADE, related_name="+"
    )
    parent = models.ForeignKey(
        "execution.Action", on_delete=models.CASCADE, related_name="brokered_requests"
    )
    child = models.OneToOneField(
        "execution.Action",
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="brokered_request",
    )
    runner = models.ForeignKey("execution.Runner", on_delete=models.CASCADE, related_name="+")
    pool = models.CharField(max_length=64)
    adapter = models.CharField(max_length=64)
    operation = models.CharField(max_length=64)
    # The request's own expiry: an answer after it would find nobody waiting.
    expires_at = models.DateTimeField()
    # Set once, when the answer was pushed; with ``outcome`` as answered.
    answered_at = models.DateTimeField(null=True, blank=True)
    outcome = models.CharField(max_length=20, blank=True, default="")
    # Why no child was requested ({"code", "message"}, as the API would have answered).
    error = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["parent", "answered_at"])]

    def __str__(self) -> str:
        return f"{self.request_id} {self.adapter}.{self.operation}"
