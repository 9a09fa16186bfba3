"""Webhook writes: endpoints, the transactional outbox, and the delivery of one message.

``webhook_emit`` writes the message and its deliveries in the caller's transaction, so an
event that rolls back announces nothing and one that commits cannot be lost; the send is
queued only after commit. A delivery is claimed with a conditional UPDATE and a lease, so two
workers never send it at once and a worker that dies mid-delivery only delays it: the sweep
hands it to another worker when the lease runs out.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
from datetime import datetime, timedelta
from urllib.parse import urlsplit

from django.conf import settings
from django.db import transaction
from django.db.models import Exists, F, OuterRef
from django.utils import timezone
from standardwebhooks import Webhook

from kestrel_one.accounts.principal import system_principal
from kestrel_one.audit.services import audit_record
from kestrel_one.celery import app
from kestrel_one.common.broker import broker_status
from kestrel_one.common.errors import Conflict, ValidationFailed
from kestrel_one.common.redaction import bounded
from kestrel_one.webhooks import net
from kestrel_one.webhooks.events import (
    EVENT_TYPES,
    SCHEMA_VERSION,
    endpoint_disabled_payload,
    policy_published_payload,
    public_event_type,
    thread_event_payload,
)
from kestrel_one.webhooks.models import (
    DeliveryState,
    WebhookDelivery,
    WebhookEndpoint,
    WebhookMessage,
)
from kestrel_one.webhooks.secrets import (
    SecretUnreadable,
    secret_decrypt,
    secret_encrypt,
    secret_fingerprint,
    secret_generate,
    secret_readable,
)
from kestrel_one.webhooks.selectors import (
    deliveries_due_filter,
    deliveries_overdue,
    endpoints_subscribed,
)

DELIVER_TASK = "control.webhooks.deliver"  # webhooks.tasks.deliver
logger = logging.getLogger(__name__)

MAX_ENDPOINTS_PER_ORGANIZATION = 20
PAYLOAD_MAX_BYTES = 4096
MAX_ROTATION_OVERLAP_SECONDS = 7 * 24 * 60 * 60
RETRY_JITTER = 0.2
# Retries this soon ride on a countdown; later ones wait for the sweep, so no message sits in
# a worker's memory for hours (or past the broker's visibility timeout).
COUNTDOWN_MAX_SECONDS = 300


# Endpoints ---------------------------------------------------------------------------------


def _origin(url: str) -> str:
    """What the audit log keeps of a URL: scheme and host. Paths and queries of webhook URLs
    often carry a consumer's own token."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rsplit('@', 1)[-1]}"


def _check_url(url: str) -> None:
    try:
        net.destination_parse(url)
    except net.DestinationRefused as refused:
        raise ValidationFailed(
            f"This URL cannot receive webhooks: {refused}.", details={"url": [str(refused)]}
        ) from None


def _check_event_types(event_types: list[str]) -> list[str]:
    unknown = sorted(set(event_types) - set(EVENT_TYPES))
    if unknown:
        raise ValidationFailed(
            f"Unknown event types: {', '.join(unknown)}.", details={"event_types": unknown}
        )
    return sorted(set(event_types))


@transaction.atomic
def webhook_endpoint_create(
    *,
    actor,
    organization,
    url: str,
    event_types: list[str],
    description: str = "",
    enabled: bool = True,
) -> tuple[WebhookEndpoint, str]:
    """Create an endpoint; returns it and its signing secret, which is never shown again."""
    _check_url(url)
    event_types = _check_event_types(event_types)
    # Counted and kept under the organization's row lock: creates that counted at once
    # would each see room for one more.
    type(organization).objects.select_for_update().filter(pk=organization.pk).exists()
    if WebhookEndpoint.objects.filter(organization=organization).count() >= (
        MAX_ENDPOINTS_PER_ORGANIZATION
    ):
        raise Conflict(
            f"An organization may have at most {MAX_ENDPOINTS_PER_ORGANIZATION} webhook "
            "endpoints; delete one first."
        )
    secret = secret_generate()
    endpoint = WebhookEndpoint.objects.create(
        organization=organization,
        url=url,
        description=description,
        event_types=event_types,
        enabled=enabled,
        secret_encrypted=secret_encrypt(secret),
        secret_fingerprint=secret_fingerprint(secret),
        created_by=actor.actor_id,
    )
    audit_record(
        organization=organization,
        actor=actor,
        action="webhook.create",
        target=endpoint,
        data={
            "origin": _origin(url),
            "event_types": event_types,
            "enabled": enabled,
            "secret_fingerprint": endpoint.secret_fingerprint,
        },
    )
    return endpoint, secret


