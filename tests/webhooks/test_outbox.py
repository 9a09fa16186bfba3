"""The outbox and one delivery attempt, in process against a real TLS consumer.

What the real worker does is proven in test_delivery_process.py; here each outcome is driven
one attempt at a time so the state after it can be read exactly.
"""

from __future__ import annotations

import json
import socket
from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone
from standardwebhooks import Webhook

from kestrel_one.accounts.principal import Principal, PrincipalKind, system_principal
from kestrel_one.audit.models import AuditRecord
from kestrel_one.execution.services import action_request
from kestrel_one.governance.services import policy_publish_environment
from kestrel_one.threads.services import thread_create
from kestrel_one.webhooks import services
from kestrel_one.webhooks.events import EVENT_TYPES
from kestrel_one.webhooks.models import (
    DeliveryState,
    WebhookDelivery,
    WebhookEndpoint,
    WebhookMessage,
)
from kestrel_one.webhooks.services import (
    delivery_attempt,
    delivery_claim,
    webhook_emit,
    webhook_endpoint_create,
)

SYSTEM = system_principal("tests")
CANARY = "ghp_" + "C4n4ryT0k3nN3v3rL34v3sTh3S3rv1c3xx"
PLAIN_CANARY = "canary-7f3a9c1e-never-in-a-webhook"


@pytest.fixture
def enqueued(monkeypatch):
    """Deliveries the code would hand to Celery; nothing reaches a broker from these tests."""
    sent: list[tuple[list[int], float]] = []
    monkeypatch.setattr(
        services,
        "deliveries_enqueue",
        lambda *, delivery_ids, countdown=0: sent.append((list(delivery_ids), countdown)),
    )
    return sent


def endpoint_for(world, url: str, *event_types: str):
    return webhook_endpoint_create(
        actor=SYSTEM,
        organization=world.org,
        url=url,
        event_types=list(event_types or EVENT_TYPES),
    )


def emit(world, event_type="policy.published", payload=None):
    with transaction.atomic():
        return webhook_emit(
            organization=world.org, event_type=event_type, payload=payload or {"n": 1}
        )


def owner_actor(world) -> Principal:
    owner = world["owner"]
    return Principal(PrincipalKind.TOKEN, user=owner.user, token=owner.token)


def test_an_event_that_rolls_back_announces_nothing(world):
    endpoint_for(world, "https://hooks.example.com/a")
    with pytest.raises(RuntimeError), transaction.atomic():
        webhook_emit(organization=world.org, event_type="policy.published", payload={})
        raise RuntimeError("the event's own write failed")
    assert not WebhookMessage.objects.exists() and not WebhookDelivery.objects.exists()


def test_only_published_event_types_can_be_emitted(world):
    endpoint_for(world, "https://hooks.example.com/a")
    with pytest.raises(ValueError, match="not a published"):
        emit(world, event_type="action.requested")


def test_only_enabled_subscribed_endpoints_get_a_delivery(world):
    wants, _ = endpoint_for(world, "https://hooks.example.com/a", "policy.published")
    endpoint_for(world, "https://hooks.example.com/b", "action.failed")
    off, _ = endpoint_for(world, "https://hooks.example.com/c", "policy.published")
    WebhookEndpoint.objects.filter(pk=off.pk).update(enabled=False)
    message = emit(world)
    assert [d.endpoint_id for d in message.deliveries.all()] == [wants.pk]
    envelope = json.loads(message.body)
    assert envelope["id"] == message.public_id and envelope["type"] == "policy.published"
    assert envelope["version"] == 1 and envelope["organization"] == "acme"


