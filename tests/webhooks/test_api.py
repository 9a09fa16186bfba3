"""The webhooks API: admin only, secret shown once, deliveries listed and retried by hand."""

from __future__ import annotations

import threading

import pytest

from kestrel_one.accounts.principal import system_principal
from kestrel_one.audit.models import AuditRecord
from kestrel_one.common.errors import Conflict
from kestrel_one.webhooks import services
from kestrel_one.webhooks.models import DeliveryState, WebhookDelivery, WebhookEndpoint
from tests.api.routes import webhook_objects
from tests.factories import OrganizationFactory
from tests.support import at_once

BASE = "/api/v1/orgs/acme/webhooks"
NEW = {"url": "https://hooks.example.com/kestrel?key=abc", "event_types": ["action.failed"]}


@pytest.mark.spec("API-5", "CRED-1")
def test_admin_creates_an_endpoint_and_sees_the_secret_exactly_once(world):
    client = world["admin"].client()
    created = client.post(BASE, NEW, format="json")
    assert created.status_code == 201, created.content
    assert created["Cache-Control"] == "no-store"
    body = created.json()
    secret = body["secret"]
    assert secret.startswith("whsec_") and body["secret_fingerprint"].startswith("sha256:")
    assert body["id"].startswith("whk_") and body["enabled"] is True

    for response in (client.get(BASE), client.get(f"{BASE}/{body['id']}")):
        assert response.status_code == 200
        assert secret not in response.content.decode()
        shown = response.json()
        shown = shown["results"][0] if "results" in shown else shown
        assert "secret" not in shown
    audit = AuditRecord.objects.get(action="webhook.create")
    assert secret not in str(audit.data)
    # The URL's path and query can carry the consumer's own token: the audit keeps the origin.
    assert audit.data["origin"] == "https://hooks.example.com"


@pytest.mark.parametrize("actor", ["member", "viewer", "limited"])
def test_non_admins_get_403_on_every_webhook_route(world, actor):
    client = world[actor].client()
    assert client.get(BASE).status_code == 403
    assert client.post(BASE, NEW, format="json").status_code == 403


def test_outsider_gets_the_same_404_as_a_missing_endpoint(world):
    endpoint, _ = webhook_objects(world)
    outsider = world["outsider"].client()
    foreign = outsider.get(f"/api/v1/orgs/globex/webhooks/{endpoint.public_id}")
    missing = outsider.get("/api/v1/orgs/globex/webhooks/whk_00000000000000000000000000")
    assert foreign.status_code == missing.status_code == 404
    assert foreign.content == missing.content


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({**NEW, "url": "http://hooks.example.com/"}, "url"),
        ({**NEW, "url": "https://169.254.169.254/latest"}, "url"),
        ({**NEW, "url": "https://10.0.0.1/"}, "url"),
        ({**NEW, "event_types": ["action.exploded"]}, "event_types"),
        ({**NEW, "event_types": []}, "event_types"),
        ({**NEW, "secret": "whsec_mine"}, "secret"),
    ],
)
def test_invalid_endpoints_are_refused_naming_the_field(world, body, field):
    response = world["owner"].client().post(BASE, body, format="json")
    assert response.status_code == 400, response.content
    assert field in response.json()["error"]["details"]
    assert not WebhookEndpoint.objects.exists()


def test_patch_disables_and_enabling_again_clears_the_failure_record(world):
    endpoint, _ = webhook_objects(world)
    WebhookEndpoint.objects.filter(pk=endpoint.pk).update(
        enabled=False, disabled_reason="failing", consecutive_failures=9
    )
    client = world["owner"].client()
    enabled = client.patch(f"{BASE}/{endpoint.public_id}", {"enabled": True}, format="json")
    assert enabled.status_code == 200
    assert enabled.json()["disabled_reason"] == ""
    assert enabled.json()["consecutive_failures"] == 0