@transaction.atomic
def webhook_endpoint_update(*, actor, endpoint: WebhookEndpoint, **fields) -> WebhookEndpoint:
    """Change URL, description, event types or the enabled flag. Enabling again clears the
    failure record, so the endpoint starts with a clean slate."""
    endpoint = WebhookEndpoint.objects.select_for_update().get(pk=endpoint.pk)
    if "url" in fields:
        _check_url(fields["url"])
    if "event_types" in fields:
        fields["event_types"] = _check_event_types(fields["event_types"])
    if fields.get("enabled") is True and not endpoint.enabled:
        fields.update(
            disabled_reason="", disabled_at=None, failing_since=None, consecutive_failures=0
        )
    elif fields.get("enabled") is False and endpoint.enabled:
        fields.update(disabled_reason="", disabled_at=timezone.now())
    for name, value in fields.items():
        setattr(endpoint, name, value)
    endpoint.save()
    recorded = {k: v for k, v in fields.items() if k in {"event_types", "enabled", "description"}}
    if "url" in fields:
        recorded["origin"] = _origin(fields["url"])
    audit_record(
        organization=endpoint.organization,
        actor=actor,
        action="webhook.update",
        target=endpoint,
        data=recorded,
    )
    return endpoint


@transaction.atomic
def webhook_endpoint_delete(*, actor, endpoint: WebhookEndpoint) -> None:
    audit_record(
        organization=endpoint.organization,
        actor=actor,
        action="webhook.delete",
        target=endpoint,
        data={"origin": _origin(endpoint.url)},
    )
    endpoint.delete()


@transaction.atomic
def webhook_secret_rotate(
    *, actor, endpoint: WebhookEndpoint, overlap_seconds: int | None = None
) -> tuple[WebhookEndpoint, str]:
    """Replace the signing secret. For ``overlap_seconds`` the old secret keeps signing
    beside the new one, so consumers can switch without dropping a message."""
    if overlap_seconds is None:
        overlap_seconds = settings.KESTREL_WEBHOOK_ROTATION_OVERLAP_SECONDS
    if not 0 <= overlap_seconds <= MAX_ROTATION_OVERLAP_SECONDS:
        raise ValidationFailed(
            f"overlap_seconds must be between 0 and {MAX_ROTATION_OVERLAP_SECONDS}.",
            details={"overlap_seconds": ["out of range"]},
        )
    endpoint = WebhookEndpoint.objects.select_for_update().get(pk=endpoint.pk)
    now = timezone.now()
    secret = secret_generate()
    previous_fingerprint = endpoint.secret_fingerprint
    # A secret the current key cannot decrypt (its root changed) can sign nothing: no
    # overlap for it, or every delivery of the overlap would fail to be signed.
    if overlap_seconds and not secret_readable(endpoint.secret_encrypted):
        overlap_seconds = 0
    endpoint.previous_secret_encrypted = endpoint.secret_encrypted if overlap_seconds else ""
    endpoint.previous_secret_expires_at = (
        now + timedelta(seconds=overlap_seconds) if overlap_seconds else None
    )
    endpoint.secret_encrypted = secret_encrypt(secret)
    endpoint.secret_fingerprint = secret_fingerprint(secret)
    endpoint.secret_rotated_at = now
    endpoint.save()
    audit_record(
        organization=endpoint.organization,
        actor=actor,
        action="webhook.rotate_secret",
        target=endpoint,
        data={
            "secret_fingerprint": endpoint.secret_fingerprint,
            "previous_secret_fingerprint": previous_fingerprint,
            "overlap_seconds": overlap_seconds,
        },
    )
    return endpoint, secret


def _endpoint_disable(endpoint: WebhookEndpoint, *, reason: str, detail: str) -> bool:
    """Switch an endpoint off for the service, tell the owners (an audit record, and a
    ``webhook.disabled`` event to the organization's other endpoints). Caller holds the
    transaction. Returns whether this call disabled it."""
    moved = WebhookEndpoint.objects.filter(pk=endpoint.pk, enabled=True).update(
        enabled=False, disabled_reason=reason, disabled_at=timezone.now()
    )
    if not moved:
        return False
    audit_record(
        organization=endpoint.organization,
        actor=system_principal("webhooks"),
        action="webhook.disable",
        target=endpoint,
        outcome=reason,
        data={"origin": _origin(endpoint.url), "reason": reason, "detail": detail},
    )
    webhook_emit(
        organization=endpoint.organization,
        event_type="webhook.disabled",
        payload=endpoint_disabled_payload(endpoint, reason=reason),
    )
    return True