@pytest.mark.spec("CRED-1", "API-5")
def test_action_and_policy_events_carry_ids_and_links_never_arguments(world):
    endpoint_for(world, "https://hooks.example.com/all")
    thread = thread_create(actor=SYSTEM, project=world.project, title="t", mode="agent")
    awaiting = action_request(
        actor=owner_actor(world),
        thread=thread,
        tool="shell.exec",
        args={"argv": ["echo", CANARY, PLAIN_CANARY]},
    )
    denied = action_request(
        actor=owner_actor(world),
        thread=thread,
        tool="fs.write",
        args={"path": f"etc/{PLAIN_CANARY}", "content": CANARY},
    )
    policy_publish_environment(
        actor=SYSTEM,
        environment=world.environment,
        document={"capabilities": {"fs.read": {"paths": [f"{PLAIN_CANARY}/**"]}}},
    )
    bodies = {m.event_type: json.loads(m.body) for m in WebhookMessage.objects.all()}
    assert set(bodies) == {"action.awaiting_approval", "action.denied", "policy.published"}
    waiting = bodies["action.awaiting_approval"]["data"]
    assert waiting["action"] == {
        "id": awaiting.public_id,
        "tool": "shell.exec",
        "state": "awaiting_approval",
    }
    assert waiting["thread"] == thread.public_id and waiting["project"] == world.project.public_id
    assert waiting["links"]["action"] == (
        f"/api/v1/orgs/acme/projects/{world.project.public_id}/threads/{thread.public_id}"
        f"/actions/{awaiting.public_id}"
    )
    assert bodies["action.denied"]["data"]["action"]["id"] == denied.public_id
    assert bodies["policy.published"]["data"]["environment"] == world.environment.public_id
    everything = json.dumps(bodies)
    assert CANARY not in everything and PLAIN_CANARY not in everything


def test_finished_actions_map_to_their_public_types(world):
    from kestrel_one.threads.services import event_append

    endpoint_for(world, "https://hooks.example.com/all")
    thread = thread_create(actor=SYSTEM, project=world.project, title="t", mode="agent")
    action = action_request(
        actor=owner_actor(world), thread=thread, tool="shell.exec", args={"argv": ["true"]}
    )
    for state in ("succeeded", "failed", "expired", "cancelled"):
        event_append(
            thread=thread,
            kind="action.finished",
            action=action,
            data={
                "action": action.public_id,
                "state": state,
                "receipt": "rcp_01J00000000000000000000000",
                "error": {"code": "runner_lost", "message": f"details {CANARY}"},
            },
        )
    event_append(thread=thread, kind="action.started", action=action, data={})
    finished = {
        m.event_type: json.loads(m.body)["data"]
        for m in WebhookMessage.objects.exclude(event_type="action.awaiting_approval")
    }
    assert set(finished) == {
        "action.succeeded",
        "action.failed",
        "action.expired",
        "action.cancelled",
    }
    assert finished["action.failed"]["error_code"] == "runner_lost"
    assert finished["action.failed"]["links"]["receipt"].endswith("/receipt")
    assert CANARY not in json.dumps(finished)


@pytest.mark.spec("API-5")
def test_a_delivery_reaches_the_consumer_signed_and_is_marked_delivered(
    world, webhook_settings, consumer_thread, enqueued
):
    _, secret = endpoint_for(world, consumer_thread.url("/ok/a"), "policy.published")
    consumer_thread.trust("/ok/a", secret)
    message = emit(world)
    delivery = message.deliveries.get()
    assert delivery_attempt(delivery_id=delivery.pk) == "delivered"
    (received,) = consumer_thread.received()
    assert received["verified_with"] == [0]
    assert received["id"] == message.public_id
    assert Webhook(secret).verify(received["body"], received["headers"])["type"] == (
        "policy.published"
    )
    delivery.refresh_from_db()
    assert delivery.state == DeliveryState.DELIVERED and delivery.last_status_code == 204
    assert delivery_attempt(delivery_id=delivery.pk) == "not-due"  # never sent twice


