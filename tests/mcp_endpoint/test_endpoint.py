"""The MCP endpoint's own behaviour through Django's test client: the handshake and
session, tools/list as the governed union, tools/call as an action, kestrel.outcome."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from kestrel_one.accounts.principal import Principal, PrincipalKind, system_principal
from kestrel_one.accounts.services import token_create
from kestrel_one.execution.approvals import approval_decide
from kestrel_one.execution.models import Action
from kestrel_one.governance.services import policy_publish_environment
from kestrel_one.mcp.models import McpServer, McpTool
from kestrel_one.mcp_endpoint.models import McpSession
from kestrel_one.mcp_endpoint.tools import resolve
from runners.contract.mcp import DEFAULT_LIMITS, tool_definition_digest
from tests.conftest import ENVIRONMENT_POLICY

pytestmark = pytest.mark.django_db

ACCEPT = "application/json, text/event-stream"


def endpoint(world, project=None) -> str:
    project = project or world.project
    return f"/api/v1/orgs/{world.org.slug}/projects/{project.public_id}/mcp"


def rpc(client, url, method, params=None, *, session=None, id=1, headers=None, raw=None):
    body = raw if raw is not None else {"jsonrpc": "2.0", "id": id, "method": method}
    if params is not None and raw is None:
        body["params"] = params
    extra = {"HTTP_ACCEPT": ACCEPT, "HTTP_MCP_PROTOCOL_VERSION": "2025-11-25"}
    if session:
        extra["HTTP_MCP_SESSION_ID"] = session
    extra.update(headers or {})
    return client.post(url, data=json.dumps(body), content_type="application/json", **extra)


def initialize(client, url) -> str:
    response = rpc(
        client,
        url,
        "initialize",
        {
            "protocolVersion": "2025-11-25",
            "capabilities": {},
            "clientInfo": {"name": "pytest", "version": "1"},
        },
        headers={"HTTP_MCP_PROTOCOL_VERSION": "2025-11-25"},
    )
    assert response.status_code == 200, response.content
    result = response.json()["result"]
    assert result["serverInfo"]["name"] == "kestrel-one"
    assert "tools" in result["capabilities"]
    return response["Mcp-Session-Id"]


def test_initialize_opens_a_session_of_this_caller(world):
    client = world["member"].client()
    session = initialize(client, endpoint(world))
    row = McpSession.objects.get(public_id=session)
    assert row.project == world.project
    assert row.actor_id == world["member"].token.public_id
    assert row.client_name == "pytest"
    # Another person cannot use it: the same 404 as a session that never was.
    other = rpc(world["admin"].client(), endpoint(world), "tools/list", session=session)
    assert other.status_code == 404


def test_tools_list_is_what_the_policy_grants(world):
    client = world["member"].client()
    session = initialize(client, endpoint(world))
    response = rpc(client, endpoint(world), "tools/list", session=session)
    assert response.status_code == 200, response.content
    names = {tool["name"]: tool for tool in response.json()["result"]["tools"]}
    assert "kestrel.outcome" in names
    assert "shell.exec" in names and "fs.read" in names
    assert names["shell.exec"]["inputSchema"]["type"] == "object"
    # The registry's mcp.call is offered per installed server tool, never as itself.
    assert "mcp.call" not in names


def test_plan_mode_lists_only_read_tools(world):
    client = world["member"].client()
    url = endpoint(world) + "?mode=plan"
    session = initialize(client, url)
    names = {
        t["name"] for t in rpc(client, url, "tools/list", session=session).json()["result"]["tools"]
    }
    assert "fs.read" in names
    assert "shell.exec" not in names and "fs.write" not in names


@pytest.mark.spec("POL-5")
def test_a_call_that_needs_approval_answers_at_once_and_approves_nothing(world, settings):
    settings.KESTREL_MCP_CALL_WAIT_SECONDS = 0
    client = world["member"].client()
    session = initialize(client, endpoint(world))
    response = rpc(
        client,
        endpoint(world),
        "tools/call",
        {"name": "shell.exec", "arguments": {"argv": ["make", "test"]}},
        session=session,
    )
    assert response.status_code == 200, response.content
    result = response.json()["result"]
    structured = result["structuredContent"]
    assert structured["state"] == "awaiting_approval"
    assert structured["approval_url"].endswith(
        f"/console/{world.org.slug}/actions/{structured['action']}"
    )
    assert result["isError"] is False
    action = Action.objects.get(public_id=structured["action"])
    assert action.surface == "mcp"
    assert action.policy_version.endswith("+surface:mcp")
    # The session's thread holds it; a second call reuses the thread.
    again = rpc(
        client,
        endpoint(world),
        "tools/call",
        {"name": "fs.read", "arguments": {"path": "README.md"}},
        session=session,
        id=2,
    ).json()["result"]["structuredContent"]
    assert again["thread"] == structured["thread"]
    # Asking for the outcome reads; it does not approve.
    outcome = rpc(
        client,
        endpoint(world),
        "tools/call",
        {"name": "kestrel.outcome", "arguments": {"action": structured["action"]}},
        session=session,
        id=3,
    ).json()["result"]["structuredContent"]
    assert outcome["state"] == "awaiting_approval"
    action.refresh_from_db()
    assert action.state == "awaiting_approval"


def test_an_unknown_tool_is_refused_and_nothing_is_recorded(world):
    client = world["member"].client()
    session = initialize(client, endpoint(world))
    before = Action.objects.count()
    for name in ("actions.approve", "mcp.call", "shell.exec2"):
        body = rpc(
            client,
            endpoint(world),
            "tools/call",
            {"name": name, "arguments": {}},
            session=session,
        ).json()
        assert body["error"]["code"] == -32602, body
        assert "Unknown tool" in body["error"]["message"]
    assert Action.objects.count() == before


def test_a_viewer_lists_but_cannot_call(world):
    client = world["viewer"].client()
    session = initialize(client, endpoint(world))
    assert rpc(client, endpoint(world), "tools/list", session=session).status_code == 200
    body = rpc(
        client,
        endpoint(world),
        "tools/call",
        {"name": "fs.read", "arguments": {"path": "README.md"}},
        session=session,
    ).json()
    assert body["error"]["code"] == -32003
    assert "projects:write" in body["error"]["message"]


def test_invalid_arguments_come_back_as_a_refused_result(world):
    client = world["member"].client()
    session = initialize(client, endpoint(world))
    result = rpc(
        client,
        endpoint(world),
        "tools/call",
        {"name": "fs.read", "arguments": {"path": "../etc/passwd"}},
        session=session,
    ).json()["result"]
    assert result["isError"] is True
    assert result["structuredContent"]["error"]["code"]


def test_no_token_gets_401_naming_the_resource_metadata(world):
    response = rpc(world["anonymous"].client(), endpoint(world), "tools/list")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "not_authenticated"
    header = response["WWW-Authenticate"]
    assert header.startswith('Bearer resource_metadata="')
    assert f"/.well-known/oauth-protected-resource{endpoint(world)}" in header


def test_get_offers_no_stream_and_delete_ends_the_session(world):
    client = world["member"].client()
    session = initialize(client, endpoint(world))
    response = client.get(endpoint(world), HTTP_ACCEPT="text/event-stream")
    assert response.status_code == 405
    assert response.json()["error"]["code"] == "method_not_allowed"
    assert client.delete(endpoint(world), HTTP_MCP_SESSION_ID=session).status_code == 204
    assert rpc(client, endpoint(world), "tools/list", session=session).status_code == 404


def test_the_stateless_wire_answers_without_a_handshake(world):
    client = world["member"].client()
    response = rpc(
        client,
        endpoint(world),
        "tools/list",
        {
            "_meta": {
                "io.modelcontextprotocol/protocolVersion": "2026-07-28",
                "io.modelcontextprotocol/clientCapabilities": {},
            }
        },
        headers={"HTTP_MCP_PROTOCOL_VERSION": "2026-07-28", "HTTP_MCP_METHOD": "tools/list"},
    )
    assert response.status_code == 200, response.content
    assert "Mcp-Session-Id" not in response
    names = {t["name"] for t in response.json()["result"]["tools"]}
    assert "fs.read" in names


def test_an_idle_session_is_gone(world, settings):
    client = world["member"].client()
    session = initialize(client, endpoint(world))
    McpSession.objects.filter(public_id=session).update(
        last_seen_at=timezone.now()
        - timedelta(seconds=settings.KESTREL_MCP_SESSION_IDLE_SECONDS + 1)
    )
    assert rpc(client, endpoint(world), "tools/list", session=session).status_code == 404
    # A fresh handshake works, and the caller's idle row, of no more use, goes.
    initialize(client, endpoint(world))
    assert not McpSession.objects.filter(public_id=session).exists()


def test_a_caller_keeps_at_most_the_bound_of_sessions_whatever_tokens_it_holds(world, settings):
    """A client that opens a session per connection, or a caller that opens them on purpose
    with token after token, leaves no more rows than KESTREL_MCP_SESSIONS_PER_CALLER: a new
    one pushes out the least recently used, which then answers 404 (its client starts a new
    one). Ended sessions go at once. Another caller's sessions are not touched."""
    settings.KESTREL_MCP_SESSIONS_PER_CALLER = 3
    member = world["member"]
    url = endpoint(world)
    others = [initialize(world["owner"].client(), url) for _ in range(2)]
    tokens = [member.client()]
    for n in range(2):
        _, plaintext = token_create(
            actor=system_principal("tests"),
            organization=world.org,
            name=f"member token {n}",
            scopes=sorted(member.token.scopes),
            user=member.user,
        )
        tokens.append(
            APIClient(REMOTE_ADDR="203.0.113.7", HTTP_AUTHORIZATION=f"Bearer {plaintext}")
        )
    opened = []
    for n in range(5):
        client = tokens[n % 3]
        opened.append((client, initialize(client, url)))
        McpSession.objects.filter(public_id=opened[-1][1]).update(
            last_seen_at=timezone.now() - timedelta(minutes=10 - n)
        )
    mine = McpSession.objects.filter(holder_id=member.user.public_id)
    assert sorted(mine.values_list("public_id", flat=True)) == sorted(s for _, s in opened[2:])
    for client, session in opened[:2]:
        assert rpc(client, url, "tools/list", session=session).status_code == 404
    for client, session in opened[2:]:
        assert rpc(client, url, "tools/list", session=session).status_code == 200
    # An ended session goes at the next handshake, leaving room: nothing else is pushed out.
    client, ended = opened[2]
    assert client.delete(url, HTTP_MCP_SESSION_ID=ended).status_code == 204
    newest = initialize(client, url)
    assert set(mine.values_list("public_id", flat=True)) == {opened[3][1], opened[4][1], newest}
    assert McpSession.objects.filter(public_id__in=others).count() == 2


