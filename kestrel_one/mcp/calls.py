"""``mcp.call`` in the control plane: its admission, its dispatch re-check, its reports.

Registered on the judging hook (``governance.judging.ToolChecks``) by this app's ``ready``:

- ``mcp_call_admit`` (request time): the server must be installed in the project's
  organization and Environment and ready, the tool recorded and enabled, the arguments
  valid against the tool's recorded input schema; then ``pinned`` is added (the server's
  name, its profile and digest, the tool definition's digest, and whether the tool is
  dangerous), so the argument digest and any approval bind them, and the policy request is
  built from it (POL-8: danger from the record, never from the caller, whose own ``pinned``
  is refused).
- ``mcp_call_dispatch`` (each later signing: an approval, a resend): the pinned profile
  and tool must still be the current ones, else the call ends failed ``mcp_server_changed``
  without being signed.
- ``mcp_call_finished`` (report ingestion): a call the runner refused because the running
  server's definition of a tool differs (``mcp_tool_changed``) records what it observed as
  pending on those tools (disabled until an admin reviews them).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from django.utils import timezone

from kestrel_one.accounts.principal import runner_principal
from kestrel_one.audit.services import audit_record
from kestrel_one.common.errors import ValidationFailed, echo
from kestrel_one.mcp.discovery import tools_observe
from kestrel_one.mcp.models import McpServer, McpTool
from kestrel_one.mcp.profiles import server_profile
from kestrel_one.mcp.schema_check import CHECK_TIMEOUT_SECONDS, SchemaCheckFailed, argument_errors
from runners.contract.mcp import profile_digest

logger = logging.getLogger(__name__)

__all__ = [
    "MCP_SERVER_CHANGED",
    "MCP_TOOL_CHANGED",
    "McpCallInvalid",
    "mcp_call_admit",
    "mcp_call_dispatch",
    "mcp_call_finished",
]

TOOL = "mcp.call"
# The runner's error for a call whose server now defines the tool differently.
MCP_TOOL_CHANGED = "mcp_tool_changed"
# The control plane's, for a queued call whose pinned server or tool is no longer current.
MCP_SERVER_CHANGED = (
    "mcp_server_changed",
    "The server or tool changed since this call was requested; request it again.",
)
# At most this many schema errors are named in one refusal.
MAX_ARGUMENT_ERRORS = 20
# At most this many names are listed in a message (servers, tools).
MAX_LISTED = 30

_TOOL_STATE_REASONS = {
    McpTool.State.CHANGED: "changed since it was recorded: an admin must review it",
    McpTool.State.NEW: "new since the server was installed: an admin must accept it",
    McpTool.State.REMOVED: "no longer listed by the server",
    McpTool.State.UNUSABLE: "recorded as unusable",
}


class McpCallInvalid(ValidationFailed):
    """A refused ``mcp.call``: a stable ``code`` and the field at fault."""

    def __init__(self, code: str, message: str, *, field: str, reason: str | list[str]):
        super().__init__(message, details={field: reason if isinstance(reason, list) else [reason]})
        self.code = code


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:MAX_LISTED])
    more = f" and {len(names) - MAX_LISTED} more" if len(names) > MAX_LISTED else ""
    return (shown + more) if names else "none"


def _server(*, organization, project, server_id: str) -> McpServer:
    server = (
        McpServer.objects.installed()
        .filter(organization=organization, environment=project.environment, public_id=server_id)
        .first()
    )
    if server is None:
        installed = [
            f"{name} ({public_id})"
            for public_id, name in McpServer.objects.installed()
            .filter(organization=organization, environment=project.environment)
            .order_by("name")
            .values_list("public_id", "name")
        ]
        raise McpCallInvalid(
            "unknown_mcp_server",
            f"MCP server {echo(server_id)} is not installed in this project's environment; "
            f"the servers installed there are: {_listed(installed)}.",
            field="args.server",
            reason="not installed in this project's environment",
        )
    if server.state != McpServer.State.READY:
        why = {
            McpServer.State.DISCOVERING: "its tools are being listed; try again shortly",
            McpServer.State.FAILED: "its last discovery failed; an admin must fix it",
        }.get(server.state, server.state)
        raise McpCallInvalid(
            "mcp_server_not_ready",
            f"MCP server {server.name} ({server.public_id}) is {server.state}: {why}.",
            field="args.server",
            reason=f"server is {server.state}",
        )
    return server


def _tool(server: McpServer, name: str) -> McpTool:
    tool = server.tools.filter(name=name).first()
    if tool is None:
        recorded = list(
            server.tools.filter(state=McpTool.State.ENABLED).values_list("name", flat=True)
        )
        raise McpCallInvalid(
            "unknown_mcp_tool",
            f"Tool {echo(name)} is not recorded for MCP server {server.name}: the server's "
            f"recorded tools are: {_listed(recorded)}.",
            field="args.tool",
            reason="not recorded",
        )
    if tool.state != McpTool.State.ENABLED:
        reason = _TOOL_STATE_REASONS.get(tool.state, tool.state)
        raise McpCallInvalid(
            "mcp_tool_disabled",
            f"Tool {tool.name} of MCP server {server.name} is {reason}.",
            field="args.tool",
            reason=reason,
        )
    return tool


def arguments_check(tool: McpTool, arguments: dict[str, Any]) -> None:
    """``arguments`` against the tool's recorded input schema (JSON Schema 2020-12), every
    error at its field (``args.arguments.<field>``), within a time bound (``schema_check``:
    the schema is the server's, and some cost more than any size bound limits). A schema that
    cannot be used (it was checked when recorded; a reference to elsewhere resolves to
    nothing), or a check that takes too long, refuses the call."""
    try:
        errors = argument_errors(tool.input_schema, arguments, limit=MAX_ARGUMENT_ERRORS)
    except SchemaCheckFailed as failed:
        if failed.reason == "timeout":
            logger.warning("checking arguments against the schema of %s timed out", tool)
            raise McpCallInvalid(
                "invalid_mcp_arguments",
                f"Checking these arguments against tool {tool.name}'s recorded input schema "
                f"took longer than {CHECK_TIMEOUT_SECONDS:g} s, so they are refused: send "
                "smaller arguments, or have an admin look at the schema (a pattern that "
                "backtracks, uniqueItems over many objects).",
                field="args.arguments",
                reason="the check took too long",
            ) from None
        logger.warning("recorded schema of %s unusable: %s", tool, failed.detail)
        raise McpCallInvalid(
            "invalid_mcp_arguments",
            f"Tool {tool.name}'s recorded input schema cannot check these arguments "
            f"({failed.detail}); an admin must refresh the server.",
            field="args.arguments",
            reason="the recorded schema cannot be used",
        ) from None
    if not errors:
        return
    details: dict[str, list[str]] = {}
    for field, message in errors:
        details.setdefault(field, []).append(echo(message))
    first = next(iter(details))
    refusal = McpCallInvalid(
        "invalid_mcp_arguments",
        f"{first}: {details[first][0]} (tool {tool.name}'s recorded input schema; GET the "
        "server's tools to read it).",
        field=first,
        reason=details[first],
    )
    refusal.details = details
    raise refusal


def pinned_of(server: McpServer, tool: McpTool) -> dict[str, Any]:
    """What a call of ``tool`` is bound to (``runners.contract.mcp.PINNED_SCHEMA``)."""
    profile = server_profile(server)
    return {
        "name": server.name,
        "profile": profile,
        "profile_sha256": profile_digest(profile),
        "tool_sha256": tool.definition_sha256,
        "dangerous": tool.dangerous,
    }


def mcp_call_admit(*, organization, project, user, token, canonical: dict[str, Any]) -> dict:
    """The checked call with its ``pinned`` added (see the module docstring)."""
    if "pinned" in canonical:
        raise McpCallInvalid(
            "invalid",
            "args.pinned is set by Kestrel (the server's profile and the recorded tool); "
            "leave it out.",
            field="args.pinned",
            reason="is set by Kestrel",
        )
    server = _server(organization=organization, project=project, server_id=canonical["server"])
    tool = _tool(server, canonical["tool"])
    arguments_check(tool, canonical["arguments"])
    return {**canonical, "pinned": pinned_of(server, tool)}


def mcp_call_dispatch(canonical: Mapping[str, Any]) -> tuple[str, str] | None:
    """``MCP_SERVER_CHANGED`` when what the queued call pinned is no longer current: the
    server's profile (a new image, command, mount, limits, or a risk acceptance that
    expired), the tool's definition, its danger, or its being enabled."""
    pinned = canonical.get("pinned")
    if not isinstance(pinned, Mapping):
        return MCP_SERVER_CHANGED
    server = (
        McpServer.objects.filter(public_id=canonical.get("server"), state=McpServer.State.READY)
        .select_related("organization")
        .first()
    )
    if server is None or server.name != pinned.get("name"):
        return MCP_SERVER_CHANGED
    tool = server.tools.filter(name=canonical.get("tool"), state=McpTool.State.ENABLED).first()
    if (
        tool is None
        or tool.definition_sha256 != pinned.get("tool_sha256")
        or tool.dangerous != pinned.get("dangerous")
        or profile_digest(server_profile(server)) != pinned.get("profile_sha256")
    ):
        return MCP_SERVER_CHANGED
    return None


