"""Tenancy and authority through the MCP endpoint: each caller gets exactly what the REST API
would give it (docs/mcp-endpoint.md).

Requests go through Django's test client, with the headers a Streamable HTTP client sends,
against PostgreSQL and Redis. The REST side of each comparison is asked in the same test,
with the same token, so "the same as REST" is what the REST API answers today, never a copy
of it written down here.
"""

from __future__ import annotations

import json
from itertools import count
from urllib.parse import urlsplit

import pytest
from django.urls import resolve
from rest_framework.test import APIClient

from kestrel_one.accounts.principal import Principal, PrincipalKind, system_principal
from kestrel_one.accounts.services import token_create, token_revoke
from kestrel_one.execution.models import Action, Approval, Plan
from kestrel_one.governance.services import surface_policy_publish
from kestrel_one.mcp_endpoint.models import McpSession
from kestrel_one.tenancy.bootstrap import agent_token_create
from runners.contract.registry import TOOLS
from tests.api.routes import BODIES, call, database_fingerprint, fill, org_scoped_routes
from tests.api.test_cross_tenant import foreign_markers

PROTOCOL = "2025-11-25"
ACCEPT = "application/json, text/event-stream"
MISSING_PROJECT = "prj_00000000000000000000000000"
# JSON-RPC error code the endpoint answers a missing scope with (design: -32003).
SCOPE_ERROR = -32003
# Names a client might try in order to give itself a person's authority. None exists.
APPROVE_LIKE = (
    "approve",
    "deny",
    "kestrel.approve",
    "kestrel.deny",
    "kestrel.approve_action",
    "kestrel.accept_plan",
    "kestrel.publish_policy",
    "actions.approve",
    "action.approve",
    "plan.accept",
    "policy.publish",
    "mcp.kestrel.approve",
)
_ids = count(1)


def mcp_url(project_id: str, *, org: str = "acme", query: str = "") -> str:
    return f"/api/v1/orgs/{org}/projects/{project_id}/mcp{query}"


def post(client: APIClient, url: str, message, *, session: str | None = None, **headers):
    """One JSON-RPC message as a Streamable HTTP client sends it."""
    extra = {"HTTP_ACCEPT": ACCEPT, "HTTP_MCP_PROTOCOL_VERSION": PROTOCOL, **headers}
    if session:
        extra["HTTP_MCP_SESSION_ID"] = session
    body = message if isinstance(message, (bytes, str)) else json.dumps(message)
    return client.generic("POST", url, body, content_type="application/json", **extra)


def request(method: str, params: dict | None = None) -> dict:
    return {"jsonrpc": "2.0", "id": next(_ids), "method": method, "params": params or {}}


INITIALIZE = {
    "protocolVersion": PROTOCOL,
    "capabilities": {},
    "clientInfo": {"name": "kestrel-authority-tests", "version": "1"},
}


class Mcp:
    """A session on the endpoint (the 2025-11-25 handshake), as one caller."""

    def __init__(self, client: APIClient, url: str, **headers):
        self.client, self.url, self.headers = client, url, headers
        response = post(client, url, request("initialize", INITIALIZE), **headers)
        assert response.status_code == 200, response.content
        assert "result" in response.json(), response.content
        self.session = response.headers["Mcp-Session-Id"]
        assert self.session.startswith("mcs_")
        done = post(
            client,
            url,
            {"jsonrpc": "2.0", "method": "notifications/initialized"},
            session=self.session,
            **headers,
        )
        assert done.status_code == 202, done.content

    def send(self, method: str, params: dict | None = None) -> dict:
        response = post(
            self.client, self.url, request(method, params), session=self.session, **self.headers
        )
        assert response.status_code == 200, response.content
        return response.json()

    def tools(self) -> set[str]:
        answer = self.send("tools/list")
        assert "result" in answer, answer
        return {tool["name"] for tool in answer["result"]["tools"]}

    def call(self, name: str, arguments: dict) -> dict:
        return self.send("tools/call", {"name": name, "arguments": arguments})