# The outbox --------------------------------------------------------------------------------


def webhook_emit(*, organization, event_type: str, payload: dict) -> WebhookMessage | None:
    """Record one event for every endpoint subscribed to it, in the caller's transaction,
    and queue the sends for after commit. Returns None when nobody is subscribed."""
    if event_type not in EVENT_TYPES:
        raise ValueError(f"{event_type!r} is not a published webhook event type")
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("webhook_emit must run inside the transaction of the event it sends")
    endpoints = endpoints_subscribed(organization=organization, event_type=event_type)
    if not endpoints:
        return None
    now = timezone.now()
    message = WebhookMessage(organization=organization, event_type=event_type)
    envelope = {
        "id": message.public_id,
        "type": event_type,
        "version": SCHEMA_VERSION,
        "timestamp": now.isoformat().replace("+00:00", "Z"),
        "organization": organization.slug,
        "data": _payload_data(payload),
    }
    message.body = json.dumps(envelope, sort_keys=True, separators=(",", ":"))
    message.save()
    deliveries = WebhookDelivery.objects.bulk_create(
        WebhookDelivery(
            organization=organization,
            endpoint=endpoint,
            message=message,
            state=DeliveryState.PENDING,
            next_attempt_at=now,
        )
        for endpoint in endpoints
    )
    delivery_ids = [delivery.pk for delivery in deliveries]
    transaction.on_commit(lambda: deliveries_enqueue(delivery_ids=delivery_ids))
    return message


def _payload_data(payload: dict) -> dict:
    """Redact and bound the payload (its links are API paths of slugs and public ids, which
    redaction keeps)."""
    return bounded(payload, max_bytes=PAYLOAD_MAX_BYTES)


def webhook_emit_thread_event(*, event) -> WebhookMessage | None:
    """Publish a thread event if its kind maps to a public event type (kestrel_one.webhooks
    .events); most kinds (requested, started, ...) are internal and publish nothing."""
    event_type = public_event_type(event.kind, event.data or {})
    if event_type is None:
        return None
    organization = event.thread.organization
    if not endpoints_subscribed(organization=organization, event_type=event_type):
        return None  # skip building the payload: nobody listens
    return webhook_emit(
        organization=organization,
        event_type=event_type,
        payload=thread_event_payload(event, event_type),
    )


def webhook_emit_policy_published(*, owner, version, previous) -> WebhookMessage | None:
    return webhook_emit(
        organization=owner.organization,
        event_type="policy.published",
        payload=policy_published_payload(owner=owner, version=version, previous=previous),
    )


def deliveries_enqueue(*, delivery_ids: list[int], countdown: float = 0) -> None:
    """Hand deliveries to the control workers. A lost send loses nothing: the rows stay due
    and the sweep queues them again."""
    if not broker_status().reachable:
        # Not even tried: a send to a broker that does not answer can block for seconds.
        logger.warning("the broker does not answer; %d webhook deliveries wait", len(delivery_ids))
        return
    for delivery_id in delivery_ids:
        try:
            # Found by name in the app's registry: webhooks.tasks calls into this module, so
            # this one does not import it back.
            app.tasks[DELIVER_TASK].apply_async(args=[delivery_id], countdown=countdown or None)
        except Exception:
            logger.exception("queueing webhook delivery %s failed; the sweep retries", delivery_id)


# Delivery ----------------------------------------------------------------------------------


def retry_delay(attempts: int) -> float | None:
    """Seconds before the next attempt after ``attempts`` failed ones, with jitter so that
    many deliveries failing together do not return together; None when the schedule is over."""
    delays = settings.KESTREL_WEBHOOK_RETRY_DELAYS
    if attempts > len(delays):
        return None
    base = delays[attempts - 1]
    return base * random.uniform(1 - RETRY_JITTER, 1 + RETRY_JITTER)  # noqa: S311 (not secret)


