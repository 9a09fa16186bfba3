"""Reads for webhooks: who is subscribed, and which deliveries are due."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Q, QuerySet

from kestrel_one.webhooks.models import DeliveryState, WebhookDelivery, WebhookEndpoint


def endpoints_subscribed(*, organization, event_type: str) -> list[WebhookEndpoint]:
    """The organization's enabled endpoints that asked for this event type."""
    return [
        endpoint
        for endpoint in WebhookEndpoint.objects.filter(organization=organization, enabled=True)
        if event_type in endpoint.event_types
    ]


def webhook_endpoints_of(organization) -> QuerySet[WebhookEndpoint]:
    """The organization's endpoints (who may read them is the caller's ``webhooks:write``)."""
    return WebhookEndpoint.objects.filter(organization=organization)


def deliveries_for_endpoint(*, endpoint: WebhookEndpoint) -> QuerySet[WebhookDelivery]:
    return WebhookDelivery.objects.filter(endpoint=endpoint).select_related("message", "endpoint")


def deliveries_due_filter(now: datetime) -> Q:
    """A delivery a worker may claim now: due and pending, or claimed by a worker whose lease
    ran out (it died or hung mid-delivery)."""
    return Q(state=DeliveryState.PENDING, next_attempt_at__lte=now) | Q(
        state=DeliveryState.DELIVERING, lease_expires_at__lte=now
    )


def deliveries_overdue(*, now: datetime, limit: int = 500) -> list[int]:
    """Deliveries the normal path should already have taken: pending for longer than one
    sweep period past their time (the enqueue was lost), or with an expired lease."""
    slack = now - timedelta(seconds=settings.KESTREL_WEBHOOK_SWEEP_SECONDS)
    overdue = Q(state=DeliveryState.PENDING, next_attempt_at__lte=slack) | Q(
        state=DeliveryState.DELIVERING, lease_expires_at__lte=now
    )
    return list(
        WebhookDelivery.objects.filter(overdue)
        .order_by("next_attempt_at")
        .values_list("pk", flat=True)[:limit]
    )