def token_client(plaintext: str, *, address: str = "203.0.113.7") -> APIClient:
    return APIClient(REMOTE_ADDR=address, HTTP_AUTHORIZATION=f"Bearer {plaintext}")


def integration_token(world, **kwargs) -> str:
    _, plaintext = token_create(
        actor=system_principal("tests"),
        organization=world.org,
        name="mcp integration",
        scopes=["org:read", "projects:read", "projects:write"],
        integration=True,
        **kwargs,
    )
    return plaintext


def rest_tools(client: APIClient, world, project=None) -> set[str]:
    """The registry tools the REST API's effective policy grants this caller, and the
    endpoint's own outcome tool: what tools/list must show (no MCP server is installed in
    the world, and no surface policy is published, so surface mcp grants what api grants)."""
    project = project or world.project
    response = client.get(f"/api/v1/orgs/acme/projects/{project.public_id}/effective-policy")
    assert response.status_code == 200, response.content
    granted = set(response.json()["document"]["capabilities"])
    return {
        spec.name
        for spec in TOOLS.values()
        if spec.capability in granted and spec.name != "mcp.call"
    } | {"kestrel.outcome"}


def rest_action(client: APIClient, world, tool: str, args: dict, thread=None):
    thread = thread or world.thread
    url = f"/api/v1/orgs/acme/projects/{world.project.public_id}/threads/{thread.public_id}/actions"
    return client.post(url, {"tool": tool, "args": args}, format="json")


@pytest.fixture(autouse=True)
def _endpoint_settings(settings):
    # Calls that have no runner here would wait for one: answer at once with the state.
    settings.KESTREL_MCP_CALL_WAIT_SECONDS = 0


@pytest.fixture
def single_host(settings):
    settings.SINGLE_HOST = True
    settings.KESTREL_SERVER_TOKEN = ""
    return settings


@pytest.mark.spec("TEN-1", "TEN-4")
def test_another_organizations_token_gets_the_same_404_as_rest(world):
    outsider = world["outsider"].client()
    owner = world["owner"].client()
    url = mcp_url(world.project.public_id)
    sessions = McpSession.objects.count()
    before = database_fingerprint()
    answers = {
        "initialize": post(outsider, url, request("initialize", INITIALIZE)),
        "tools/list": post(outsider, url, request("tools/list")),
        "tools/call": post(
            outsider,
            url,
            request("tools/call", {"name": "fs.read", "arguments": {"path": "README.md"}}),
        ),
        # Acme's project through the outsider's own organization.
        "through globex": post(
            outsider, mcp_url(world.project.public_id, org="globex"), request("tools/list")
        ),
    }
    # What a missing organization and a missing project look like to acme's owner.
    missing = [
        post(owner, mcp_url(MISSING_PROJECT), request("tools/list")),
        post(owner, mcp_url(world.project.public_id, org="no-such-org"), request("tools/list")),
    ]
    rest = outsider.get(f"/api/v1/orgs/acme/projects/{world.project.public_id}")
    assert rest.status_code == 404
    for name, response in {
        **answers,
        "missing project": missing[0],
        "missing org": missing[1],
    }.items():
        assert response.status_code == 404, (name, response.content)
        assert response.content == rest.content, name
        leaked = [m for m in foreign_markers(world) if m in response.content.decode()]
        assert not leaked, (name, leaked)
    assert database_fingerprint() == before
    assert McpSession.objects.count() == sessions


