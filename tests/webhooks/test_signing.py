"""Signatures: the Standard Webhooks vector, rotation overlap, and secrets at rest."""

from __future__ import annotations

import datetime

import pytest
from django.utils import timezone
from standardwebhooks import Webhook, WebhookVerificationError

from kestrel_one.accounts.principal import system_principal
from kestrel_one.webhooks.models import WebhookEndpoint, WebhookMessage
from kestrel_one.webhooks.secrets import secret_decrypt
from kestrel_one.webhooks.services import (
    signed_headers,
    webhook_endpoint_create,
    webhook_secret_rotate,
)

# Published with the Standard Webhooks libraries (standard-webhooks/standard-webhooks,
# libraries/python/tests/test_webhooks.py::test_sign_function).
VECTOR = {
    "secret": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
    "msg_id": "msg_p5jXN8AQM9LWM0D4loKWxJek",
    "timestamp": 1614265330,
    "payload": '{"test": 2432232314}',
    "signature": "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=",
}


def _endpoint(world):
    return webhook_endpoint_create(
        actor=system_principal("tests"),
        organization=world.org,
        url="https://hooks.example.com/in",
        event_types=["policy.published"],
    )


@pytest.mark.spec("API-5")
def test_published_test_vector_reproduces_byte_for_byte():
    at = datetime.datetime.fromtimestamp(VECTOR["timestamp"], tz=datetime.UTC)
    signature = Webhook(VECTOR["secret"]).sign(
        msg_id=VECTOR["msg_id"], timestamp=at, data=VECTOR["payload"]
    )
    assert signature.encode() == VECTOR["signature"].encode()


@pytest.mark.spec("API-5")
def test_our_headers_reproduce_the_vector(world):
    """The service's own signing path, with the vector's secret stored as an endpoint's."""
    from kestrel_one.webhooks.secrets import secret_encrypt

    endpoint, _ = _endpoint(world)
    endpoint.secret_encrypted = secret_encrypt(VECTOR["secret"])
    message = WebhookMessage(public_id=VECTOR["msg_id"], body=VECTOR["payload"])
    at = datetime.datetime.fromtimestamp(VECTOR["timestamp"], tz=datetime.UTC)
    headers = signed_headers(endpoint, message, at=at)
    assert headers == {
        "webhook-id": VECTOR["msg_id"],
        "webhook-timestamp": str(VECTOR["timestamp"]),
        "webhook-signature": VECTOR["signature"],
    }


@pytest.mark.spec("API-5", "CRED-1")
def test_secret_is_encrypted_at_rest_and_only_a_fingerprint_remains(world):
    endpoint, secret = _endpoint(world)
    assert secret.startswith("whsec_")
    stored = WebhookEndpoint.objects.filter(pk=endpoint.pk).values().get()
    assert secret not in str(stored)
    assert secret.removeprefix("whsec_") not in str(stored)
    assert secret_decrypt(stored["secret_encrypted"]) == secret
    assert stored["secret_fingerprint"].startswith("sha256:")


@pytest.mark.spec("API-5")
def test_rotation_sends_both_signatures_during_the_overlap_then_only_the_new(world):
    endpoint, old_secret = _endpoint(world)
    endpoint, new_secret = webhook_secret_rotate(
        actor=system_principal("tests"), endpoint=endpoint, overlap_seconds=3600
    )
    assert new_secret != old_secret
    message = WebhookMessage(public_id="msg_rotation", body='{"type":"policy.published"}')
    now = timezone.now()
    headers = signed_headers(endpoint, message, at=now)
    assert len(headers["webhook-signature"].split(" ")) == 2
    for secret in (old_secret, new_secret):
        Webhook(secret).verify(message.body, headers)  # either secret verifies

    after_overlap = now + datetime.timedelta(hours=2)
    later = signed_headers(endpoint, message, at=after_overlap)
    assert len(later["webhook-signature"].split(" ")) == 1
    assert later["webhook-signature"] == Webhook(new_secret).sign(
        msg_id="msg_rotation", timestamp=after_overlap, data=message.body
    )


def test_rotation_without_overlap_drops_the_old_secret_at_once(world):
    endpoint, old_secret = _endpoint(world)
    endpoint, _ = webhook_secret_rotate(
        actor=system_principal("tests"), endpoint=endpoint, overlap_seconds=0
    )
    message = WebhookMessage(public_id="msg_cut", body="{}")
    headers = signed_headers(endpoint, message, at=timezone.now())
    with pytest.raises(WebhookVerificationError):
        Webhook(old_secret).verify(message.body, headers)
