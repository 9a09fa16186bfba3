"""The whole OAuth flow an MCP client needs, over real HTTP: discovery from the endpoint's
401, registration, a person's consent, the code exchange with the PKCE verifier, the token
on the MCP endpoint of that one Project (and nowhere else), refresh and revocation."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from axes.models import AccessAttempt
from django.conf import settings as django_settings
from django.core.cache import caches
from django.test import RequestFactory
from guardian.shortcuts import assign_perm, remove_perm

from kestrel_one.accounts.models import ApiToken
from kestrel_one.accounts.principal import Principal, PrincipalKind
from kestrel_one.accounts.services import token_create, token_revoke
from kestrel_one.audit.models import AuditRecord
from kestrel_one.execution.tasks import retention
from kestrel_one.oauth.models import AuthorizationCode, OAuthGrant
from kestrel_one.oauth.services import authorization_codes_trim
from kestrel_one.oauth.views import TokenRateThrottle
from tests.console.browser import PASSWORD
from tests.oauth.flow import (
    REDIRECT_URI,
    Pkce,
    authorize_path,
    bearer,
    browser,
    consent,
    exchange,
    http,
    mcp_path,
    redirect_params,
    refresh,
    register,
)

pytestmark = pytest.mark.django_db(transaction=True)

ACCEPT = "application/json, text/event-stream"
INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-11-25",
        "capabilities": {},
        "clientInfo": {"name": "oauth-test", "version": "1"},
    },
}


def mcp_initialize(client, project, token):
    return client.post(
        mcp_path(project),
        json=INITIALIZE,
        headers={**bearer(token), "Accept": ACCEPT, "MCP-Protocol-Version": "2025-11-25"},
    )


def connect(live_server, world, person="member"):
    """Register, consent as ``person`` and exchange the code: (client, client_id, tokens)."""
    client = http(live_server.url)
    client_id = register(client)
    pkce = Pkce.make()
    resource = live_server.url + mcp_path(world.project)
    answer = consent(
        browser(live_server.url, world[person].user), authorize_path(client_id, resource, pkce)
    )
    code = redirect_params(answer)["code"]
    response = exchange(client, client_id, code, pkce.verifier, resource=resource)
    assert response.status_code == 200, response.text
    return client, client_id, response.json()


@pytest.mark.spec("API-1")
@pytest.mark.spec("POL-5")
def test_an_mcp_client_discovers_registers_gets_consent_and_uses_its_token(live_server, world):
    client = http(live_server.url)
    origin = live_server.url
    endpoint = origin + mcp_path(world.project)

    # Discovery: the endpoint's 401 names the resource metadata, which names this server.
    refused = client.post(mcp_path(world.project), json=INITIALIZE, headers={"Accept": ACCEPT})
    assert refused.status_code == 401
    challenge = refused.headers["www-authenticate"]
    metadata_url = re.search(r'resource_metadata="([^"]+)"', challenge)[1]
    assert metadata_url == (
        f"{origin}/.well-known/oauth-protected-resource{mcp_path(world.project)}"
    )
    resource = client.get(metadata_url).json()
    assert resource["resource"] == endpoint
    assert resource["authorization_servers"] == [origin]
    assert resource["scopes_supported"] == ["projects:read", "projects:write"]
    assert resource["bearer_methods_supported"] == ["header"]
    server = client.get(f"{origin}/.well-known/oauth-authorization-server").json()
    assert server["issuer"] == origin
    assert server["authorization_endpoint"] == f"{origin}/console/oauth/authorize"
    assert server["code_challenge_methods_supported"] == ["S256"]
    assert server["token_endpoint_auth_methods_supported"] == ["none"]
    assert server["grant_types_supported"] == ["authorization_code", "refresh_token"]
    assert server["response_types_supported"] == ["code"]

    registered = client.post(
        server["registration_endpoint"],
        json={
            "client_name": "Claude-ish",
            "redirect_uris": [REDIRECT_URI],
            "token_endpoint_auth_method": "none",
        },
    )
    assert registered.status_code == 201, registered.text
    client_id = registered.json()["client_id"]
    assert "client_secret" not in registered.json()

    pkce = Pkce.make()
    path = authorize_path(client_id, endpoint, pkce)
    # Not signed in: to the sign-in page, which comes back here.
    anonymous = client.get(path)
    assert anonymous.status_code == 302
    assert anonymous.headers["location"].startswith("/login?next=/console/oauth/authorize")

    person = browser(origin, world["member"].user)
    page = person.get(path)
    assert page.status_code == 200
    for shown in ("Claude-ish", world.org.name, world.project.name, "127.0.0.1:8765"):
        assert shown in page.text
    assert "projects:write" in page.text and "actions:approve" not in page.text
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    answer = consent(person, path)
    params = redirect_params(answer)
    assert params["state"] == "st-123"
    assert params["iss"] == origin  # RFC 9207, the issuer the metadata names
    # Only the code's digest is stored.
    assert not AuthorizationCode.objects.filter(code_hash=params["code"]).exists()

    tokens = exchange(client, client_id, params["code"], pkce.verifier, resource=endpoint)
    assert tokens.status_code == 200, tokens.text
    assert tokens.headers["cache-control"] == "no-store"
    body = tokens.json()
    access = body["access_token"]
    assert access.startswith("kst_")
    assert body["token_type"] == "Bearer"
    assert body["expires_in"] == 3600
    assert body["scope"] == "projects:read projects:write"
    token = ApiToken.objects.get(key_id=access.split("_")[1])
    assert token.user == world["member"].user
    assert token.limited_to_projects and list(token.projects.all()) == [world.project]
    assert sorted(token.scopes) == ["projects:read", "projects:write"]
    grant = OAuthGrant.objects.get(api_token=token)
    assert body["refresh_token"] not in {grant.refresh_hash}
    assert AuditRecord.objects.filter(action="oauth.consent", organization=world.org).exists()

    # The MCP endpoint of that Project, and nothing else: not another Project's, and not
    # the REST API, which the mcp surface policy does not judge (ApiToken.audience).
    org, prj = world.org.slug, world.project.public_id
    assert token.audience == "mcp"
    assert mcp_initialize(client, world.project, access).status_code == 200
    assert mcp_initialize(client, world.other_project, access).status_code == 404
    threads = f"/api/v1/orgs/{org}/projects/{prj}/threads"
    rest = client.get(threads, headers=bearer(access))
    assert rest.status_code == 401, rest.text
    assert "for the mcp endpoint of its Project only" in rest.json()["error"]["message"]
    # Nor can it approve there: that stays with the person.
    act = world.action
    approve = client.post(
        f"/api/v1/orgs/{org}/projects/{prj}/threads/{act.thread.public_id}/actions/"
        f"{act.public_id}/approve",
        json={},
        headers=bearer(access),
    )
    assert approve.status_code == 401, approve.text
    assert act.__class__.objects.get(pk=act.pk).state == act.state

    # It is on the person's tokens page, like every token.
    tokens_page = person.get(f"/console/{org}/tokens")
    assert "OAuth: Claude-ish" in tokens_page.text

    # Refresh: a fresh token, the previous one revoked, the refresh token rotated.
    refreshed = refresh(client, client_id, body["refresh_token"])
    assert refreshed.status_code == 200, refreshed.text
    fresh = refreshed.json()
    assert fresh["access_token"] != access and fresh["refresh_token"] != body["refresh_token"]
    assert mcp_initialize(client, world.project, access).status_code == 401
    assert mcp_initialize(client, world.project, fresh["access_token"]).status_code == 200
    # Revocation ends the consent: the access token and the refresh token stop working.
    revoked = client.post(
        "/oauth/revoke", data={"token": fresh["access_token"], "client_id": client_id}
    )
    assert revoked.status_code == 200
    assert mcp_initialize(client, world.project, fresh["access_token"]).status_code == 401
    after = refresh(client, client_id, fresh["refresh_token"])
    assert after.status_code == 400


@pytest.mark.spec("API-1")
def test_a_token_minted_by_an_mcp_clients_token_works_only_where_it_does(live_server, world):
    client, _client_id, tokens = connect(live_server, world)
    token = ApiToken.objects.get(key_id=tokens["access_token"].split("_")[1])
    child, plaintext = token_create(
        actor=Principal(PrincipalKind.TOKEN, user=token.user, token=token),
        organization=world.org,
        name="child",
        scopes=["projects:read"],
    )
    assert child.audience == "mcp"
    threads = f"/api/v1/orgs/{world.org.slug}/projects/{world.project.public_id}/threads"
    assert client.get(threads, headers=bearer(plaintext)).status_code == 401
    assert mcp_initialize(client, world.project, plaintext).status_code == 200


def test_a_viewer_gets_a_read_only_token(live_server, world):
    _client, _client_id, tokens = connect(live_server, world, person="viewer")
    assert tokens["scope"] == "projects:read"
    token = ApiToken.objects.get(key_id=tokens["access_token"].split("_")[1])
    assert token.scopes == ["projects:read"]


def test_denying_sends_the_client_access_denied_and_no_code(live_server, world):
    client = http(live_server.url)
    client_id = register(client)
    path = authorize_path(client_id, live_server.url + mcp_path(world.project), Pkce.make())
    answer = consent(browser(live_server.url, world["member"].user), path, decision="deny")
    assert redirect_params(answer)["error"] == "access_denied"
    assert not AuthorizationCode.objects.exists()


def test_wrong_verifier_is_refused_and_burns_the_code(live_server, world):
    client = http(live_server.url)
    client_id = register(client)
    pkce = Pkce.make()
    path = authorize_path(client_id, live_server.url + mcp_path(world.project), pkce)
    code = redirect_params(consent(browser(live_server.url, world["member"].user), path))["code"]
    wrong = exchange(client, client_id, code, Pkce.make().verifier)
    assert wrong.status_code == 400 and wrong.json()["error"] == "invalid_grant"
    # One attempt per code: the right verifier no longer helps.
    assert exchange(client, client_id, code, pkce.verifier).status_code == 400
    assert not ApiToken.objects.filter(name__startswith="OAuth:").exists()


@pytest.mark.parametrize("method", ["plain", None])
def test_plain_or_missing_pkce_method_is_refused(live_server, world, method):
    client = http(live_server.url)
    client_id = register(client)
    path = authorize_path(
        client_id, live_server.url + mcp_path(world.project), Pkce.make(), method=method
    )
    answer = browser(live_server.url, world["member"].user).get(path)
    params = redirect_params(answer)
    assert params["error"] == "invalid_request" and "S256" in params["error_description"]


@pytest.mark.parametrize("challenge", ["x" * 200, "short", "a" * 42 + "="])
def test_a_challenge_that_is_no_s256_digest_is_refused(live_server, world, challenge):
    client = http(live_server.url)
    client_id = register(client)
    pkce = Pkce(verifier="unused", challenge=challenge)
    path = authorize_path(client_id, live_server.url + mcp_path(world.project), pkce)
    answer = browser(live_server.url, world["member"].user).get(path)
    params = redirect_params(answer)
    assert params["error"] == "invalid_request" and "43 characters" in params["error_description"]
    assert not AuthorizationCode.objects.exists()


def test_no_pkce_at_all_is_refused(live_server, world):
    client = http(live_server.url)
    client_id = register(client)
    path = authorize_path(client_id, live_server.url + mcp_path(world.project), None)
    answer = browser(live_server.url, world["member"].user).get(path)
    assert redirect_params(answer)["error"] == "invalid_request"


@pytest.mark.spec("API-2")
@pytest.mark.parametrize(
    "grant",
    [
        {"grant_type": "password", "password": PASSWORD},
        {"grant_type": "password", "password": "not the password"},
        {"grant_type": "client_credentials"},
        {"grant_type": "urn:ietf:params:oauth:grant-type:device_code", "device_code": "x"},
    ],
)
def test_only_the_code_and_refresh_grants_exist(live_server, world, grant):
    # A password grant is refused before any password is checked: the answer is the same for
    # the right one and a wrong one, and no sign-in attempt is counted. Otherwise the token
    # endpoint would tell anyone whether a password is right, past the console's lockout.
    client = http(live_server.url)
    client_id = register(client)
    data = {"client_id": client_id, "username": world["member"].user.email, **grant}
    response = client.post("/oauth/token", data=data)
    assert response.status_code == 400, response.text
    assert response.json()["error"] == "unsupported_grant_type"
    assert not AccessAttempt.objects.exists()
    assert not ApiToken.objects.filter(name__startswith="OAuth:").exists()


def test_an_unregistered_redirect_uri_gets_an_error_page_not_a_redirect(live_server, world):
    client = http(live_server.url)
    client_id = register(client)
    path = authorize_path(
        client_id,
        live_server.url + mcp_path(world.project),
        Pkce.make(),
        redirect_uri="https://attacker.example/callback",
    )
    answer = browser(live_server.url, world["member"].user).get(path)
    assert answer.status_code == 400
    assert "attacker.example" not in answer.headers.get("location", "")


def test_the_code_is_bound_to_its_redirect_uri(live_server, world):
    client = http(live_server.url)
    second = "http://localhost:9999/other"
    client_id = register(client, redirect_uris=[REDIRECT_URI, second])
    pkce = Pkce.make()
    path = authorize_path(client_id, live_server.url + mcp_path(world.project), pkce)
    code = redirect_params(consent(browser(live_server.url, world["member"].user), path))["code"]
    mismatch = exchange(client, client_id, code, pkce.verifier, redirect_uri=second)
    assert mismatch.status_code == 400


def test_a_reused_code_is_refused_and_revokes_what_it_gave(live_server, world):
    client = http(live_server.url)
    client_id = register(client)
    pkce = Pkce.make()
    path = authorize_path(client_id, live_server.url + mcp_path(world.project), pkce)
    code = redirect_params(consent(browser(live_server.url, world["member"].user), path))["code"]
    first = exchange(client, client_id, code, pkce.verifier)
    assert first.status_code == 200
    access = first.json()["access_token"]
    second = exchange(client, client_id, code, pkce.verifier)
    assert second.status_code == 400 and second.json()["error"] == "invalid_grant"
    assert mcp_initialize(client, world.project, access).status_code == 401


def test_codes_are_deleted_a_day_past_expiry_and_the_grant_keeps_its_tokens(live_server, world):
    client, _client_id, tokens = connect(live_server, world)
    code = AuthorizationCode.objects.get()
    grant = OAuthGrant.objects.get()
    authorization_codes_trim(now=code.expires_at + timedelta(hours=23))
    assert AuthorizationCode.objects.filter(pk=code.pk).exists()  # a replay still revokes
    retention()  # the control.retention task, as beat runs it
    assert AuthorizationCode.objects.filter(pk=code.pk).exists()  # not a day past expiry yet
    authorization_codes_trim(now=code.expires_at + timedelta(days=1, minutes=1))
    assert not AuthorizationCode.objects.exists()
    assert OAuthGrant.objects.filter(pk=grant.pk, revoked_at=None).exists()
    assert mcp_initialize(client, world.project, tokens["access_token"]).status_code == 200


def test_another_clients_code_is_refused(live_server, world):
    client = http(live_server.url)
    client_id = register(client)
    other_id = register(client)
    pkce = Pkce.make()
    path = authorize_path(client_id, live_server.url + mcp_path(world.project), pkce)
    code = redirect_params(consent(browser(live_server.url, world["member"].user), path))["code"]
    assert exchange(client, other_id, code, pkce.verifier).status_code == 400


@pytest.mark.spec("API-6")
def test_a_token_for_another_resource_than_the_consented_one_is_refused(live_server, world):
    # RFC 8707: the token is the consented Project's, so asking for another resource at the
    # token endpoint is invalid_target, not a token for a resource the client did not ask for.
    client = http(live_server.url)
    client_id = register(client)
    pkce = Pkce.make()
    other = live_server.url + mcp_path(world.other_project)
    path = authorize_path(client_id, live_server.url + mcp_path(world.project), pkce)
    code = redirect_params(consent(browser(live_server.url, world["member"].user), path))["code"]
    answer = exchange(client, client_id, code, pkce.verifier, resource=other)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"] == "invalid_target"
    assert not OAuthGrant.objects.exists()
    # A refresh is held to the consent's resource the same way, and the grant goes on.
    _client, client_id, tokens = connect(live_server, world)
    data = {
        "grant_type": "refresh_token",
        "refresh_token": tokens["refresh_token"],
        "client_id": client_id,
        "resource": other,
    }
    answer = client.post("/oauth/token", data=data)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"] == "invalid_target"
    assert refresh(client, client_id, tokens["refresh_token"]).status_code == 200


@pytest.mark.parametrize(
    "resource",
    [
        "foreign",  # another organization's Project
        "hidden",  # a Project of the organization this member is not granted
        "elsewhere",  # another server's URL
        "not-mcp",  # a Kestrel URL that is not an MCP endpoint
    ],
)
def test_a_resource_the_person_cannot_see_is_an_error_page(live_server, world, resource):
    person = "limited" if resource == "hidden" else "member"
    url = {
        "foreign": live_server.url + mcp_path(world.foreign_project),
        "hidden": live_server.url + mcp_path(world.project),
        "elsewhere": "https://evil.example" + mcp_path(world.project),
        "not-mcp": live_server.url + f"/api/v1/orgs/{world.org.slug}/projects",
    }[resource]
    client = http(live_server.url)
    client_id = register(client)
    answer = browser(live_server.url, world[person].user).get(
        authorize_path(client_id, url, Pkce.make())
    )
    assert answer.status_code == 404
    assert "not the MCP endpoint of a Project you can see" in answer.text
    assert world.foreign_project.name not in answer.text
    assert not AuthorizationCode.objects.exists()


def test_the_consent_form_needs_its_csrf_token(live_server, world):
    client = http(live_server.url)
    client_id = register(client)
    path = authorize_path(client_id, live_server.url + mcp_path(world.project), Pkce.make())
    forged = browser(live_server.url, world["member"].user).post(path, data={"decision": "allow"})
    assert forged.status_code == 403
    assert not AuthorizationCode.objects.exists()


def test_revoking_the_token_on_the_tokens_page_ends_the_grant(live_server, world):
    client, client_id, tokens = connect(live_server, world)
    token = ApiToken.objects.get(key_id=tokens["access_token"].split("_")[1])
    token_revoke(actor=Principal(PrincipalKind.SESSION, user=world["member"].user), token=token)
    assert mcp_initialize(client, world.project, tokens["access_token"]).status_code == 401
    # The refresh token does not bring it back.
    refreshed = refresh(client, client_id, tokens["refresh_token"])
    assert refreshed.status_code == 400 and refreshed.json()["error"] == "invalid_grant"
    assert OAuthGrant.objects.get().revoked_at is not None


def test_a_person_removed_from_the_project_cannot_refresh(live_server, world):
    limited = world["limited"]
    assign_perm("tenancy.view_project", limited.user, world.project)
    client, client_id, tokens = connect(live_server, world, person="limited")
    remove_perm("tenancy.view_project", limited.user, world.project)
    assert mcp_initialize(client, world.project, tokens["access_token"]).status_code == 404
    refreshed = refresh(client, client_id, tokens["refresh_token"])
    assert refreshed.status_code == 400 and refreshed.json()["error"] == "invalid_grant"


@pytest.mark.spec("API-1")
def test_a_replayed_refresh_token_ends_the_grant(live_server, world):
    client, client_id, tokens = connect(live_server, world)
    rotated = refresh(client, client_id, tokens["refresh_token"])
    assert rotated.status_code == 200
    # The old refresh token again: someone holds a copy, so the whole grant ends.
    replay = refresh(client, client_id, tokens["refresh_token"])
    assert replay.status_code == 400 and replay.json()["error"] == "invalid_grant"
    assert mcp_initialize(client, world.project, rotated.json()["access_token"]).status_code == 401
    assert refresh(client, client_id, rotated.json()["refresh_token"]).status_code == 400
    assert OAuthGrant.objects.get().revoked_at is not None
    assert AuditRecord.objects.filter(
        action="oauth.revoke", data__reason="refresh_token_replayed"
    ).exists()


@pytest.mark.spec("API-1")
def test_a_refresh_token_rotated_away_long_ago_still_ends_the_grant(live_server, world):
    # A thief who refreshes twice with a stolen token before the client's next refresh: the
    # client's copy is two rotations old, and presenting it still reveals the theft.
    client, client_id, tokens = connect(live_server, world)
    first = refresh(client, client_id, tokens["refresh_token"])
    second = refresh(client, client_id, first.json()["refresh_token"])
    assert first.status_code == second.status_code == 200
    replay = refresh(client, client_id, tokens["refresh_token"])
    assert replay.status_code == 400 and replay.json()["error"] == "invalid_grant"
    assert mcp_initialize(client, world.project, second.json()["access_token"]).status_code == 401
    assert refresh(client, client_id, second.json()["refresh_token"]).status_code == 400
    assert OAuthGrant.objects.get().revoked_at is not None
    assert AuditRecord.objects.filter(
        action="oauth.revoke", data__reason="refresh_token_replayed"
    ).exists()


def test_a_refresh_token_of_another_client_is_refused(live_server, world):
    client, _client_id, tokens = connect(live_server, world)
    other_id = register(client)
    response = refresh(client, other_id, tokens["refresh_token"])
    assert response.status_code == 400


def test_a_refreshed_token_shares_the_mcp_rate_count_of_the_one_it_replaced(
    live_server, world, settings
):
    """Each refresh mints a new API token; counted per token, a client past its bound could
    refresh and go on. The count is the consenting person's."""
    settings.KESTREL_MCP_RATE = "2/min"
    client, client_id, tokens = connect(live_server, world)
    assert mcp_initialize(client, world.project, tokens["access_token"]).status_code == 200
    rotated = refresh(client, client_id, tokens["refresh_token"])
    assert rotated.status_code == 200, rotated.text
    access = rotated.json()["access_token"]
    assert mcp_initialize(client, world.project, access).status_code == 200
    limited = mcp_initialize(client, world.project, access)
    assert limited.status_code == 429, limited.text
    again = refresh(client, client_id, rotated.json()["refresh_token"])
    assert again.status_code == 200, again.text
    assert mcp_initialize(client, world.project, again.json()["access_token"]).status_code == 429