@pytest.mark.spec("TEN-3", "TEN-4")
def test_a_token_restricted_to_other_projects_gets_404(world):
    limited_person = world["limited"].client()
    limited_integration = token_client(integration_token(world, projects=[world.other_project]))
    missing = post(world["owner"].client(), mcp_url(MISSING_PROJECT), request("tools/list"))
    assert missing.status_code == 404
    for name, client in (("limited member", limited_person), ("integration", limited_integration)):
        hidden = post(client, mcp_url(world.project.public_id), request("initialize", INITIALIZE))
        assert hidden.status_code == 404, (name, hidden.content)
        assert hidden.content == missing.content, name
        # The project it was given answers.
        Mcp(client, mcp_url(world.other_project.public_id)).tools()


@pytest.mark.spec("API-1")
def test_tokens_authenticate_exactly_as_for_the_api(world):
    url = mcp_url(world.project.public_id)
    owner = world["owner"].plaintext
    anonymous = APIClient(REMOTE_ADDR="203.0.113.7")
    # Either header carries the token.
    assert Mcp(anonymous, url, HTTP_AUTHORIZATION=f"Bearer {owner}").tools()
    assert Mcp(anonymous, url, HTTP_X_KESTREL_TOKEN=owner).tools()
    # No token, a wrong one, two different ones, another scheme, a revoked one: 401, and the
    # challenge names where OAuth clients find the authorization server.
    member_token = world["member"].token
    member = world["member"].plaintext
    token_revoke(actor=system_principal("tests"), token=member_token)
    for name, headers in (
        ("no token", {}),
        ("wrong token", {"HTTP_AUTHORIZATION": "Bearer kst_not_a_real_token"}),
        ("two tokens", {"HTTP_AUTHORIZATION": f"Bearer {owner}", "HTTP_X_KESTREL_TOKEN": "kst_x"}),
        ("basic", {"HTTP_AUTHORIZATION": "Basic b3duZXI6cGFzcw=="}),
        ("revoked", {"HTTP_AUTHORIZATION": f"Bearer {member}"}),
    ):
        response = post(anonymous, url, request("initialize", INITIALIZE), **headers)
        assert response.status_code == 401, (name, response.content)
        assert response.json()["error"]["code"] in {"not_authenticated", "authentication_failed"}
        challenge = response.headers["WWW-Authenticate"]
        assert challenge.startswith("Bearer "), (name, challenge)
        assert (
            f'resource_metadata="http://testserver/.well-known/oauth-protected-resource{url}"'
            in challenge
        ), (name, challenge)


@pytest.mark.spec("TEN-3")
def test_a_viewer_connects_and_lists_but_a_call_is_refused_as_rest_refuses_it(world):
    viewer = world["viewer"].client()
    session = Mcp(viewer, mcp_url(world.project.public_id))
    # The token's scopes are a term of the effective policy: a viewer may call nothing, so
    # nothing is listed but the outcome tool, which only reads.
    assert session.tools() == rest_tools(viewer, world) == {"kestrel.outcome"}
    actions = Action.objects.count()
    for name, arguments in (
        ("fs.read", {"path": "README.md"}),
        ("shell.exec", {"argv": ["make", "test"]}),
        ("kestrel.outcome", {"action": world.action.public_id}),
    ):
        refused = session.call(name, arguments)
        rest = rest_action(viewer, world, name, arguments) if name != "kestrel.outcome" else None
        if rest is not None:
            assert rest.status_code == 403
        error = refused.get("error")
        if name == "kestrel.outcome":
            # Reading an outcome is a read: the viewer may (projects:read).
            assert "result" in refused, refused
            continue
        assert error is not None, refused
        assert error["code"] == SCOPE_ERROR, error
        # The refusal REST gives, in JSON-RPC's terms: the same missing scope, named.
        assert "needs the 'projects:write' scope" in error["message"], error
        assert "needs the 'projects:write' scope" in rest.json()["error"]["message"]
    assert Action.objects.count() == actions


