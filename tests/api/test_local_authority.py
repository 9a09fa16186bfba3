"""Single-host authority (LOCAL-2, POL-5): the local agent never holds a person's power.

The walker takes every organization route and method from the URL resolver. Wherever the
scope it needs is not one the local agent holds, each way a local process can reach the API
without a person's token is refused with a 403 and changes nothing, while the owner's own
token succeeds. A route added later is covered without anyone remembering.
"""

from __future__ import annotations

import pytest
from django.db import transaction
from rest_framework.test import APIClient

from kestrel_one.accounts.scopes import LOCAL_AGENT_SCOPES, SCOPES
from kestrel_one.tenancy.bootstrap import agent_token_create
from kestrel_one.threads.models import Thread
from tests.api.routes import BODIES, call, database_fingerprint, fill, org_scoped_routes

pytestmark = pytest.mark.spec("LOCAL-2", "POL-5")

SERVER_TOKEN = "a-long-random-server-token-for-tests"
# The powers the issue names, by route: the walker must find each among those it refuses.
AUTHORITY = {
    ("api:action-approve", "post"),
    ("api:action-deny", "post"),
    ("api:plan-accept", "post"),
    ("api:environment-policy", "put"),
    ("api:project-policy", "put"),
    ("api:surface-policy", "put"),
    ("api:member-list", "post"),
    ("api:member-detail", "patch"),
    ("api:member-detail", "delete"),
    ("api:token-list", "post"),
    ("api:token-detail", "delete"),
    ("api:runner-detail", "delete"),
    ("api:webhook-list", "post"),
    ("api:webhook-detail", "patch"),
    ("api:webhook-rotate-secret", "post"),
    ("api:retention", "put"),
}


@pytest.fixture
def single_host(settings):
    settings.SINGLE_HOST = True
    settings.KESTREL_SERVER_TOKEN = ""
    return settings


def local_agents(world, settings) -> dict[str, APIClient]:
    """Every way a local process reaches the API without a person's token."""
    agent_token = agent_token_create(org_slug=world.org.slug)
    printed = APIClient(REMOTE_ADDR="127.0.0.1", HTTP_AUTHORIZATION=f"Bearer {agent_token}")
    server = APIClient(REMOTE_ADDR="203.0.113.7", HTTP_X_KESTREL_TOKEN=SERVER_TOKEN)
    return {
        "loopback without a token": APIClient(REMOTE_ADDR="127.0.0.1"),
        "the printed agent token": printed,
        "the server token": server,
    }


def with_server_token(settings, name: str) -> None:
    # Anonymous loopback is the agent only while no server token is configured; with one,
    # every caller must present a token, and the server token is the agent's.
    settings.KESTREL_SERVER_TOKEN = SERVER_TOKEN if name == "the server token" else ""


def test_the_local_agent_holds_exactly_the_agent_scopes(world, single_host):
    assert {"org:read", "projects:read", "projects:write"} == LOCAL_AGENT_SCOPES
    for name, client in local_agents(world, single_host).items():
        with_server_token(single_host, name)
        org = client.get("/api/v1/orgs/acme")
        assert org.status_code == 200, (name, org.content)
        assert org.json()["scopes"] == sorted(LOCAL_AGENT_SCOPES), name
        assert org.json()["role"] is None, f"{name}: the local agent is not the owner"


def test_no_local_agent_can_use_any_power_that_needs_a_person(world, single_host, capsys):
    agents = local_agents(world, single_host)
    owner = APIClient(
        REMOTE_ADDR="127.0.0.1", HTTP_AUTHORIZATION=f"Bearer {world['owner'].plaintext}"
    )
    refused_routes = set()
    probes = 0
    for route in org_scoped_routes():
        for method in route.actions:
            required = route.view_class.scope_map[method.upper()]
            assert required in SCOPES, f"{route.name} {method}: unknown scope {required!r}"
            if required in LOCAL_AGENT_SCOPES:
                continue
            refused_routes.add((route.name, method))
            body = BODIES[(route.name, method)](world) if (route.name, method) in BODIES else None
            url = fill(route, world, "acme")
            for name, client in agents.items():
                with_server_token(single_host, name)
                with transaction.atomic():
                    before = database_fingerprint()
                    response = call(client, method, url, body)
                    after = database_fingerprint()
                    transaction.set_rollback(True)
                where = f"{route.name} {method.upper()} as {name}"
                probes += 1
                assert response.status_code == 403, f"{where}: {response.status_code}"
                assert response.json()["error"]["code"] == "permission_denied", where
                if name != "the printed agent token":  # that one is an integration token
                    assert "local agent" in response.json()["error"]["message"], where
                assert before == after, f"{where}: a refused request changed the database"
            # A person's own token may: the refusal is about who asks, not what is asked.
            single_host.KESTREL_SERVER_TOKEN = ""
            with transaction.atomic():
                response = call(owner, method, url, body)
                transaction.set_rollback(True)
            probes += 1
            assert 200 <= response.status_code < 300, (route.name, method, response.content)
    missing = AUTHORITY - refused_routes
    assert not missing, f"powers the walker did not find among the refused routes: {missing}"
    with capsys.disabled():
        print(f"\nlocal authority walker: {len(refused_routes)} route methods, {probes} probes")


def test_the_local_agent_cannot_mint_even_the_scopes_it_holds(world, single_host):
    for name, client in local_agents(world, single_host).items():
        with_server_token(single_host, name)
        for body in (
            {"name": "mine", "scopes": ["org:read"]},
            {"name": "mine", "scopes": ["org:read"], "integration": True},
            {"name": "approver", "scopes": ["actions:approve"]},
        ):
            response = client.post("/api/v1/orgs/acme/tokens", body, format="json")
            assert response.status_code == 403, (name, body, response.content)


