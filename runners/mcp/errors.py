"""The errors of an MCP server call or discovery, each with the stable code the design names.

A ``mcp.call`` that fails reports one of these codes (docs/runners.md, "MCP servers");
``McpToolChanged`` also carries bounded ``details`` (the definitions the server lists now),
which the control plane records as the tool's pending definition for an admin's review.
"""

from __future__ import annotations

from typing import Any

from runners.contract.canonical import canonical_json
from runners.contract.errors import RunnerError
from runners.contract.mcp import MAX_SCHEMA_BYTES, tool_definition, tool_definition_digest

__all__ = [
    "DETAILS_MAX_BYTES",
    "McpError",
    "McpImageMismatch",
    "McpImageMissing",
    "McpListTooLong",
    "McpProtocolError",
    "McpStartFailed",
    "McpStdoutRefused",
    "McpTimeout",
    "McpToolChanged",
    "McpUnavailable",
]

# A changed tool's report: each observed definition at most MAX_SCHEMA_BYTES, all of them
# at most this (runners.contract.tokens checks the same bound on the report).
DETAILS_MAX_BYTES = 64 * 1024


class McpError(RunnerError):
    """An MCP server could not be started, spoken to or called."""

    code = "mcp_error"
    details: dict[str, Any] | None = None


class McpUnavailable(McpError):
    code = "mcp_unavailable"


class McpImageMissing(McpError):
    code = "mcp_image_missing"


class McpImageMismatch(McpError):
    code = "mcp_image_mismatch"


class McpStartFailed(McpError):
    code = "mcp_start_failed"


class McpProtocolError(McpError):
    code = "mcp_protocol_error"


class McpListTooLong(McpProtocolError):
    """The server lists more than the bounds (tools, pages or bytes): not a server that
    stopped answering, so another server of the same image would list the same."""


class McpStdoutRefused(McpProtocolError):
    """The server wrote what its session cannot take on its stdout (a line past the bound,
    bytes that are not UTF-8: runners/mcp/line_bound.py), which ended the session: not a
    server that stopped answering, so another server of the same image would do the same."""


class McpTimeout(McpError):
    code = "mcp_timeout"


class McpToolChanged(McpError):
    """The server's definition of the called tool is not the recorded one (or it is gone).

    ``details``: ``{"server": "mcp_...", "tools": {name: definition | null}}``, null for a
    tool no longer listed. A definition larger than MAX_SCHEMA_BYTES (or one that would take
    the details past DETAILS_MAX_BYTES) is given as ``{"name", "sha256", "oversized": true}``:
    the tool stays disabled, and the admin sees its digest rather than its text.
    """

    code = "mcp_tool_changed"

    def __init__(self, server: str, observed: dict[str, dict[str, Any] | None]) -> None:
        names = ", ".join(sorted(observed))
        super().__init__(
            f"the server's definition of {names} differs from the recorded one; the call "
            "was not made (an admin must review the change)"
        )
        tools: dict[str, dict[str, Any] | None] = {}
        used = 0
        for name in sorted(observed):
            listed = observed[name]
            if listed is None:
                tools[name] = None
                continue
            definition = tool_definition(listed)
            size = len(canonical_json(definition))
            if size > MAX_SCHEMA_BYTES or used + size > DETAILS_MAX_BYTES - 4096:
                definition = {
                    "name": name,
                    "sha256": tool_definition_digest(listed),
                    "oversized": True,
                }
                size = len(canonical_json(definition))
            used += size
            tools[name] = definition
        self.details = {"server": server, "tools": tools}

    @classmethod
    def relayed(cls, message: str, details: dict[str, Any]) -> McpToolChanged:
        """The error a server's relay met (its details were bounded there, by this class)."""
        error = cls.__new__(cls)
        McpError.__init__(error, message)
        error.details = details
        return error


ERRORS_BY_CODE: dict[str, type[McpError]] = {
    cls.code: cls
    for cls in (
        McpUnavailable,
        McpImageMissing,
        McpImageMismatch,
        McpStartFailed,
        McpProtocolError,
        McpTimeout,
    )
}