@pytest.mark.spec("LOCAL-2", "API-3")
def test_the_local_agent_lists_and_calls_but_nothing_it_sends_approves(world, single_host):
    local = APIClient(REMOTE_ADDR="127.0.0.1")
    session = Mcp(local, mcp_url(world.project.public_id))
    listed = session.tools()
    assert listed == rest_tools(local, world)
    assert {"fs.read", "shell.exec", "kestrel.outcome"} <= listed
    assert not listed & set(APPROVE_LIKE)
    assert not [name for name in listed if "approv" in name or "accept" in name]

    called = session.call("shell.exec", {"argv": ["make", "test"]})
    content = called["result"]["structuredContent"]
    assert content["state"] == "awaiting_approval", content
    act = content["action"]
    assert content["approval_url"].endswith(f"/console/acme/actions/{act}")
    # A real console page: the one where a person sees what the approval binds.
    assert resolve(urlsplit(content["approval_url"]).path).url_name == "console_action"
    action = Action.objects.get(public_id=act)
    assert action.surface == "mcp"

    approvals, plans = Approval.objects.count(), Plan.objects.filter(state="accepted").count()
    # Every approve-like name is an unknown tool, whatever it is given.
    for name in APPROVE_LIKE:
        answer = session.call(name, {"action": act, "plan": world.plan.public_id, "approve": True})
        failure = answer.get("error") or {}
        result = answer.get("result") or {}
        assert failure or result.get("isError"), (name, answer)
        text = failure.get("message", "") + json.dumps(result.get("content", []))
        assert "unknown" in text.lower() or "not found" in text.lower(), (name, answer)
    # Nor is there a JSON-RPC method for it.
    for method in ("actions/approve", "approvals/create", "plans/accept", "policies/publish"):
        answer = session.send(method, {"action": act})
        assert answer["error"]["code"] == -32601, (method, answer)
    # The outcome tool reads, and only reads, even when told to approve.
    outcome = session.call("kestrel.outcome", {"action": act, "wait_s": 0})
    assert outcome["result"]["structuredContent"]["state"] == "awaiting_approval"
    told = session.call("kestrel.outcome", {"action": act, "wait_s": 0, "approve": True})
    assert (
        told.get("error")
        or told["result"].get("isError")
        or (told["result"]["structuredContent"]["state"] == "awaiting_approval")
    )
    action.refresh_from_db()
    assert action.state == "awaiting_approval"
    assert Approval.objects.count() == approvals
    assert Plan.objects.filter(state="accepted").count() == plans
    world.plan.refresh_from_db()
    assert world.plan.state == "proposed"


@pytest.mark.spec("LOCAL-2")
def test_every_local_agent_way_in_gets_the_local_agents_powers_only(world, single_host):
    """The printed agent token and the server token reach MCP as the local agent too."""
    printed = agent_token_create(org_slug="acme")
    ways = {
        "printed agent token": (token_client(printed, address="127.0.0.1"), ""),
        "server token": (
            APIClient(REMOTE_ADDR="203.0.113.7", HTTP_X_KESTREL_TOKEN="a-long-server-token-1234"),
            "a-long-server-token-1234",
        ),
    }
    for name, (client, server_token) in ways.items():
        single_host.KESTREL_SERVER_TOKEN = server_token
        session = Mcp(client, mcp_url(world.project.public_id))
        content = session.call("shell.exec", {"argv": ["make", "test"]})["result"][
            "structuredContent"
        ]
        assert content["state"] == "awaiting_approval", (name, content)
        for tool in APPROVE_LIKE:
            answer = session.call(tool, {"action": content["action"]})
            assert answer.get("error") or answer["result"].get("isError"), (name, tool)
        assert Action.objects.get(public_id=content["action"]).state == "awaiting_approval"