MODERN = {"HTTP_MCP_PROTOCOL_VERSION": "2026-07-28", "HTTP_MCP_METHOD": "tools/call"}


def modern_call(client, url, name, arguments, *, elicitation: bool, id=1, **extra):
    capabilities = {"elicitation": {"url": {}}} if elicitation else {}
    params = {
        "name": name,
        "arguments": arguments,
        "_meta": {
            "io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": capabilities,
        },
        **extra,
    }
    headers = {**MODERN, "HTTP_MCP_NAME": name}
    response = rpc(client, url, "tools/call", params, id=id, headers=headers)
    assert response.status_code == 200, response.content
    return response.json()["result"]


@pytest.mark.spec("POL-5")
def test_the_stateless_wire_waits_for_a_person_through_input_required(world, settings):
    settings.KESTREL_MCP_CALL_WAIT_SECONDS = 0
    client = world["member"].client()
    url = endpoint(world) + f"?thread={world.thread.public_id}"
    first = modern_call(client, url, "shell.exec", {"argv": ["make"]}, elicitation=True)
    assert first["resultType"] == "input_required"
    request = first["inputRequests"]["approval"]
    assert request["method"] == "elicitation/create"
    assert request["params"]["mode"] == "url"
    action = Action.objects.get(public_id=first["requestState"])
    assert request["params"]["url"].endswith(
        f"/console/{world.org.slug}/actions/{action.public_id}"
    )
    # The client's retry, before anyone decided: still waiting, and nothing was approved.
    accepted = {"approval": {"action": "accept"}}
    again = modern_call(
        client,
        url,
        "shell.exec",
        {"argv": ["make"]},
        elicitation=True,
        id=2,
        requestState=first["requestState"],
        inputResponses=accepted,
    )
    assert again["resultType"] == "input_required"
    assert again["requestState"] == action.public_id
    action.refresh_from_db()
    assert action.state == "awaiting_approval"
    # A person approves in the console; the next retry has the outcome.
    owner = Principal(PrincipalKind.SESSION, user=world["owner"].user)
    approval_decide(actor=owner, action=action, approve=True)
    done = modern_call(
        client,
        url,
        "shell.exec",
        {"argv": ["make"]},
        elicitation=True,
        id=3,
        requestState=first["requestState"],
    )
    assert done.get("resultType", "complete") == "complete"
    assert done["structuredContent"]["action"] == action.public_id
    assert done["structuredContent"]["state"] == "queued"
    assert Action.objects.filter(thread=world.thread, tool="shell.exec").count() == 2


