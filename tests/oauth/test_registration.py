"""Dynamic client registration (RFC 7591): public clients only, strict redirect URIs, errors
in the RFC's form, bounded in size and rate; and the metadata documents."""

from __future__ import annotations

import json

import pytest
from oauth2_provider.models import Application

from kestrel_one.oauth.models import ClientRegistration

pytestmark = pytest.mark.django_db


def register(client, body, **extra):
    return client.post(
        "/oauth/register", data=json.dumps(body), content_type="application/json", **extra
    )


@pytest.mark.parametrize(
    "uri",
    [
        "https://claude.ai/api/mcp/auth_callback",
        "http://127.0.0.1:33418/callback",
        "http://localhost/callback",
        "http://[::1]:8080/cb?x=1",
    ],
)
def test_https_and_loopback_redirect_uris_are_accepted(client, uri):
    response = register(client, {"redirect_uris": [uri], "client_name": "ok"})
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["token_endpoint_auth_method"] == "none"
    assert body["redirect_uris"] == [uri]
    assert "client_secret" not in body
    application = Application.objects.get(client_id=body["client_id"])
    assert application.client_type == Application.CLIENT_PUBLIC
    assert application.user is None and not application.skip_authorization


@pytest.mark.parametrize(
    "uri",
    [
        "http://example.com/callback",  # plain http off loopback
        "http://127.0.0.1.example.com/cb",  # looks like loopback, is not
        "https://client.example/cb#frag",
        "https://user:pw@client.example/cb",
        "cursor://anysphere.cursor-mcp/oauth/callback",
        "javascript:alert(1)",
        "https:///no-host",
        "https://client.example/a b",
        "https://client.example/" + "a" * 2100,
    ],
)
def test_other_redirect_uris_are_refused(client, uri):
    response = register(client, {"redirect_uris": [uri]})
    assert response.status_code == 400
    assert response.json()["error"] == "invalid_redirect_uri"
    assert not Application.objects.exists()


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ({"redirect_uris": []}, "invalid_redirect_uri"),
        ({}, "invalid_redirect_uri"),
        ({"redirect_uris": "https://a.example/cb"}, "invalid_client_metadata"),
        (
            {
                "redirect_uris": ["https://a.example/cb"],
                "token_endpoint_auth_method": "client_secret_post",
            },
            "invalid_client_metadata",
        ),
        (
            {"redirect_uris": ["https://a.example/cb"], "grant_types": ["client_credentials"]},
            "invalid_client_metadata",
        ),
        (
            {"redirect_uris": ["https://a.example/cb"], "response_types": ["token"]},
            "invalid_client_metadata",
        ),
        (
            {"redirect_uris": ["https://a.example/cb"], "scope": "actions:approve"},
            "invalid_client_metadata",
        ),
        (
            {"redirect_uris": ["https://a.example/cb"], "client_name": "x" * 101},
            "invalid_client_metadata",
        ),
        ({"redirect_uris": ["https://a.example/cb"], "client_name": 7}, "invalid_client_metadata"),
        ({"redirect_uris": ["https://a.example/cb"] * 11}, "invalid_redirect_uri"),
    ],
)
def test_bad_metadata_gets_an_rfc7591_error(client, body, error):
    response = register(client, body)
    assert response.status_code == 400
    assert response.json()["error"] == error
    assert response.json()["error_description"]


def test_a_body_that_is_not_json_is_refused(client):
    response = client.post("/oauth/register", data="{nope", content_type="application/json")
    assert response.status_code == 400
    assert response.json()["error"] == "invalid_client_metadata"


@pytest.mark.spec("API-6")
def test_a_deeply_nested_body_is_refused_not_a_server_error(client):
    client.raise_request_exception = False
    body = "[" * 8000 + "]" * 8000
    response = client.post("/oauth/register", data=body, content_type="application/json")
    assert response.status_code == 400, response.content
    assert response.json()["error"] == "invalid_client_metadata"
    assert not Application.objects.exists()


def test_a_large_body_is_refused(client):
    body = {"redirect_uris": ["https://a.example/cb"], "padding": "x" * 20_000}
    response = register(client, body)
    assert response.status_code == 413
    assert response.json()["error"] == "invalid_client_metadata"


def test_registrations_are_bounded_per_address(client, settings):
    settings.KESTREL_OAUTH_REGISTRATIONS_PER_ADDRESS_HOUR = 2
    body = {"redirect_uris": ["https://a.example/cb"]}
    assert register(client, body).status_code == 201
    assert register(client, body).status_code == 201
    refused = register(client, body)
    assert refused.status_code == 429
    assert refused.json()["error"] == "temporarily_unavailable"
    assert refused["Retry-After"]
    # Another address still may.
    assert register(client, body, REMOTE_ADDR="10.1.2.3").status_code == 201
    assert ClientRegistration.objects.count() == 3