@pytest.mark.spec("API-5")
def test_rotate_secret_shows_the_new_secret_once_and_reports_the_overlap(world):
    endpoint, _ = webhook_objects(world)
    client = world["owner"].client()
    rotated = client.post(
        f"{BASE}/{endpoint.public_id}/rotate-secret", {"overlap_seconds": 600}, format="json"
    )
    assert rotated.status_code == 200
    body = rotated.json()
    assert body["secret"].startswith("whsec_")
    assert body["secret_fingerprint"] != endpoint.secret_fingerprint
    assert body["rotation_overlap_until"] is not None
    assert body["secret"] not in client.get(f"{BASE}/{endpoint.public_id}").content.decode()


def test_deliveries_are_listed_and_a_failed_one_is_retried_with_the_same_webhook_id(world):
    endpoint, delivery = webhook_objects(world)
    client = world["owner"].client()
    listed = client.get(f"{BASE}/{endpoint.public_id}/deliveries").json()["results"]
    assert [d["id"] for d in listed] == [delivery.public_id]
    assert listed[0]["state"] == "failed"
    assert listed[0]["webhook_id"] == delivery.message.public_id

    retried = client.post(f"{BASE}/{endpoint.public_id}/deliveries/{delivery.public_id}/retry")
    assert retried.status_code == 200, retried.content
    assert retried.json()["state"] == "pending"
    assert retried.json()["webhook_id"] == delivery.message.public_id
    again = client.post(f"{BASE}/{endpoint.public_id}/deliveries/{delivery.public_id}/retry")
    assert again.status_code == 409  # already on its way
    assert AuditRecord.objects.filter(action="webhook.delivery_retry").count() == 1


def test_a_delivery_is_only_found_through_its_own_endpoint(world):
    _, delivery = webhook_objects(world)
    client = world["owner"].client()
    created = client.post(BASE, NEW, format="json").json()
    wrong_parent = client.post(f"{BASE}/{created['id']}/deliveries/{delivery.public_id}/retry")
    assert wrong_parent.status_code == 404
    assert WebhookDelivery.objects.get(pk=delivery.pk).state == DeliveryState.FAILED


def test_delete_removes_the_endpoint_and_its_deliveries(world):
    endpoint, _ = webhook_objects(world)
    response = world["owner"].client().delete(f"{BASE}/{endpoint.public_id}")
    assert response.status_code == 204
    assert not WebhookEndpoint.objects.filter(pk=endpoint.pk).exists()
    assert not WebhookDelivery.objects.filter(endpoint_id=endpoint.pk).exists()


@pytest.mark.django_db(transaction=True)
def test_concurrent_creates_cannot_pass_the_endpoint_limit_together(monkeypatch):
    """The limit is counted and kept under one lock: creates that all counted 19 before any
    of them inserted made 23 endpoints (each then sends every event it subscribes to)."""
    organization = OrganizationFactory(slug="crowded")
    actor = system_principal("tests")
    limit = services.MAX_ENDPOINTS_PER_ORGANIZATION
    for index in range(limit - 1):
        services.webhook_endpoint_create(
            actor=actor,
            organization=organization,
            url=f"https://hooks{index}.example.com/",
            event_types=["action.failed"],
        )
    writers = 4
    # Every create waits here after its count, so without the lock all of them count 19;
    # with it the first waits alone (the others queue on the lock) and goes on.
    counted = threading.Barrier(writers)
    generate = services.secret_generate

    def slow_generate():
        try:
            counted.wait(timeout=2)
        except threading.BrokenBarrierError:
            pass
        return generate()

    monkeypatch.setattr(services, "secret_generate", slow_generate)

    def create(number: int) -> str:
        try:
            services.webhook_endpoint_create(
                actor=actor,
                organization=organization,
                url=f"https://racer{number}.example.com/",
                event_types=["action.failed"],
            )
        except Conflict:
            return "refused"
        return "created"

    outcomes = at_once(writers, create, timeout=60)
    assert sorted(outcomes) == ["created"] + ["refused"] * (writers - 1), outcomes
    assert WebhookEndpoint.objects.filter(organization=organization).count() == limit