def test_without_url_elicitation_the_stateless_wire_gets_the_pending_result(world):
    client = world["member"].client()
    url = endpoint(world) + f"?thread={world.thread.public_id}"
    result = modern_call(client, url, "shell.exec", {"argv": ["make"]}, elicitation=False)
    assert result["structuredContent"]["state"] == "awaiting_approval"
    assert "approval_url" in result["structuredContent"]


def test_a_request_state_of_another_tool_is_refused(world):
    client = world["member"].client()
    body = rpc(
        client,
        endpoint(world),
        "tools/call",
        {
            "name": "fs.read",
            "arguments": {"path": "README.md"},
            "requestState": world.action.public_id,
            "_meta": {
                "io.modelcontextprotocol/protocolVersion": "2026-07-28",
                "io.modelcontextprotocol/clientCapabilities": {},
            },
        },
        headers={**MODERN, "HTTP_MCP_NAME": "fs.read"},
    ).json()
    assert body["error"]["code"] == -32602


def test_each_adapter_operation_the_policy_allows_is_a_tool_of_its_own(world):
    document = {
        "capabilities": {
            **ENVIRONMENT_POLICY["capabilities"],
            "adapter.invoke": {
                "adapters": {
                    "github": {"operations": ["issues.list"]},
                    "openai": {"operations": ["chat.completions"]},
                }
            },
        }
    }
    policy_publish_environment(
        actor=system_principal("tests"), environment=world.environment, document=document
    )
    client = world["member"].client()
    session = initialize(client, endpoint(world))
    listed = rpc(client, endpoint(world), "tools/list", session=session).json()["result"]
    tools = {tool["name"]: tool for tool in listed["tools"]}
    assert "adapter.github.issues.list" in tools
    # The operation the grant does not name is not offered, nor adapter.invoke itself, nor a
    # model provider's operation (the gateway's: model.invoke), though the grant names it.
    assert "adapter.github.issue_comment.create" not in tools
    assert "adapter.invoke" not in tools
    assert "adapter.openai.chat.completions" not in tools
    schema = tools["adapter.github.issues.list"]["inputSchema"]
    assert schema["required"] == ["args"]
    assert set(schema["properties"]["args"]["required"]) == {"owner", "repo"}
    assert tools["adapter.github.issues.list"]["annotations"]["readOnlyHint"] is True
    # A call is adapter.invoke of exactly that operation, whatever the arguments say.
    result = rpc(
        client,
        endpoint(world),
        "tools/call",
        {
            "name": "adapter.github.issues.list",
            "arguments": {"args": {"owner": "acme", "repo": "rockets"}, "operation": "x"},
        },
        session=session,
    ).json()["result"]
    assert result["isError"] is True
    assert not Action.objects.filter(tool="adapter.invoke").exists()
    target = resolve(world.project, "adapter.github.issues.list")
    assert target.arguments({"args": {}, "adapter": "slack", "operation": "x"}) == {
        "args": {},
        "adapter": "github",
        "operation": "issues.list",
    }
    for unknown in ("adapter.github.nope", "adapter.nope.issues.list", "adapter.invoke"):
        assert resolve(world.project, unknown) is None