def _observed_tools(error: Mapping[str, Any], server_id: str) -> dict[str, Any] | None:
    details = error.get("details")
    if not isinstance(details, Mapping) or details.get("server") != server_id:
        return None
    tools = details.get("tools")
    if not isinstance(tools, Mapping):
        return None
    return {
        name: listed
        for name, listed in tools.items()
        if isinstance(name, str) and (listed is None or isinstance(listed, Mapping))
    }


def mcp_call_finished(*, action, runner, outcome: str, error) -> None:
    """Record the tool definitions a call refused with ``mcp_tool_changed`` observed, as
    pending on those tools (in the report's transaction: kept exactly when the report is).

    What the runner sent is untrusted: entries that are not a name and a definition (or
    null: no longer listed) are left out, and each definition is bounded and flagged as at
    a discovery (``tools_observe``)."""
    if outcome != "failed" or not isinstance(error, Mapping):
        return
    if error.get("code") != MCP_TOOL_CHANGED:
        return
    server_id = (action.args or {}).get("server")
    observed = _observed_tools(error, server_id)
    if not observed:
        logger.warning("%s: mcp_tool_changed without usable details", action.public_id)
        return
    server = (
        McpServer.objects.select_for_update()
        .filter(public_id=server_id, organization=action.organization)
        .exclude(state=McpServer.State.REMOVED)
        .first()
    )
    if server is None:
        return
    changes = tools_observe(server, observed, now=timezone.now())
    if not changes:
        return
    audit_record(
        organization=action.organization,
        actor=runner_principal(runner.public_id),
        action="mcp.tool.changed",
        target=server,
        data={"action": action.public_id, "tools": changes},
    )