def test_the_token_and_revocation_endpoints_are_bounded_per_address(live_server, world, settings):
    """Every exchange or refresh writes a token and its audit, and a guessed token costs a
    lookup: one address gets KESTREL_OAUTH_TOKEN_RATE requests to the two endpoints, then 429
    with Retry-After, and nothing is issued past the bound."""
    client, client_id, tokens = connect(live_server, world)
    probe = RequestFactory().post("/oauth/token", REMOTE_ADDR="127.0.0.1")
    caches[django_settings.KESTREL_RATE_CACHE].delete(
        TokenRateThrottle().get_cache_key(probe, None)
    )
    settings.KESTREL_OAUTH_TOKEN_RATE = "3/min"
    rotated = refresh(client, client_id, tokens["refresh_token"])
    assert rotated.status_code == 200, rotated.text
    bogus = client.post("/oauth/revoke", data={"token": "kst_not_a_token", "client_id": client_id})
    assert bogus.status_code == 200, bogus.text
    wrong = refresh(client, client_id, "not-a-refresh-token")
    assert wrong.status_code == 400, wrong.text
    issued = ApiToken.objects.count()

    limited = refresh(client, client_id, rotated.json()["refresh_token"])
    assert limited.status_code == 429, limited.text
    assert limited.json()["error"] == "temporarily_unavailable"
    assert "try again" in limited.json()["error_description"]
    assert 1 <= int(limited.headers["retry-after"]) <= 60
    assert limited.headers["cache-control"] == "no-store"
    revoking = client.post(
        "/oauth/revoke", data={"token": rotated.json()["access_token"], "client_id": client_id}
    )
    assert revoking.status_code == 429
    assert ApiToken.objects.count() == issued
    assert OAuthGrant.objects.get().revoked_at is None
    # Refused, the refresh spent nothing: under a larger bound the same refresh token works.
    settings.KESTREL_OAUTH_TOKEN_RATE = "1000/min"
    assert refresh(client, client_id, rotated.json()["refresh_token"]).status_code == 200