def _install_notes(world):
    """Server ``notes`` in the project's environment, with three recorded tools whose own
    annotations say they only read, and a policy that grants all three (two opted in)."""
    server = McpServer.objects.create(
        organization=world.org,
        environment=world.environment,
        name="notes",
        kind=McpServer.Kind.CUSTOM,
        reference="kestrel-test/mcp-custom@sha256:" + "ab" * 32,
        image_id="sha256:" + "ab" * 32,
        limits=dict(DEFAULT_LIMITS),
        state=McpServer.State.READY,
    )
    listed = {
        # The server says it only reads; an admin found otherwise and marked it.
        "lookup": {"readOnlyHint": True, "title": "Harmless lookup"},
        # Read-only and destructive at once: Kestrel holds it dangerous (docs/mcp.md).
        "wipe": {"readOnlyHint": True, "destructiveHint": True},
        "echo": {"readOnlyHint": True},
    }
    for name, hints in listed.items():
        definition = {
            "name": name,
            "description": f"The {name} tool.",
            "inputSchema": {"type": "object"},
            "annotations": hints,
        }
        McpTool.objects.create(
            server=server,
            name=name,
            definition=definition,
            definition_sha256=tool_definition_digest(definition),
            marked_dangerous=name == "lookup",
        )
    document = json.loads(json.dumps(ENVIRONMENT_POLICY))
    document["capabilities"]["mcp.call"] = {
        "servers": {"notes": {"tools": ["echo", "lookup", "wipe"], "dangerous": ["lookup", "wipe"]}}
    }
    policy_publish_environment(
        actor=system_principal("tests"), environment=world.environment, document=document
    )
    return server


@pytest.mark.spec("POL-8", "MCP-5")
def test_a_server_tools_annotations_say_what_kestrel_holds_not_what_the_server_claims(world):
    # A client skips its own confirmation for a tool annotated read-only: tools/list must not
    # relay the server's claim for a tool Kestrel holds dangerous (an admin's marking, or
    # destructiveHint), nor the server's untrusted title as if it were Kestrel's word.
    _install_notes(world)
    client = world["member"].client()
    session = initialize(client, endpoint(world))
    listed = rpc(client, endpoint(world), "tools/list", session=session).json()["result"]
    tools = {tool["name"]: tool for tool in listed["tools"]}
    for name in ("mcp.notes.lookup", "mcp.notes.wipe"):
        assert tools[name]["annotations"]["readOnlyHint"] is False, tools[name]
        assert tools[name]["annotations"]["destructiveHint"] is True, tools[name]
        assert "title" not in tools[name]["annotations"], tools[name]
    assert tools["mcp.notes.echo"]["annotations"]["readOnlyHint"] is True