@pytest.mark.spec("API-3")
def test_single_host_refuses_a_non_loopback_caller_without_a_token(world, single_host):
    url = mcp_url(world.project.public_id)
    for address in ("203.0.113.7", "10.0.0.2", "::ffff:192.0.2.1"):
        response = post(APIClient(REMOTE_ADDR=address), url, request("initialize", INITIALIZE))
        assert response.status_code == 401, (address, response.content)
        assert response.json()["error"]["code"] == "not_authenticated"
    # A forwarded-for header claiming loopback changes nothing: only the socket's address counts.
    spoofed = post(
        APIClient(REMOTE_ADDR="203.0.113.7", HTTP_X_FORWARDED_FOR="127.0.0.1"),
        url,
        request("initialize", INITIALIZE),
    )
    assert spoofed.status_code == 401
    # With a server token configured, loopback needs a token too.
    single_host.KESTREL_SERVER_TOKEN = "a-long-server-token-1234"
    loopback = post(APIClient(REMOTE_ADDR="127.0.0.1"), url, request("initialize", INITIALIZE))
    assert loopback.status_code == 401


def test_an_integration_token_gets_exactly_what_rest_gives_it(world):
    plaintext = integration_token(world)
    rest = token_client(plaintext)
    session = Mcp(token_client(plaintext), mcp_url(world.project.public_id))
    assert session.tools() == rest_tools(rest, world)
    assert "shell.exec" in session.tools()
    cases = (
        ("fs.read", {"path": "README.md"}),
        ("shell.exec", {"argv": ["make", "test"]}),
        ("fs.write", {"path": "docs/outside.md", "content": "x"}),  # outside fs.write's paths
        ("code.python", {"code": "print(1)"}),
    )
    for tool, arguments in cases:
        through_rest = rest_action(rest, world, tool, arguments)
        through_mcp = session.call(tool, arguments)
        assert through_rest.status_code in {200, 201}, through_rest.content
        if "error" in through_mcp:
            # A call REST takes is never a protocol error here.
            pytest.fail(f"{tool}: {through_mcp['error']}")
        content = through_mcp["result"]["structuredContent"]
        expected = through_rest.json()
        assert content["state"] == expected["state"], (tool, content, expected)
        assert through_mcp["result"].get("isError", False) == (
            expected["state"] in {"denied", "failed"}
        ), (tool, through_mcp)
        by_rest = Action.objects.get(public_id=expected["id"])
        by_mcp = Action.objects.get(public_id=content["action"])
        assert (by_rest.surface, by_mcp.surface) == ("api", "mcp")
        assert by_mcp.requested_by == by_rest.requested_by
        assert by_mcp.requested_by_token_id == by_rest.requested_by_token_id
        # The same decision for the same reasons (no surface policy is published, so the mcp
        # surface grants what the api surface grants).
        assert by_mcp.decision["outcome"] == by_rest.decision["outcome"], tool
        assert by_mcp.decision["reasons"] == by_rest.decision["reasons"], tool
        assert by_mcp.limits == by_rest.limits, tool
    # The session's calls all ran in its one thread (made at the first call).
    threads = set(Action.objects.filter(surface="mcp").values_list("thread__public_id", flat=True))
    assert len(threads) == 1, threads
    # And no more: the token cannot approve through REST, and MCP has nothing that approves.
    awaiting = Action.objects.filter(surface="mcp", state="awaiting_approval").first()
    approve = rest.post(
        f"/api/v1/orgs/acme/projects/{world.project.public_id}/threads/"
        f"{awaiting.thread.public_id}/actions/{awaiting.public_id}/approve",
        {},
        format="json",
    )
    assert approve.status_code == 403
    for name in APPROVE_LIKE:
        answer = session.call(name, {"action": awaiting.public_id})
        assert answer.get("error") or answer["result"].get("isError"), name
    awaiting.refresh_from_db()
    assert awaiting.state == "awaiting_approval"


