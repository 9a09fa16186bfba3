"""Real MCP clients against a real ``manage.py serve`` with the Docker sandbox: the MCP
Python SDK client (both wires: the 2025-11-25 handshake and the 2026-07-28 stateless one)
and the MCP Inspector's CLI (npm).

Each lists the Project's tools, runs ``shell.exec`` in the sandbox, asks for an ``fs.write``
whose policy says ``"approval": "always"`` and gets the approval-pending result at once, a
person approves it in the console (signed in at /login, the Approve form with its CSRF
token), and ``kestrel.outcome`` then gives the finished result. Every wait is bounded by
attempts, never asserted on time.
"""

from __future__ import annotations

import json
import re
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from mcp import Client, ClientSession, types
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from runners.contract.registry import TOOLS
from tests.mcp_endpoint.serving import (
    Stack,
    console_approve,
    console_sign_in,
    inspector_cli,
    npm_tool,
    stack_start,
)

pytestmark = pytest.mark.docker

SETTLED = {"succeeded", "failed", "denied", "expired", "cancelled"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    npm_tool("mcp-inspector-cli")
    stack = stack_start(
        tmp_path_factory.mktemp("clients-serve"), calls=True, KESTREL_SANDBOX="docker"
    )
    try:
        yield stack
    finally:
        print(stack.serve.stop()[-6000:])


def the_action(stack: Stack, structured: dict) -> dict:
    """The action as the REST API shows it to the owner."""
    path = (
        f"/orgs/local/projects/{stack.project}/threads/{structured['thread']}"
        f"/actions/{structured['action']}"
    )
    return stack.call("GET", path)


def approval_page_shows_the_binding(stack: Stack, structured: dict) -> None:
    """What the person approves is what the action binds: tool and digest on the page."""
    action = the_action(stack, structured)
    assert action["state"] == "awaiting_approval", action
    page = console_sign_in(stack).get(structured["approval_url"], timeout=60)
    assert page.status_code == 200
    assert action["action_digest"] in page.text and "fs.write" in page.text


def check_pending(stack: Stack, structured: dict) -> None:
    assert structured["state"] == "awaiting_approval", structured
    assert re.fullmatch(r"act_\S+", structured["action"]), structured
    assert re.fullmatch(r"thr_\S+", structured["thread"]), structured
    assert structured["approval_url"] == (
        f"{stack.origin}/console/local/actions/{structured['action']}"
    ), structured
    assert structured.get("receipt") is None


# --- the MCP Python SDK client ---------------------------------------------------------


@asynccontextmanager
async def sdk_session(url: str, token: str, *, wire: str):
    headers = {"Authorization": f"Bearer {token}"}
    async with (
        create_mcp_http_client(headers=headers) as http,
        streamable_http_client(url, http_client=http) as (read, write),
        ClientSession(read, write) as session,
    ):
        if wire == "2025-11-25":
            await session.initialize()
        else:
            discovered = await session.discover()  # server/discover, then stateless calls
            assert wire in discovered.supported_versions, discovered
        assert session.protocol_version == wire
        yield session


async def sdk_call(session: ClientSession, tool: str, arguments: dict[str, Any]) -> tuple:
    result = await session.call_tool(tool, arguments)
    text = "".join(getattr(block, "text", "") for block in result.content)
    return result.structured_content, bool(result.is_error), text


async def sdk_settled(session: ClientSession, structured: dict) -> dict:
    """``kestrel.outcome`` until the action has settled (attempts, not a clock)."""
    for _ in range(20):
        if structured["state"] in SETTLED:
            return structured
        structured, _, _ = await sdk_call(
            session, "kestrel.outcome", {"action": structured["action"], "wait_s": 30}
        )
    raise AssertionError(f"the action never settled: {structured}")


def check_listing(tools: list) -> None:
    by_name = {tool.name: tool for tool in tools}
    assert {"shell.exec", "fs.read", "fs.list", "fs.write", "kestrel.outcome"} <= set(by_name)
    assert "code.python" not in by_name  # code.exec is not granted
    assert by_name["shell.exec"].input_schema == TOOLS["shell.exec"].input_schema
    assert by_name["fs.write"].input_schema == TOOLS["fs.write"].input_schema


@pytest.mark.spec("API-1", "SURF-3")
def test_the_python_sdk_client_lists_runs_waits_for_approval_and_gets_the_outcome(stack):
    async def scenario() -> None:
        async with sdk_session(stack.endpoint(), stack.agent, wire="2025-11-25") as session:
            check_listing((await session.list_tools()).tools)

            ran, is_error, text = await sdk_call(
                session, "shell.exec", {"argv": ["sh", "-c", "echo hello from the sandbox"]}
            )
            ran = await sdk_settled(session, ran)
            assert not is_error and ran["state"] == "succeeded", (ran, text)
            assert ran["result"]["stdout"] == "hello from the sandbox\n"
            assert ran["result"]["exit_code"] == 0
            assert ran["result"]["sandbox"].startswith("docker"), ran["result"]
            assert ran["receipt"].startswith("rcp_")
            assert ran["action"] in text

            pending, is_error, text = await sdk_call(
                session, "fs.write", {"path": "notes/decided.txt", "content": "approved"}
            )
            assert not is_error
            check_pending(stack, pending)
            assert pending["thread"] == ran["thread"]  # one thread per MCP session
            assert pending["approval_url"] in text
            approval_page_shows_the_binding(stack, pending)
            # Asking again before anyone decided: still waiting, and nothing approves it.
            again, _, _ = await sdk_call(
                session, "kestrel.outcome", {"action": pending["action"], "wait_s": 0}
            )
            assert again["state"] == "awaiting_approval", again

            await anyio.to_thread.run_sync(console_approve, stack, pending["approval_url"])

            done = await sdk_settled(session, {**pending, "state": "queued"})
            assert done["state"] == "succeeded", done
            assert done["action"] == pending["action"] and done["receipt"].startswith("rcp_")
            # The same session's thread, so the same workspace: the file is there.
            read, _, _ = await sdk_call(session, "fs.read", {"path": "notes/decided.txt"})
            read = await sdk_settled(session, read)
            assert read["state"] == "succeeded" and read["result"]["content"] == "approved", read

    anyio.run(scenario)


@pytest.mark.spec("API-1")
def test_the_python_sdk_client_on_the_stateless_2026_07_28_wire(stack):
    async def scenario() -> None:
        async with sdk_session(stack.endpoint(), stack.agent, wire="2026-07-28") as session:
            check_listing((await session.list_tools()).tools)
            first, is_error, _ = await sdk_call(
                session, "shell.exec", {"argv": ["sh", "-c", "echo stateless"]}
            )
            first = await sdk_settled(session, first)
            assert not is_error and first["state"] == "succeeded", first
            assert first["result"]["stdout"] == "stateless\n"
            pending, _, _ = await sdk_call(
                session, "fs.write", {"path": "notes/stateless.txt", "content": "later"}
            )
            check_pending(stack, pending)
            # No session on this wire: each call has a thread of its own, named in the result.
            assert pending["thread"] != first["thread"]
            await anyio.to_thread.run_sync(console_approve, stack, pending["approval_url"])
            done = await sdk_settled(session, {**pending, "state": "queued"})
            assert done["state"] == "succeeded", done

        # ?thread= puts a call in a thread the client names: the approved file is there.
        url = stack.endpoint(f"thread={pending['thread']}")
        async with sdk_session(url, stack.agent, wire="2026-07-28") as session:
            read, _, _ = await sdk_call(
                session, "shell.exec", {"argv": ["cat", "notes/stateless.txt"]}
            )
            read = await sdk_settled(session, read)
            assert read["thread"] == pending["thread"]
            assert read["state"] == "succeeded" and read["result"]["stdout"] == "later", read

    anyio.run(scenario)


@pytest.mark.spec("API-1", "SURF-3")
def test_the_python_sdk_client_waits_for_the_person_through_input_required(stack):
    """On the 2026-07-28 wire a client that can open a URL is asked (URL elicitation) to
    have the person decide in the console; the SDK's ``Client`` retries the call with the
    echoed state and gets the finished result. The person's approval is the console's: the
    callback only opens the page the server named, as a person would."""
    opened: list[str] = []

    async def person_at_the_console(context, params: types.ElicitRequestParams):
        assert isinstance(params, types.ElicitRequestURLParams), params
        opened.append(params.url)
        await anyio.to_thread.run_sync(console_approve, stack, params.url)
        return types.ElicitResult(action="accept")

    async def scenario() -> None:
        headers = {"Authorization": f"Bearer {stack.agent}"}
        async with create_mcp_http_client(headers=headers) as http:
            transport = streamable_http_client(stack.endpoint(), http_client=http)
            client = Client(
                transport, mode="2026-07-28", elicitation_callback=person_at_the_console
            )
            async with client:
                result = await client.call_tool(
                    "fs.write", {"path": "notes/elicited.txt", "content": "asked"}
                )
        structured = result.structured_content
        assert not result.is_error and structured["state"] == "succeeded", structured
        assert structured["receipt"].startswith("rcp_")
        assert opened == [f"{stack.origin}/console/local/actions/{structured['action']}"]

    anyio.run(scenario)


# --- the MCP Inspector's CLI -----------------------------------------------------------


def inspector(stack: Stack, method: str, *args: str, query: str = "") -> dict:
    """One ``mcp-inspector-cli --cli`` run (a fresh client and session each time); the
    token in ``X-Kestrel-Token``, the API's other header."""
    run = inspector_cli(
        "--cli",
        stack.endpoint(query),
        "--transport",
        "http",
        "--header",
        f"X-Kestrel-Token: {stack.agent}",
        "--method",
        method,
        *args,
    )
    assert run.returncode == 0, (run.stdout[-4000:], run.stderr[-4000:])
    return json.loads(run.stdout)


def inspector_call(stack: Stack, tool: str, query: str = "", **arguments: Any) -> dict:
    pairs = [f"{name}={json.dumps(value)}" for name, value in arguments.items()]
    result = inspector(stack, "tools/call", "--tool-name", tool, "--tool-arg", *pairs, query=query)
    return result


def inspector_settled(stack: Stack, structured: dict) -> dict:
    for _ in range(20):
        if structured["state"] in SETTLED:
            return structured
        structured = inspector_call(
            stack, "kestrel.outcome", action=structured["action"], wait_s=30
        )["structuredContent"]
    raise AssertionError(f"the action never settled: {structured}")


@pytest.mark.spec("API-1", "SURF-3")
def test_the_inspector_cli_lists_runs_waits_for_approval_and_gets_the_outcome(stack):
    listing = inspector(stack, "tools/list")
    by_name = {tool["name"]: tool for tool in listing["tools"]}
    assert {"shell.exec", "fs.write", "kestrel.outcome"} <= set(by_name)
    assert by_name["shell.exec"]["inputSchema"] == TOOLS["shell.exec"].input_schema

    ran = inspector_call(stack, "shell.exec", argv=["sh", "-c", "echo inspected"])
    assert ran.get("isError") in (None, False), ran
    structured = inspector_settled(stack, ran["structuredContent"])
    assert structured["state"] == "succeeded", structured
    assert structured["result"]["stdout"] == "inspected\n"

    pending = inspector_call(stack, "fs.write", path="notes/inspector.txt", content="ok")
    assert pending.get("isError") in (None, False), pending
    check_pending(stack, pending["structuredContent"])
    approval_url = pending["structuredContent"]["approval_url"]
    assert approval_url in "".join(block.get("text", "") for block in pending["content"])
    console_approve(stack, approval_url)
    done = inspector_settled(stack, {**pending["structuredContent"], "state": "queued"})
    assert done["state"] == "succeeded" and done["receipt"].startswith("rcp_"), done

    # A later run names the thread, and finds the approved write in its workspace.
    thread = pending["structuredContent"]["thread"]
    read = inspector_call(
        stack, "shell.exec", query=f"thread={thread}", argv=["cat", "notes/inspector.txt"]
    )
    read = inspector_settled(stack, read["structuredContent"])
    assert read["thread"] == thread and read["result"]["stdout"] == "ok", read