def test_an_mcp_session_outlives_its_clients_token_refresh_and_no_one_else_can_use_it(
    live_server, world
):
    """A client refreshes its token every hour; the token it gets is the same agent (its
    lineage), so the session it opened, with its thread and warm sandboxes, goes on. Another
    client of the same person is another agent: the session id is a 404 to it."""
    client, client_id, tokens = connect(live_server, world)
    opened = mcp_initialize(client, world.project, tokens["access_token"])
    assert opened.status_code == 200, opened.text
    session = opened.headers["mcp-session-id"]
    rotated = refresh(client, client_id, tokens["refresh_token"]).json()
    current = ApiToken.objects.get(oauth_grant__application__client_id=client_id)
    assert current.lineage != current.public_id  # the first token's: the same agent

    def tools_list(token):
        return client.post(
            mcp_path(world.project),
            json={"jsonrpc": "2.0", "id": 2, "method": "tools/list"},
            headers={
                **bearer(token),
                "Accept": ACCEPT,
                "MCP-Protocol-Version": "2025-11-25",
                "Mcp-Session-Id": session,
            },
        )

    answer = tools_list(rotated["access_token"])
    assert answer.status_code == 200, answer.text
    assert answer.json()["result"]["tools"]
    _, _, other = connect(live_server, world)
    assert tools_list(other["access_token"]).status_code == 404