def test_a_host_not_allowed_is_400_and_a_foreign_origin_403(world, settings):
    """DNS rebinding: a page on another site that resolves its own name to this server."""
    settings.ALLOWED_HOSTS = ["testserver", "kestrel.example.com"]
    settings.KESTREL_MCP_ALLOWED_ORIGINS = ["https://tools.example.com"]
    owner = world["owner"].client()
    url = mcp_url(world.project.public_id)
    sessions = McpSession.objects.count()
    wrong_host = post(owner, url, request("initialize", INITIALIZE), HTTP_HOST="evil.example")
    assert wrong_host.status_code == 400, wrong_host.content
    for origin in ("https://evil.example", "http://testserver.evil.example", "null"):
        foreign = post(owner, url, request("initialize", INITIALIZE), HTTP_ORIGIN=origin)
        assert foreign.status_code == 403, (origin, foreign.content)
        assert foreign.json()["error"]["code"], foreign.content
    assert McpSession.objects.count() == sessions
    # Its own origin, an allowed one, and none at all (not a browser) are served.
    for headers in (
        {"HTTP_ORIGIN": "http://testserver"},
        {"HTTP_ORIGIN": "https://tools.example.com"},
        {},
    ):
        assert Mcp(owner, url, **headers).tools(), headers


def test_an_oversized_body_is_413(world, settings):
    settings.KESTREL_MCP_MAX_REQUEST_BYTES = 4096
    owner = world["owner"].client()
    session = Mcp(owner, mcp_url(world.project.public_id))
    actions = Action.objects.count()
    big = request(
        "tools/call", {"name": "fs.write", "arguments": {"path": "src/a.py", "content": "x" * 5000}}
    )
    response = post(owner, session.url, big, session=session.session)
    assert response.status_code == 413, response.content
    assert response.json()["error"]["code"]
    assert (
        "4096" in response.json()["error"]["message"]
        or "bytes" in response.json()["error"]["message"]
    )
    assert Action.objects.count() == actions


@pytest.mark.spec("API-6")
def test_a_deeply_nested_body_is_a_client_error_not_a_server_error(world):
    owner = world["owner"].client()
    owner.raise_request_exception = False
    nested = '{"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": '
    nested += "[" * 5000 + "]" * 5000 + "}"
    response = post(owner, mcp_url(world.project.public_id), nested)
    assert response.status_code == 400, response.content
    assert "error" in response.json()


def test_the_rate_is_bounded_per_caller(world, settings):
    settings.KESTREL_MCP_RATE = "3/min"
    owner = world["owner"].client()
    url = mcp_url(world.project.public_id)
    answers = [post(owner, url, request("initialize", INITIALIZE)).status_code for _ in range(4)]
    assert answers[:3] == [200, 200, 200], answers
    assert answers[3] == 429
    limited = post(owner, url, request("tools/list"))
    assert limited.status_code == 429
    assert limited.json()["error"]["code"]
    # Per caller: another caller is not limited by the owner's requests.
    assert post(world["member"].client(), url, request("initialize", INITIALIZE)).status_code == 200


def test_the_rate_counts_whoever_holds_the_authority_not_the_token_in_hand(world, settings):
    """A fresh token must not start a fresh count: a person's every token (an OAuth client's
    refreshed ones are minted the same way) shares one, and so does an integration token
    with the tokens it mints. Counted per token, minting or refreshing undid the bound."""
    settings.KESTREL_MCP_RATE = "2/min"
    url = mcp_url(world.project.public_id)
    owner = world["owner"]
    _, second = token_create(
        actor=system_principal("tests"),
        organization=world.org,
        name="owner's second token",
        scopes=sorted(owner.token.scopes),
        user=owner.user,
    )
    answers = [post(owner.client(), url, request("initialize", INITIALIZE)).status_code]
    answers.append(post(token_client(second), url, request("initialize", INITIALIZE)).status_code)
    answers.append(post(token_client(second), url, request("initialize", INITIALIZE)).status_code)
    assert answers == [200, 200, 429], answers

    integration, plaintext = token_create(
        actor=system_principal("tests"),
        organization=world.org,
        name="mcp integration",
        scopes=["org:read", "projects:read", "projects:write", "tokens:admin"],
        integration=True,
    )
    _, minted = token_create(
        actor=Principal(PrincipalKind.TOKEN, token=integration),
        organization=world.org,
        name="minted by the integration",
        scopes=["projects:read"],
        integration=True,
    )
    answers = [post(token_client(plaintext), url, request("initialize", INITIALIZE)).status_code]
    answers += [post(token_client(minted), url, request("initialize", INITIALIZE)).status_code]
    answers += [post(token_client(minted), url, request("initialize", INITIALIZE)).status_code]
    assert answers == [200, 200, 429], answers
    # Another integration token is another caller.
    fresh = token_client(integration_token(world))
    assert post(fresh, url, request("initialize", INITIALIZE)).status_code == 200


