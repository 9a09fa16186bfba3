"""Helpers for the MCP API tests: install over HTTP, then stand in for a finished discovery.

The discovery itself (a runner starting the server and listing its tools) is tested in
tests/mcp/test_discovery*.py; here a server is moved to ``ready`` with recorded tools
directly in the database, as a successful discovery leaves it.
"""

from __future__ import annotations

from django.utils import timezone

from kestrel_one.accounts.principal import system_principal
from kestrel_one.accounts.services import token_create
from kestrel_one.mcp.models import McpServer, McpTool
from runners.contract.mcp import tool_definition, tool_definition_digest

URL = "/api/v1/orgs/acme/mcp-servers"
DIGEST = "0123456789abcdef" * 4
IMAGE = f"kestrel-test/mcp-custom@sha256:{DIGEST}"


def install(client, world, **fields):
    body = {"name": "notes", "environment": world.environment.public_id, "image": IMAGE}
    body.update(fields)
    body = {key: value for key, value in body.items() if value is not None}
    return client.post(URL, body, format="json")


def installed(client, world, **fields) -> dict:
    response = install(client, world, **fields)
    assert response.status_code == 201, response.content
    return response.json()


def discovered(server_id: str, *tools: dict, image_id: str | None = None) -> McpServer:
    """The server as a successful discovery leaves it: ready, its listed tools recorded."""
    server = McpServer.objects.get(public_id=server_id)
    server.state = McpServer.State.READY
    server.discovered_at = timezone.now()
    if image_id is not None:
        server.image_id = image_id
    server.save()
    for listed in tools:
        McpTool.objects.create(
            server=server,
            name=listed["name"],
            definition=tool_definition(listed),
            definition_sha256=tool_definition_digest(listed),
        )
    return server


def deployer_token(world) -> str:
    """An integration token that may change servers (``mcp:write``) but is no person."""
    _, token = token_create(
        actor=system_principal("tests"),
        organization=world.org,
        name="deployer",
        scopes=["org:read", "mcp:write"],
        integration=True,
    )
    return token


ECHO = {
    "name": "echo",
    "description": "Echo the text back.",
    "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}},
    "annotations": {"readOnlyHint": True},
}
APPEND = {
    "name": "append_note",
    "description": "Append a line to notes.txt.",
    "inputSchema": {"type": "object", "properties": {"line": {"type": "string"}}},
    "annotations": {"destructiveHint": True},
}