@pytest.mark.spec("API-5")
def test_a_redirect_is_a_failure_and_is_not_followed(
    world, webhook_settings, consumer_thread, enqueued
):
    endpoint_for(world, consumer_thread.url("/redirect/a"), "policy.published")
    delivery = emit(world).deliveries.get()
    assert delivery_attempt(delivery_id=delivery.pk) == "retry"
    delivery.refresh_from_db()
    assert delivery.state == DeliveryState.PENDING and delivery.last_status_code == 302
    assert "not followed" in delivery.last_error
    assert [r["path"] for r in consumer_thread.received()] == ["/redirect/a"]
    assert enqueued == [([delivery.pk], pytest.approx(0.01, rel=0.5))]


@pytest.mark.spec("API-5")
def test_410_fails_the_delivery_and_disables_the_endpoint_at_once_telling_the_owners(
    world, webhook_settings, consumer_thread, enqueued
):
    gone, _ = endpoint_for(world, consumer_thread.url("/gone/a"), "policy.published")
    watcher, _ = endpoint_for(world, "https://hooks.example.com/ops", "webhook.disabled")
    delivery = emit(world).deliveries.get()
    assert delivery_attempt(delivery_id=delivery.pk) == "gone"
    gone.refresh_from_db()
    assert not gone.enabled and gone.disabled_reason == "gone"
    assert WebhookDelivery.objects.get(pk=delivery.pk).state == DeliveryState.FAILED
    audit = AuditRecord.objects.get(action="webhook.disable")
    assert audit.target_id == gone.public_id and audit.outcome == "gone"
    notice = WebhookMessage.objects.get(event_type="webhook.disabled")
    assert json.loads(notice.body)["data"]["webhook"] == gone.public_id
    assert [d.endpoint_id for d in notice.deliveries.all()] == [watcher.pk]
    assert emit(world) is None  # a disabled endpoint gets nothing new


def test_continuous_failure_over_the_whole_schedule_fails_and_disables(
    world, webhook_settings, consumer_thread, enqueued
):
    endpoint, _ = endpoint_for(world, consumer_thread.url("/fail/a"), "policy.published")
    delivery = emit(world).deliveries.get()
    outcomes = []
    for _ in range(10):
        WebhookDelivery.objects.filter(pk=delivery.pk, state="pending").update(
            next_attempt_at=timezone.now()
        )
        outcomes.append(delivery_attempt(delivery_id=delivery.pk))
        if outcomes[-1] == "failed":
            break
    assert outcomes == ["retry", "retry", "retry", "failed"]  # 3 delays -> 4 attempts
    delivery.refresh_from_db()
    assert delivery.state == DeliveryState.FAILED and delivery.last_status_code == 500
    endpoint.refresh_from_db()
    assert not endpoint.enabled and endpoint.disabled_reason == "failing"
    assert AuditRecord.objects.filter(action="webhook.disable", outcome="failing").exists()


def test_a_success_in_between_keeps_the_endpoint_enabled(
    world, webhook_settings, consumer_thread, enqueued
):
    endpoint, _ = endpoint_for(world, consumer_thread.url("/fail/a"), "policy.published")
    delivery = emit(world).deliveries.get()
    WebhookDelivery.objects.filter(pk=delivery.pk).update(attempts=3)
    # Another delivery succeeded after this one started failing.
    WebhookEndpoint.objects.filter(pk=endpoint.pk).update(
        failing_since=timezone.now() + timedelta(seconds=1)
    )
    assert delivery_attempt(delivery_id=delivery.pk) == "failed"
    endpoint.refresh_from_db()
    assert endpoint.enabled


