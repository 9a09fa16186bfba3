"""API tokens: hashed at rest, both headers, expiry, revocation, scopes; sessions refused."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone
from rest_framework.test import APIClient

from kestrel_one.accounts.models import ApiToken

pytestmark = pytest.mark.spec("API-1")


def all_text_in_database() -> str:
    """Every text column of every table, to search for a plaintext that must not be there."""
    chunks = []
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT table_name, column_name FROM information_schema.columns "
            "WHERE table_schema = 'public' AND data_type IN ('text', 'character varying', 'jsonb')"
        )
        for table, column in cursor.fetchall():
            cursor.execute(f'SELECT "{column}"::text FROM "{table}"')  # noqa: S608 - catalog names
            chunks.extend(str(value) for (value,) in cursor.fetchall() if value)
    return "\n".join(chunks)


def test_token_plaintext_is_nowhere_in_the_database(world):
    owner = world["owner"].client()
    created = owner.post(
        "/api/v1/orgs/acme/tokens", {"name": "ci", "scopes": ["org:read"]}, format="json"
    )
    assert created.status_code == 201
    plaintext = created.json()["token"]
    assert plaintext.startswith("kst_")
    assert created["Cache-Control"] == "no-store"
    text = all_text_in_database()
    assert plaintext not in text
    assert plaintext.split("_", 2)[2] not in text  # nor its secret part alone
    for actor in world.actors.values():
        if actor.plaintext:
            assert actor.plaintext not in text


def test_secret_is_shown_only_at_creation(world):
    owner = world["owner"].client()
    created = owner.post(
        "/api/v1/orgs/acme/tokens", {"name": "ci", "scopes": ["org:read"]}, format="json"
    ).json()
    shown = owner.get(f"/api/v1/orgs/acme/tokens/{created['id']}").json()
    listed = owner.get("/api/v1/orgs/acme/tokens").content.decode()
    assert "token" not in shown
    assert created["token"] not in listed
    assert shown["prefix"] == created["token"][:16]


@pytest.mark.parametrize("header", ["HTTP_AUTHORIZATION", "HTTP_X_KESTREL_TOKEN"])
def test_both_headers_authenticate(world, header):
    token = world["viewer"].plaintext
    value = f"Bearer {token}" if header == "HTTP_AUTHORIZATION" else token
    response = APIClient(REMOTE_ADDR="203.0.113.7").get("/api/v1/orgs/acme", **{header: value})
    assert response.status_code == 200
    assert response.json()["role"] == "viewer"


def test_two_headers_must_carry_the_same_token(world):
    viewer, owner = world["viewer"].plaintext, world["owner"].plaintext
    client = APIClient(REMOTE_ADDR="203.0.113.7")
    same = client.get(
        "/api/v1/orgs/acme", HTTP_AUTHORIZATION=f"Bearer {viewer}", HTTP_X_KESTREL_TOKEN=viewer
    )
    assert same.status_code == 200 and same.json()["role"] == "viewer"
    differ = client.get(
        "/api/v1/orgs/acme", HTTP_AUTHORIZATION=f"Bearer {viewer}", HTTP_X_KESTREL_TOKEN=owner
    )
    assert differ.status_code == 401
    assert "different tokens" in differ.json()["error"]["message"]


@pytest.mark.parametrize(
    "value",
    ["Bearer kst_aaaaaaaaaaaa_" + "x" * 43, "Bearer nonsense", "Basic dXNlcjpwYXNz", "Bearer "],
)
def test_invalid_credentials_get_401(world, value):
    response = APIClient(REMOTE_ADDR="203.0.113.7").get(
        "/api/v1/orgs/acme", HTTP_AUTHORIZATION=value
    )
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "not_authenticated"
    assert response["WWW-Authenticate"].startswith("Bearer")


def test_expired_token_gets_401(world):
    ApiToken.objects.filter(pk=world["owner"].token.pk).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    assert world["owner"].client().get("/api/v1/orgs/acme").status_code == 401


def test_revoked_token_gets_401(world):
    owner = world["owner"].client()
    created = owner.post(
        "/api/v1/orgs/acme/tokens", {"name": "x", "scopes": ["org:read"]}, format="json"
    ).json()
    client = APIClient(REMOTE_ADDR="203.0.113.7", HTTP_AUTHORIZATION=f"Bearer {created['token']}")
    assert client.get("/api/v1/orgs/acme").status_code == 200
    revoked = owner.delete(f"/api/v1/orgs/acme/tokens/{created['id']}")
    assert revoked.status_code == 200 and revoked.json()["revoked_at"]
    assert client.get("/api/v1/orgs/acme").status_code == 401


@pytest.mark.spec("API-2", "API-4")
def test_session_cookie_alone_gets_401(world, client):
    owner = world["owner"].user
    response = client.post(
        "/login", {"email": owner.email, "password": "correct horse battery staple"}
    )
    assert response.status_code == 302
    cookie = response.cookies["sessionid"]
    assert cookie["httponly"] and cookie["samesite"] == "Lax"
    assert client.get("/console/").status_code == 200  # the console accepts the session
    api_response = client.get("/api/v1/orgs/acme", REMOTE_ADDR="203.0.113.7")
    assert api_response.status_code == 401
    assert api_response.json()["error"]["code"] == "not_authenticated"


@pytest.mark.spec("API-2")
def test_login_with_wrong_password_says_nothing_specific(world, client):
    response = client.post("/login", {"email": world["owner"].user.email, "password": "wrong"})
    assert response.status_code == 400
    assert b"Those credentials did not work." in response.content
    assert "sessionid" not in response.cookies


def test_integration_token_acts_with_exactly_its_scopes(world):
    owner = world["owner"].client()
    created = owner.post(
        "/api/v1/orgs/acme/tokens",
        {"name": "deploy-bot", "scopes": ["org:read"], "integration": True},
        format="json",
    ).json()
    assert created["integration"] is True and created["person"] is None
    bot = APIClient(REMOTE_ADDR="203.0.113.7", HTTP_AUTHORIZATION=f"Bearer {created['token']}")
    assert bot.get("/api/v1/orgs/acme/projects").status_code == 200
    refused = bot.post("/api/v1/orgs/acme/environments", {"name": "x"}, format="json")
    assert refused.status_code == 403
    assert "environments:write" in refused.json()["error"]["message"]
    assert bot.get("/api/v1/orgs/acme").json()["scopes"] == ["org:read"]


def test_integration_token_cannot_approve(world):
    response = (
        world["owner"]
        .client()
        .post(
            "/api/v1/orgs/acme/tokens",
            {"name": "bot", "scopes": ["actions:approve"], "integration": True},
            format="json",
        )
    )
    assert response.status_code == 400
    assert "scopes" in response.json()["error"]["details"]


def test_member_cannot_mint_scopes_they_do_not_hold(world):
    response = (
        world["member"]
        .client()
        .post(
            "/api/v1/orgs/acme/tokens", {"name": "x", "scopes": ["policies:write"]}, format="json"
        )
    )
    assert response.status_code == 403
    assert "policies:write" in response.json()["error"]["message"]


def test_member_cannot_create_integration_tokens(world):
    response = (
        world["member"]
        .client()
        .post(
            "/api/v1/orgs/acme/tokens",
            {"name": "x", "scopes": ["org:read"], "integration": True},
            format="json",
        )
    )
    assert response.status_code == 403


def test_person_token_loses_power_when_role_drops(world):
    member = world["member"]
    member.membership.role = "viewer"
    member.membership.save()
    refused = member.client().post(
        "/api/v1/orgs/acme/projects",
        {"name": "p", "environment": world.environment.public_id},
        format="json",
    )
    assert refused.status_code == 403
    scopes = member.client().get("/api/v1/orgs/acme").json()["scopes"]
    assert scopes == ["org:read", "projects:read", "tokens:write"]


def test_removed_member_token_stops_working(world):
    member = world["member"]
    owner = world["owner"].client()
    assert (
        owner.delete(f"/api/v1/orgs/acme/members/{member.membership.public_id}").status_code == 204
    )
    assert member.client().get("/api/v1/orgs/acme").status_code == 401


def test_unknown_scope_is_refused_by_name(world):
    response = (
        world["owner"]
        .client()
        .post(
            "/api/v1/orgs/acme/tokens", {"name": "x", "scopes": ["org:read", "root"]}, format="json"
        )
    )
    assert response.status_code == 400
    assert "scopes" in response.json()["error"]["details"]


def test_expiry_beyond_the_maximum_is_refused(world):
    far = (timezone.now() + timedelta(days=5000)).isoformat()
    response = (
        world["owner"]
        .client()
        .post(
            "/api/v1/orgs/acme/tokens",
            {"name": "x", "scopes": ["org:read"], "expires_at": far},
            format="json",
        )
    )
    assert response.status_code == 400
    assert "expires_at" in response.json()["error"]["details"]


def test_a_token_only_reaches_its_own_organization(world):
    # The outsider is an owner in globex; its token says nothing about acme.
    response = world["outsider"].client().get("/api/v1/orgs")
    assert [o["slug"] for o in response.json()] == ["globex"]


def test_tokens_that_held_org_admin_hold_each_power_it_was_split_into(world):
    from importlib import import_module

    from django.apps import apps

    migration = import_module("kestrel_one.accounts.migrations.0003_split_org_admin_scope")
    token = world["admin"].token
    type(token).objects.filter(pk=token.pk).update(scopes=["org:admin", "org:read"])
    migration.split_org_admin(apps, None)
    token.refresh_from_db()
    assert "org:admin" not in token.scopes
    assert set(token.scopes) == {
        "org:read",
        "tokens:write",
        "tokens:admin",
        "members:write",
        "environments:write",
        "projects:manage",
        "policies:write",
        "runners:write",
        "webhooks:write",
        "retention:write",
    }
