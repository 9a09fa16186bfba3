"""Webhook endpoints, the messages sent to them, and the deliveries that carry them.

A message is written in the same transaction as the event it announces (a transactional
outbox); one delivery per subscribed endpoint then carries it until the consumer answers 2xx
or the retry schedule runs out.
"""

from __future__ import annotations

from django.db import models

from kestrel_one.common.ids import PublicIdField


class WebhookEndpoint(models.Model):
    """A consumer URL of one organization, the event types it wants, and its signing secret."""

    public_id = PublicIdField("whk")
    organization = models.ForeignKey(
        "tenancy.Organization", on_delete=models.CASCADE, related_name="webhook_endpoints"
    )
    url = models.CharField(max_length=2048)
    description = models.CharField(max_length=200, blank=True)
    event_types = models.JSONField(default=list)
    enabled = models.BooleanField(default=True)
    # Why the service switched the endpoint off ("gone" for a 410, "failing" for a delivery
    # that exhausted its retries with no success in between); blank when a person did.
    disabled_reason = models.CharField(max_length=40, blank=True)
    disabled_at = models.DateTimeField(null=True, blank=True)
    # Fernet ciphertexts (kestrel_one.webhooks.secrets); the plaintext is shown once.
    secret_encrypted = models.TextField()
    secret_fingerprint = models.CharField(max_length=80)
    secret_rotated_at = models.DateTimeField(null=True, blank=True)
    # During a rotation's overlap the previous secret signs too (both signatures are sent).
    previous_secret_encrypted = models.TextField(blank=True)
    previous_secret_expires_at = models.DateTimeField(null=True, blank=True)
    # When the current run of failures began (the start of its first failed attempt).
    failing_since = models.DateTimeField(null=True, blank=True)
    consecutive_failures = models.IntegerField(default=0)
    last_success_at = models.DateTimeField(null=True, blank=True)
    created_by = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        indexes = [models.Index(fields=["organization", "enabled"])]

    def __str__(self) -> str:
        return f"{self.public_id} {self.url}"


class WebhookMessage(models.Model):
    """One event as consumers see it: its type and the exact signed body, fixed at emit time."""

    # Sent as ``webhook-id``: the same for every attempt and every endpoint, so consumers
    # can deduplicate.
    public_id = PublicIdField("msg")
    organization = models.ForeignKey(
        "tenancy.Organization", on_delete=models.CASCADE, related_name="+"
    )
    event_type = models.CharField(max_length=64)
    # Stored as text so every retry sends (and signs) exactly the same bytes.
    body = models.TextField()
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.public_id} {self.event_type}"


class DeliveryState(models.TextChoices):
    PENDING = "pending"
    DELIVERING = "delivering"
    DELIVERED = "delivered"
    FAILED = "failed"


class WebhookDelivery(models.Model):
    """One message on its way to one endpoint: attempts so far, the next one, the last answer."""

    public_id = PublicIdField("dlv")
    organization = models.ForeignKey(
        "tenancy.Organization", on_delete=models.CASCADE, related_name="+"
    )
    endpoint = models.ForeignKey(
        WebhookEndpoint, on_delete=models.CASCADE, related_name="deliveries"
    )
    message = models.ForeignKey(WebhookMessage, on_delete=models.CASCADE, related_name="deliveries")
    state = models.CharField(
        max_length=12, choices=DeliveryState.choices, default=DeliveryState.PENDING
    )
    attempts = models.IntegerField(default=0)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    # A worker holds a claimed delivery until then; past it, the sweep hands it to another.
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    first_attempt_at = models.DateTimeField(null=True, blank=True)
    last_attempt_at = models.DateTimeField(null=True, blank=True)
    last_status_code = models.IntegerField(null=True, blank=True)
    last_error = models.CharField(max_length=500, blank=True)
    delivered_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [
            models.Index(fields=["state", "next_attempt_at"]),
            models.Index(fields=["state", "lease_expires_at"]),
            models.Index(fields=["endpoint", "public_id"]),
        ]

    def __str__(self) -> str:
        return f"{self.public_id} {self.state}"