@pytest.mark.spec("TEN-1")
def test_the_route_walkers_probe_the_endpoint_with_a_real_request(world):
    """The walkers in tests/api take the endpoint from the URL resolver; their body for it
    must be a request the endpoint really answers, or their 2xx would prove nothing."""
    [route] = [r for r in org_scoped_routes() if r.name == "api:mcp-endpoint"]
    assert set(route.actions) == {"post", "get", "delete"}
    url = fill(route, world, "acme")
    assert url == mcp_url(world.project.public_id)
    for name in ("owner", "member", "viewer"):
        response = call(world[name].client(), "post", url, BODIES[route.name, "post"](world))
        assert response.status_code == 200, (name, response.content)
        names = {tool["name"] for tool in response.json()["result"]["tools"]}
        assert names == rest_tools(world[name].client(), world), name
    # The walker's DELETE names no session; a real one ends, and is then unknown.
    owner = world["owner"].client()
    session = Mcp(owner, url)
    assert call(owner, "delete", url, None).status_code == 404
    ended = owner.delete(url, HTTP_MCP_SESSION_ID=session.session)
    assert ended.status_code == 204
    again = post(owner, url, request("tools/list"), session=session.session)
    assert again.status_code == 404
    # Another caller cannot end it: the same 404 as a session that never was.
    other = Mcp(owner, url)
    assert world["admin"].client().delete(url, HTTP_MCP_SESSION_ID=other.session).status_code == 404
    assert not McpSession.objects.get(public_id=other.session).ended_at


@pytest.mark.spec("POL-2")
def test_the_mcp_surface_policy_narrows_the_endpoint_and_only_the_endpoint(world):
    """An admin keeps MCP clients to reads: the endpoint lists and runs only those, while the
    same token through REST keeps what the api surface allows."""
    owner = Principal(PrincipalKind.TOKEN, user=world["owner"].user, token=world["owner"].token)
    version = surface_policy_publish(
        actor=owner,
        organization=world.org,
        surface="mcp",
        document={"capabilities": {"fs.read": {"paths": ["**"]}}},
    )
    plaintext = integration_token(world)
    session = Mcp(token_client(plaintext), mcp_url(world.project.public_id))
    reads = {spec.name for spec in TOOLS.values() if spec.capability == "fs.read"}
    assert session.tools() == reads | {"kestrel.outcome"}
    # Not listed, and called anyway: a denied action whose reason names the surface policy,
    # as the REST API records a call its policy does not grant.
    refused = session.call("shell.exec", {"argv": ["make", "test"]})["result"]
    assert refused["isError"] is True
    assert refused["structuredContent"]["state"] == "denied"
    assert refused["structuredContent"]["reasons"][0] == (
        f"shell.exec is not granted by the mcp surface policy ({version.public_id})"
    )
    read = session.call("fs.read", {"path": "README.md"})["result"]["structuredContent"]
    label = Action.objects.get(public_id=read["action"]).policy_version
    assert label.endswith(f"+surface:mcp@{version.public_id}"), label
    through_rest = rest_action(token_client(plaintext), world, "shell.exec", {"argv": ["make"]})
    assert through_rest.json()["state"] == "awaiting_approval"