def _signature_header(endpoint: WebhookEndpoint, *, msg_id: str, at: datetime, body: str) -> str:
    """``v1,<sig>`` with the current secret, and during a rotation's overlap also with the
    previous one, space separated as Standard Webhooks specifies."""
    secrets = [secret_decrypt(endpoint.secret_encrypted)]  # SecretUnreadable: no signature
    if (
        endpoint.previous_secret_encrypted
        and endpoint.previous_secret_expires_at
        and endpoint.previous_secret_expires_at > at
    ):
        # The previous secret is a courtesy during the overlap: one that no longer decrypts
        # is left out, and the current one still signs.
        with contextlib.suppress(SecretUnreadable):
            secrets.append(secret_decrypt(endpoint.previous_secret_encrypted))
    return " ".join(
        Webhook(secret).sign(msg_id=msg_id, timestamp=at, data=body) for secret in secrets
    )


def signed_headers(endpoint: WebhookEndpoint, message: WebhookMessage, *, at: datetime) -> dict:
    return {
        "webhook-id": message.public_id,
        "webhook-timestamp": str(int(at.timestamp())),
        "webhook-signature": _signature_header(
            endpoint, msg_id=message.public_id, at=at, body=message.body
        ),
    }


def delivery_claim(*, delivery_id: int, now: datetime) -> WebhookDelivery | None:
    """Take a due delivery for one attempt (conditional UPDATE), or None if it is not due,
    already taken, or finished."""
    lease = timedelta(seconds=settings.KESTREL_WEBHOOK_LEASE_SECONDS)
    claimed = WebhookDelivery.objects.filter(deliveries_due_filter(now), pk=delivery_id).update(
        state=DeliveryState.DELIVERING,
        lease_expires_at=now + lease,
        attempts=F("attempts") + 1,
        last_attempt_at=now,
    )
    if not claimed:
        return None
    delivery = WebhookDelivery.objects.select_related(
        "endpoint", "endpoint__organization", "message"
    ).get(pk=delivery_id)
    if delivery.first_attempt_at is None:
        WebhookDelivery.objects.filter(pk=delivery_id).update(first_attempt_at=now)
        delivery.first_attempt_at = now
    return delivery


def delivery_attempt(*, delivery_id: int) -> str:
    """Make one attempt at a delivery and record its outcome. Returns what happened, for logs.

    2xx delivers. 410 fails the delivery and disables the endpoint at once. Anything else
    (3xx included: redirects are never followed), a refused destination, or a network error
    schedules the next retry, until the schedule runs out and the delivery fails; an endpoint
    with no success since that delivery's first attempt is then disabled.
    """
    started = timezone.now()
    delivery = delivery_claim(delivery_id=delivery_id, now=started)
    if delivery is None:
        return "not-due"
    endpoint = delivery.endpoint
    if not endpoint.enabled:
        _finish(delivery, DeliveryState.FAILED, error="endpoint disabled", status=None)
        return "endpoint-disabled"
    status, error = None, ""
    # Every way this can go wrong ends as a recorded failure on the retry schedule: an
    # exception that escaped would leave the delivery claimed, re-claimed by the sweep each
    # lease, forever, its attempts counting past the schedule.
    try:
        headers = signed_headers(endpoint, delivery.message, at=started)
        answer = net.post(endpoint.url, body=delivery.message.body.encode(), headers=headers)
        status = answer.status
    except SecretUnreadable as unreadable:
        error = f"not signed: {unreadable}"
    except net.DestinationRefused as refused:
        error = f"destination refused: {refused}"
    except net.SendFailed as failed:
        error = f"send failed: {failed}"
    except Exception as unexpected:
        # Its type only: a message could quote the URL's path or query, where consumers
        # keep their own tokens.
        logger.error(
            "webhook attempt failed unexpectedly: %s (delivery %s)",
            type(unexpected).__name__,
            delivery.pk,
        )
        error = f"the attempt failed inside the service ({type(unexpected).__name__})"
    if status is not None and 200 <= status < 300:
        if _finish(delivery, DeliveryState.DELIVERED, error="", status=status):
            WebhookEndpoint.objects.filter(pk=endpoint.pk).update(
                failing_since=None, consecutive_failures=0, last_success_at=timezone.now()
            )
        return "delivered"
    if status is not None:
        error = f"HTTP {status}" + (" (redirects are not followed)" if 300 <= status < 400 else "")
    WebhookEndpoint.objects.filter(pk=endpoint.pk, failing_since__isnull=True).update(
        failing_since=started
    )
    WebhookEndpoint.objects.filter(pk=endpoint.pk).update(
        consecutive_failures=F("consecutive_failures") + 1
    )
    if status == 410:
        with transaction.atomic():
            if _finish(delivery, DeliveryState.FAILED, error=error + " (gone)", status=status):
                _endpoint_disable(endpoint, reason="gone", detail="the consumer answered 410 Gone")
        return "gone"
    delay = retry_delay(delivery.attempts)
    if delay is None:
        with transaction.atomic():
            if _finish(delivery, DeliveryState.FAILED, error=error, status=status):
                _disable_if_failing_throughout(delivery)
        return "failed"
    if (
        _finish(
            delivery,
            DeliveryState.PENDING,
            error=error,
            status=status,
            next_attempt_at=timezone.now() + timedelta(seconds=delay),
        )
        and delay <= COUNTDOWN_MAX_SECONDS
    ):
        deliveries_enqueue(delivery_ids=[delivery.pk], countdown=max(delay, 0.001))
    return "retry"