def test_a_claim_is_exclusive_until_its_lease_expires(world, settings):
    endpoint_for(world, "https://hooks.example.com/a", "policy.published")
    delivery = emit(world).deliveries.get()
    now = timezone.now()
    first = delivery_claim(delivery_id=delivery.pk, now=now)
    assert first is not None and first.attempts == 1
    assert delivery_claim(delivery_id=delivery.pk, now=now) is None
    later = now + timedelta(seconds=settings.KESTREL_WEBHOOK_LEASE_SECONDS + 1)
    second = delivery_claim(delivery_id=delivery.pk, now=later)
    assert second is not None and second.attempts == 2
    # The first worker, back from the dead, cannot record over the attempt that replaced it.
    assert not services._finish(first, DeliveryState.DELIVERED, error="", status=204)
    assert WebhookDelivery.objects.get(pk=delivery.pk).state == DeliveryState.DELIVERING


def test_sweep_queues_overdue_retries_and_expired_leases_only(world, settings, enqueued):
    endpoint_for(world, "https://hooks.example.com/a", "policy.published")
    overdue = emit(world).deliveries.get()
    fresh = emit(world).deliveries.get()
    leased = emit(world).deliveries.get()
    now = timezone.now()
    WebhookDelivery.objects.filter(pk=overdue.pk).update(next_attempt_at=now - timedelta(hours=1))
    WebhookDelivery.objects.filter(pk=leased.pk).update(
        state="delivering", lease_expires_at=now - timedelta(seconds=1)
    )
    assert services.deliveries_sweep(now=now) == 2
    assert sorted(enqueued[-1][0]) == sorted([overdue.pk, leased.pk])
    assert fresh.pk not in enqueued[-1][0]


@pytest.mark.spec("API-5")
def test_a_name_resolving_inside_is_refused_without_telling_its_address(
    world, webhook_settings, enqueued, monkeypatch
):
    internal = "10.20.30.40"

    def resolve(host, port, *args, **kwargs):
        assert host == "hooks.corp.example.com", host
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (internal, port))]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    endpoint, _ = endpoint_for(world, "https://hooks.corp.example.com/in", "policy.published")
    delivery = emit(world).deliveries.get()
    assert delivery_attempt(delivery_id=delivery.pk) == "retry"
    delivery.refresh_from_db()
    # The endpoint's owner reads why, and the name; what the name resolves to inside the
    # service's network is the operator's to know, not a tenant's to probe for.
    assert "hooks.corp.example.com resolves to an address that is private" in delivery.last_error
    shown = world["owner"].client().get(f"/api/v1/orgs/acme/webhooks/{endpoint.public_id}")
    assert shown.status_code == 200, shown.content
    deliveries = (
        world["owner"].client().get(f"/api/v1/orgs/acme/webhooks/{endpoint.public_id}/deliveries")
    )
    assert deliveries.status_code == 200, deliveries.content
    assert "private" in deliveries.content.decode()
    for answer in (shown, deliveries):
        assert internal not in answer.content.decode()
    assert internal not in delivery.last_error


@pytest.mark.spec("AUD-6")
def test_retention_deletes_old_messages_no_delivery_still_waits_to_send(world, enqueued):
    """A message's body is its event's data, so it goes with the organization's events: once
    older than ``events_days`` and settled, with its deliveries; a pending one stays."""
    from kestrel_one.execution.retention import retention_sweep_organization

    endpoint_for(world, "https://hooks.example.com/a")
    delivered, failed, pending, recent = (emit(world) for _ in range(4))
    WebhookDelivery.objects.filter(message=delivered).update(state=DeliveryState.DELIVERED)
    WebhookDelivery.objects.filter(message=failed).update(state=DeliveryState.FAILED)
    WebhookDelivery.objects.filter(message=recent).update(state=DeliveryState.DELIVERED)
    old = timezone.now() - timedelta(days=91)  # the default events_days is 90
    WebhookMessage.objects.exclude(pk=recent.pk).update(created_at=old)

    counts = retention_sweep_organization(organization=world.org, now=timezone.now())
    assert counts["webhook_messages"] == 2
    assert set(WebhookMessage.objects.values_list("pk", flat=True)) == {pending.pk, recent.pk}
    assert set(WebhookDelivery.objects.values_list("message_id", flat=True)) == {
        pending.pk,
        recent.pk,
    }
    record = AuditRecord.objects.get(organization=world.org, action="retention.sweep")
    assert record.data["deleted"]["webhook_messages"] == 2


