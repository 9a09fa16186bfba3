"""The credentials API: write-only secrets, fingerprints only, admins only (CRED-1)."""

from __future__ import annotations

import json

import pytest

from kestrel_one.audit.models import AuditRecord
from kestrel_one.credentials.models import Credential
from tests.credentials.helpers import assert_secret_free

SECRET = "ghp_ApiPlantedSecret0000111122223333"
ROTATED = "ghp_ApiRotatedSecret4444555566667777"
URL = "/api/v1/orgs/acme/credentials"


def _audit_text(organization) -> str:
    rows = AuditRecord.objects.filter(organization=organization).values()
    return json.dumps(list(rows), default=str)


@pytest.mark.spec("CRED-1")
def test_no_response_or_audit_row_carries_the_secret(world):
    client = world["admin"].client()
    bodies = []
    made = client.post(URL, {"name": "gh", "adapter": "github", "secret": SECRET}, format="json")
    assert made.status_code == 201, made.content
    assert made["Cache-Control"] == "no-store"
    body = made.json()
    assert body["id"].startswith("crd_")
    assert body["fingerprint"].startswith("hmac-sha256:")
    assert "secret" not in body and body["kind"] == "github_token" and body["state"] == "active"
    bodies.append(made.content)
    detail = f"{URL}/{body['id']}"
    bodies.append(client.get(URL).content)
    bodies.append(client.get(detail).content)
    rotated = client.post(f"{detail}/rotate", {"secret": ROTATED}, format="json")
    assert rotated.status_code == 200, rotated.content
    assert rotated.json()["fingerprint"] != body["fingerprint"]
    bodies.append(rotated.content)
    revoked = client.delete(detail)
    assert revoked.status_code == 204
    after = client.get(detail)
    assert after.json()["state"] == "revoked"
    bodies.append(after.content)
    again = client.post(f"{detail}/rotate", {"secret": SECRET}, format="json")
    assert again.status_code == 409
    bodies.append(again.content)
    for content in bodies:
        assert_secret_free(content, SECRET, ROTATED)

    actions = list(
        AuditRecord.objects.filter(target_id=body["id"])
        .order_by("created_at")
        .values_list("action", flat=True)
    )
    assert actions == ["credential.create", "credential.rotate", "credential.revoke"]
    rotate_row = AuditRecord.objects.get(target_id=body["id"], action="credential.rotate")
    assert rotate_row.data["previous_fingerprint"] == body["fingerprint"]
    assert_secret_free(_audit_text(world.org), SECRET, ROTATED)
    # Revoking erased what could be opened.
    row = Credential.objects.get(public_id=body["id"])
    assert bytes(row.secret_ciphertext) == b"" and bytes(row.data_key_wrapped) == b""


@pytest.mark.spec("CRED-1")
@pytest.mark.parametrize(
    "body",
    [
        {"name": "gh", "adapter": "github", "secret": SECRET + " with a space"},
        {"name": "gh", "adapter": "github", "secret": SECRET + "\r\nX-Injected: 1"},
        {"name": "gh", "adapter": "github", "secret": SECRET + "x" * 5000},
        {"name": "gh", "adapter": "github", "secret": SECRET + "\u00e9"},
        {"name": "gh", "adapter": "no-such-adapter", "secret": SECRET},
        {"adapter": "github", "secret": SECRET},
        {"name": "x" * 101, "adapter": "github", "secret": SECRET},
        {"name": "gh", "adapter": "github", "secret": SECRET, "secret_again": SECRET},
        {"name": "gh", "adapter": ["github"], "secret": SECRET},
    ],
    ids=[
        "space",
        "crlf",
        "too-long",
        "non-ascii",
        "unknown-adapter",
        "no-name",
        "long-name",
        "unknown-field",
        "adapter-list",
    ],
)
def test_a_refused_create_never_repeats_the_secret(world, body):
    response = world["admin"].client().post(URL, body, format="json")
    assert response.status_code == 400, response.content
    assert response.json()["error"]["code"] in {"invalid"}
    assert_secret_free(response.content, SECRET)
    assert not Credential.objects.exists()
    assert_secret_free(_audit_text(world.org), SECRET)


@pytest.mark.spec("CRED-1")
def test_a_nul_or_a_non_string_secret_is_refused_without_repeating_it(world):
    client = world["admin"].client()
    raw = json.dumps({"name": "gh", "adapter": "github", "secret": SECRET + "\u0000tail"})
    response = client.post(URL, raw, content_type="application/json")
    assert response.status_code == 400
    assert "NUL" in response.json()["error"]["message"]
    assert_secret_free(response.content, SECRET)
    for secret in (123456789, True, {"value": SECRET}, ""):
        response = client.post(
            URL, {"name": "gh", "adapter": "github", "secret": secret}, format="json"
        )
        assert response.status_code == 400, response.content
        assert response.json()["error"]["details"]["secret"]
        assert_secret_free(response.content, SECRET)
    assert not Credential.objects.exists()


@pytest.mark.spec("CRED-1", "CRED-4")
def test_an_unknown_adapter_is_refused_naming_the_known_ones(world):
    response = (
        world["admin"]
        .client()
        .post(URL, {"name": "gh", "adapter": "gitlab", "secret": SECRET}, format="json")
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid"
    assert "unknown adapter" in error["details"]["adapter"][0]
    assert "github" in error["details"]["adapter"][0]
    connection = (
        world["member"]
        .client()
        .post(
            "/api/v1/orgs/acme/connections", {"adapter": "gitlab", "secret": SECRET}, format="json"
        )
    )
    assert connection.status_code == 400
    assert "unknown adapter" in connection.json()["error"]["details"]["adapter"][0]


def test_only_admins_manage_credentials_and_viewers_hold_no_connections(world):
    body = {"name": "gh", "adapter": "github", "secret": SECRET}
    for name in ("member", "viewer", "limited"):
        client = world[name].client()
        assert client.post(URL, body, format="json").status_code == 403
        assert client.get(URL).status_code == 403
    viewer = world["viewer"].client()
    assert viewer.get("/api/v1/orgs/acme/connections").status_code == 403
    assert world["owner"].client().post(URL, body, format="json").status_code == 201
    duplicate = world["admin"].client().post(URL, body, format="json")
    assert duplicate.status_code == 409
    assert_secret_free(duplicate.content, SECRET)