def _finish(
    delivery: WebhookDelivery, state: str, *, error: str, status: int | None, next_attempt_at=None
) -> bool:
    """Record an attempt's outcome, only if this attempt still holds the delivery (a worker
    whose lease ran out must not overwrite the attempt that replaced it)."""
    now = timezone.now()
    return bool(
        WebhookDelivery.objects.filter(
            pk=delivery.pk, state=DeliveryState.DELIVERING, attempts=delivery.attempts
        ).update(
            state=state,
            last_status_code=status,
            last_error=error[:500],
            lease_expires_at=None,
            next_attempt_at=next_attempt_at,
            delivered_at=now if state == DeliveryState.DELIVERED else None,
        )
    )


def _disable_if_failing_throughout(delivery: WebhookDelivery) -> None:
    endpoint = WebhookEndpoint.objects.select_for_update().get(pk=delivery.endpoint_id)
    if endpoint.failing_since is not None and endpoint.failing_since <= delivery.first_attempt_at:
        _endpoint_disable(
            endpoint,
            reason="failing",
            detail=f"every attempt failed for {delivery.attempts} attempts over the whole "
            "retry schedule",
        )


@transaction.atomic
def delivery_retry(*, actor, delivery: WebhookDelivery) -> WebhookDelivery:
    """Send a finished delivery again by hand (same ``webhook-id``), on a fresh schedule."""
    delivery = (
        WebhookDelivery.objects.select_for_update().select_related("endpoint").get(pk=delivery.pk)
    )
    if not delivery.endpoint.enabled:
        raise Conflict("This endpoint is disabled; enable it before retrying its deliveries.")
    if delivery.state not in {DeliveryState.FAILED, DeliveryState.DELIVERED}:
        raise Conflict(f"This delivery is {delivery.state}; it will be attempted anyway.")
    now = timezone.now()
    WebhookDelivery.objects.filter(pk=delivery.pk).update(
        state=DeliveryState.PENDING,
        attempts=0,
        first_attempt_at=None,
        next_attempt_at=now,
        lease_expires_at=None,
    )
    audit_record(
        organization=delivery.organization,
        actor=actor,
        action="webhook.delivery_retry",
        target=delivery,
        data={"webhook": delivery.endpoint.public_id, "previous_state": delivery.state},
    )
    delivery_ids = [delivery.pk]
    transaction.on_commit(lambda: deliveries_enqueue(delivery_ids=delivery_ids))
    delivery.refresh_from_db()
    return delivery


def deliveries_sweep(*, now: datetime | None = None) -> int:
    """Queue again what the normal path lost: overdue retries and expired leases."""
    overdue = deliveries_overdue(now=now or timezone.now())
    if overdue:
        deliveries_enqueue(delivery_ids=overdue)
    return len(overdue)


def webhook_messages_trim(*, organization, before: datetime) -> int:
    """Delete the organization's messages (their bodies are its events' data) created before
    ``before`` that no delivery still waits to send, with their deliveries; how many."""
    settled = WebhookMessage.objects.filter(organization=organization, created_at__lt=before)
    waiting = WebhookDelivery.objects.filter(
        message=OuterRef("pk"), state__in=[DeliveryState.PENDING, DeliveryState.DELIVERING]
    )
    old = settled.exclude(Exists(waiting))
    deleted = old.count()
    old.delete()
    return deleted