def test_a_token_never_mints_a_scope_it_lacks(world):
    owner = world["owner"].client()
    narrow = owner.post(
        "/api/v1/orgs/acme/tokens",
        {"name": "token maker", "scopes": ["org:read", "tokens:write"]},
        format="json",
    ).json()["token"]
    client = APIClient(REMOTE_ADDR="203.0.113.7", HTTP_AUTHORIZATION=f"Bearer {narrow}")
    for scope in sorted(set(SCOPES) - {"org:read", "tokens:write"}):
        response = client.post(
            "/api/v1/orgs/acme/tokens", {"name": "wider", "scopes": [scope]}, format="json"
        )
        assert response.status_code == 403, (scope, response.content)
        assert scope in response.json()["error"]["message"]
    same = client.post(
        "/api/v1/orgs/acme/tokens", {"name": "same", "scopes": ["org:read"]}, format="json"
    )
    assert same.status_code == 201


def test_each_former_admin_power_is_a_scope_of_its_own(world):
    """An integration given exactly one power can use it and nothing else."""
    owner = world["owner"].client()
    made = owner.post(
        "/api/v1/orgs/acme/tokens",
        {"name": "policy bot", "scopes": ["org:read", "policies:write"], "integration": True},
        format="json",
    )
    assert made.status_code == 201, made.content
    bot = APIClient(REMOTE_ADDR="203.0.113.7", HTTP_AUTHORIZATION=f"Bearer {made.json()['token']}")
    policy = {"capabilities": {"fs.read": {"paths": ["**"]}}}
    published = bot.put(
        f"/api/v1/orgs/acme/projects/{world.project.public_id}/policy", policy, format="json"
    )
    assert published.status_code == 200, published.content
    for path, body in (
        ("/api/v1/orgs/acme/members", {"email": "x@example.com", "role": "viewer"}),
        ("/api/v1/orgs/acme/environments", {"name": "staging"}),
        ("/api/v1/orgs/acme/webhooks", {"url": "https://h.example.com", "event_types": []}),
    ):
        assert bot.post(path, body, format="json").status_code == 403, path


def test_the_local_agent_cannot_accept_a_task_as_a_person(world, single_host):
    """Recording a named check is an integration's job (projects:write); accepting a task
    without one is a person's, and the local agent is not one."""
    url = (
        f"/api/v1/orgs/acme/projects/{world.project.public_id}/threads/"
        f"{world.thread.public_id}/actions/{world.finished_action.public_id}/verifications"
    )
    response = APIClient(REMOTE_ADDR="127.0.0.1").post(
        url, {"accepted": True, "evidence": "looks done"}, format="json"
    )
    assert response.status_code == 403
    assert "local agent" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "proxy_headers",
    [
        {"HTTP_X_FORWARDED_FOR": "203.0.113.7"},
        {"HTTP_FORWARDED": "for=203.0.113.7;proto=https"},
        {"HTTP_X_REAL_IP": "203.0.113.7"},
    ],
)
def test_a_request_a_local_proxy_relayed_is_never_the_local_agent(
    world, single_host, proxy_headers
):
    """Behind a reverse proxy on the same host every client's address is loopback; the
    headers the proxy adds show it relayed someone else, who gets 401 before anything runs."""
    end = (
        f"/api/v1/orgs/acme/projects/{world.project.public_id}/threads/{world.thread.public_id}/end"
    )
    relayed = APIClient(REMOTE_ADDR="127.0.0.1", **proxy_headers)
    refused = relayed.post(end)
    assert refused.status_code == 401, refused.content
    assert "proxy relayed" in refused.json()["error"]["message"]
    assert Thread.objects.get(pk=world.thread.pk).status == "open"
    assert relayed.get("/api/v1/orgs/acme").status_code == 401
    assert APIClient(REMOTE_ADDR="127.0.0.1").get("/api/v1/orgs/acme").status_code == 200


@pytest.mark.parametrize(
    "browser_headers",
    [
        {"HTTP_SEC_FETCH_SITE": "cross-site", "HTTP_ORIGIN": "https://evil.example"},
        # Another port on this machine is another origin, though the same site.
        {"HTTP_SEC_FETCH_SITE": "same-site", "HTTP_ORIGIN": "http://127.0.0.1:3000"},
        {"HTTP_ORIGIN": "null"},  # a sandboxed frame, or an older browser without Sec-Fetch
    ],
)
def test_a_web_page_of_another_origin_is_never_the_local_agent(world, single_host, browser_headers):
    """Any site open in a browser on this machine can send requests to 127.0.0.1, and a POST
    with no body needs no preflight. Without a token, such a request is refused before
    anything runs, while a local process and this server's own pages are the local agent."""
    end = (
        f"/api/v1/orgs/acme/projects/{world.project.public_id}/threads/{world.thread.public_id}/end"
    )
    browser = APIClient(REMOTE_ADDR="127.0.0.1", **browser_headers)
    refused = browser.post(end, data="", content_type="text/plain")
    assert refused.status_code == 401, refused.content
    assert "another origin" in refused.json()["error"]["message"]
    assert Thread.objects.get(pk=world.thread.pk).status == "open"
    assert browser.get("/api/v1/orgs/acme").status_code == 401

    same_origin = APIClient(
        REMOTE_ADDR="127.0.0.1",
        HTTP_HOST="127.0.0.1:8000",
        HTTP_ORIGIN="http://127.0.0.1:8000",
        HTTP_SEC_FETCH_SITE="same-origin",
    )
    assert same_origin.get("/api/v1/orgs/acme").status_code == 200
    local_process = APIClient(REMOTE_ADDR="127.0.0.1")
    assert local_process.get("/api/v1/orgs/acme").status_code == 200