# An attempt always records its outcome ---------------------------------------------------


def _attempt_until_done(delivery) -> list[str]:
    outcomes = []
    for _ in range(10):
        WebhookDelivery.objects.filter(pk=delivery.pk, state="pending").update(
            next_attempt_at=timezone.now()
        )
        outcomes.append(delivery_attempt(delivery_id=delivery.pk))
        if outcomes[-1] != "retry":
            break
    return outcomes


@pytest.mark.spec("API-5")
def test_an_unreadable_signing_secret_fails_the_attempt_on_schedule_never_holds_it(
    world, webhook_settings, consumer_thread, enqueued
):
    """The encryption key's root changed (docs/webhooks.md): the stored secret no longer
    decrypts. The attempt is a recorded failure that follows the retry schedule, so the
    delivery ends instead of being re-claimed by the sweep every lease, forever."""
    endpoint, _ = endpoint_for(world, consumer_thread.url("/ok/a"), "policy.published")
    delivery = emit(world).deliveries.get()
    webhook_settings.KESTREL_WEBHOOK_ENCRYPTION_KEY = "a-new-root-the-secret-was-not-made-with"

    assert _attempt_until_done(delivery) == ["retry", "retry", "retry", "failed"]
    delivery.refresh_from_db()
    assert delivery.state == DeliveryState.FAILED and delivery.lease_expires_at is None
    assert "cannot be decrypted" in delivery.last_error and "rotate" in delivery.last_error
    assert consumer_thread.received() == []  # nothing unsigned ever left
    endpoint.refresh_from_db()
    assert not endpoint.enabled and endpoint.disabled_reason == "failing"


@pytest.mark.spec("API-5")
def test_rotating_after_the_key_changed_signs_with_the_new_secret_alone(
    world, webhook_settings, consumer_thread, enqueued
):
    """The documented way out of a changed key (rotate every endpoint) works at once, even
    with the default overlap: an old secret that no longer decrypts signs nothing."""
    endpoint, _ = endpoint_for(world, consumer_thread.url("/ok/a"), "policy.published")
    webhook_settings.KESTREL_WEBHOOK_ENCRYPTION_KEY = "a-new-root-the-secret-was-not-made-with"
    endpoint, secret = services.webhook_secret_rotate(
        actor=SYSTEM, endpoint=endpoint, overlap_seconds=3600
    )
    consumer_thread.trust("/ok/a", secret)
    delivery = emit(world).deliveries.get()
    assert delivery_attempt(delivery_id=delivery.pk) == "delivered"
    (received,) = consumer_thread.received()
    assert received["verified_with"] == [0]
    assert len(received["headers"]["webhook-signature"].split(" ")) == 1


def test_an_unexpected_error_inside_an_attempt_is_recorded_not_left_holding_the_lease(
    world, webhook_settings, consumer_thread, enqueued, monkeypatch
):
    """Whatever goes wrong inside the send, the attempt ends as a recorded failure (its type
    only: a message could quote the URL's path, where consumers keep tokens)."""
    endpoint_for(world, consumer_thread.url("/ok/a?key=" + PLAIN_CANARY), "policy.published")
    delivery = emit(world).deliveries.get()

    def broken_post(url, **kwargs):
        raise ValueError(f"cannot send to {url}")

    monkeypatch.setattr(services.net, "post", broken_post)
    assert _attempt_until_done(delivery) == ["retry", "retry", "retry", "failed"]
    delivery.refresh_from_db()
    assert delivery.state == DeliveryState.FAILED and delivery.attempts == 4
    assert "ValueError" in delivery.last_error and PLAIN_CANARY not in delivery.last_error