def test_an_ipv6_client_counts_as_its_whole_64(client, settings):
    """One site holds a /64: a fresh address from it per registration is the same client."""
    settings.KESTREL_OAUTH_REGISTRATIONS_PER_ADDRESS_HOUR = 2
    body = {"redirect_uris": ["https://a.example/cb"]}
    for n in (1, 2):
        assert register(client, body, REMOTE_ADDR=f"2001:db8:7:9::{n}").status_code == 201
    assert register(client, body, REMOTE_ADDR="2001:db8:7:9:ffff::3").status_code == 429
    assert register(client, body, REMOTE_ADDR="2001:db8:7:a::1").status_code == 201
    stored = set(ClientRegistration.objects.values_list("remote_addr", flat=True))
    assert stored == {"2001:db8:7:9::", "2001:db8:7:a::"}


def test_registration_only_takes_post(client):
    assert client.get("/oauth/register").status_code == 405


def test_control_characters_in_the_name_are_refused(client):
    response = register(
        client, {"redirect_uris": ["https://a.example/cb"], "client_name": "a\x00b"}
    )
    assert response.status_code == 400


def test_metadata_uses_the_public_url_when_set(client, settings):
    settings.KESTREL_PUBLIC_URL = "https://kestrel.example.com"
    path = "/api/v1/orgs/acme/projects/prj_X/mcp"
    resource = client.get("/.well-known/oauth-protected-resource" + path).json()
    assert resource["resource"] == "https://kestrel.example.com" + path
    assert resource["authorization_servers"] == ["https://kestrel.example.com"]
    server = client.get("/.well-known/oauth-authorization-server").json()
    assert server["issuer"] == "https://kestrel.example.com"
    assert server["token_endpoint"] == "https://kestrel.example.com/oauth/token"
    assert server["revocation_endpoint"] == "https://kestrel.example.com/oauth/revoke"
    assert server["registration_endpoint"] == "https://kestrel.example.com/oauth/register"


def test_the_resource_metadata_is_the_same_for_any_org(client, world):
    real = client.get(
        f"/.well-known/oauth-protected-resource/api/v1/orgs/{world.org.slug}/projects/"
        f"{world.project.public_id}/mcp"
    )
    made_up = client.get(
        "/.well-known/oauth-protected-resource/api/v1/orgs/nope/projects/prj_0/mcp"
    )
    assert real.status_code == made_up.status_code == 200
    assert set(real.json()) == set(made_up.json())


def test_a_person_token_is_limited_only_to_projects_they_see(world):
    from kestrel_one.accounts.principal import Principal, PrincipalKind
    from kestrel_one.accounts.services import token_create
    from kestrel_one.common.errors import PermissionDenied, ValidationFailed

    limited = Principal(PrincipalKind.SESSION, user=world["limited"].user)
    with pytest.raises(PermissionDenied):
        token_create(
            actor=limited,
            organization=world.org,
            name="x",
            scopes=["projects:read"],
            limit_to_projects=[world.project],
        )
    with pytest.raises(ValidationFailed):
        token_create(
            actor=limited,
            organization=world.org,
            name="x",
            scopes=["projects:read"],
            limit_to_projects=[],
        )
    token, _ = token_create(
        actor=limited,
        organization=world.org,
        name="x",
        scopes=["projects:read"],
        limit_to_projects=[world.other_project],
    )
    assert token.limited_to_projects and list(token.projects.all()) == [world.other_project]


@pytest.mark.spec("TEN-4")
def test_a_token_minted_by_a_limited_token_is_limited_as_much(world):
    """A person's token limited to some projects (an MCP client's) that mints another token
    for the person used to mint one that saw all the person's projects. Today no limited
    token holds ``tokens:write``; the limit is inherited anyway, at the mechanism."""
    from kestrel_one.accounts.principal import Principal, PrincipalKind, system_principal
    from kestrel_one.accounts.services import token_create

    owner = world["owner"].user
    limited, _ = token_create(
        actor=system_principal("tests"),
        organization=world.org,
        name="mcp client",
        scopes=["projects:read", "tokens:write"],
        user=owner,
        limit_to_projects=[world.project],
    )
    child, _ = token_create(
        actor=Principal(PrincipalKind.TOKEN, user=owner, token=limited),
        organization=world.org,
        name="child",
        scopes=["projects:read"],
    )
    assert child.limited_to_projects and list(child.projects.all()) == [world.project]
    seen = Principal(PrincipalKind.TOKEN, user=owner, token=child)
    assert world.org.projects.limit_of(seen, world.org) is not None
