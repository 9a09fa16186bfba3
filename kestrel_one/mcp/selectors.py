"""MCP server reads: what is installed, each server's body, its recorded tools and risks.

The API, the console and the runtime inventory read through here, so each surface shows the
same states: a server's ``network`` is what its next container gets (``profiles``), and a
risk acceptance's state is computed from its own row against the server now (an expired one
is ``expired`` from its ``expires_at`` alone, whether or not the sweep has recorded it).
"""

from __future__ import annotations

from django.db.models import CharField, Count, Q, QuerySet, Value
from django.db.models.functions import Concat
from django.utils import timezone

from kestrel_one.mcp.models import McpRiskAcceptance, McpServer, McpTool
from kestrel_one.mcp.profiles import (
    network_of,
    risk_acceptance_covers,
    risk_acceptance_in_force,
)
from runners.contract.mcp import DEFINITION_FIELDS
from runners.contract.registry import TOOLS

__all__ = [
    "PENDING_REVIEW",
    "RISK_ACTIVE",
    "RISK_EXPIRED",
    "RISK_VOID",
    "RISK_WITHDRAWN",
    "inventory_tool_body",
    "inventory_tools_of",
    "mcp_servers_of",
    "registry_inventory",
    "risk_acceptance_body",
    "risk_acceptance_state",
    "risk_acceptances_of",
    "server_body",
    "tool_body",
    "tools_of",
]

RISK_ACTIVE = "active"
RISK_EXPIRED = "expired"
RISK_WITHDRAWN = "withdrawn"
# Made for another image or base profile than the server has now: it no longer applies.
RISK_VOID = "void"
PENDING_REVIEW = (McpTool.State.CHANGED, McpTool.State.NEW)
_LISTED_SERVER_STATES = [s for s in McpServer.State.values if s != McpServer.State.REMOVED]


def mcp_servers_of(organization) -> QuerySet[McpServer]:
    """The organization's installed servers, with what their bodies count."""
    return (
        McpServer.objects.for_org(organization)
        .installed()
        .select_related("environment")
        .annotate(
            tools_enabled=Count("tools", filter=Q(tools__state=McpTool.State.ENABLED)),
            tools_pending=Count("tools", filter=Q(tools__state__in=PENDING_REVIEW)),
        )
    )


def _tool_counts(server: McpServer) -> dict:
    enabled = getattr(server, "tools_enabled", None)
    pending = getattr(server, "tools_pending", None)
    if enabled is None or pending is None:
        enabled = server.tools.filter(state=McpTool.State.ENABLED).count()
        pending = server.tools.filter(state__in=PENDING_REVIEW).count()
    return {"enabled": enabled, "pending_review": pending}


def server_body(server: McpServer, *, now=None) -> dict:
    """The API's view of one server. ``network`` is what a container of it gets now: bridge
    only under a risk acceptance in force; an allowlist shows as ``awaiting_gateway`` (or
    ``void`` when made for another image or profile) and never opens anything (MCP-3)."""
    risk = risk_acceptance_in_force(server, now=now)
    return {
        "id": server.public_id,
        "name": server.name,
        "environment": server.environment.public_id,
        "kind": server.kind,
        "managed": server.managed or None,
        "image": server.reference,
        "image_id": server.image_id or None,
        "command": list(server.command),
        "workspace": server.workspace,
        "limits": dict(server.limits),
        "state": server.state,
        "error": server.error,
        "egress": list(server.egress),
        "network": network_of(server, risk),
        "tools": _tool_counts(server),
        "created_at": server.created_at,
        "discovered_at": server.discovered_at,
    }


def tools_of(server: McpServer) -> QuerySet[McpTool]:
    return server.tools.order_by("name")


def _diff(recorded: dict, pending: dict) -> dict:
    """Each definition field that differs: what was recorded and what the server lists now."""
    return {
        field: {"recorded": recorded.get(field), "pending": pending.get(field)}
        for field in DEFINITION_FIELDS
        if recorded.get(field) != pending.get(field)
    }


def tool_body(tool: McpTool) -> dict:
    """A recorded tool as admins review it. Its description is untrusted text, shown with
    the injection flags its text matches now (``McpTool.flags``), never followed."""
    definition = tool.definition or {}
    pending = None
    if tool.pending_definition is not None:
        pending = {
            "definition": tool.pending_definition,
            "sha256": tool.pending_sha256,
            "flags": tool.pending_flags,
            "unusable_reason": tool.pending_unusable_reason or None,
            "seen_at": tool.pending_seen_at,
            "diff": _diff(definition, tool.pending_definition),
        }
    return {
        "name": tool.name,
        "title": definition.get("title"),
        "description": definition.get("description"),
        "input_schema": tool.input_schema,
        "annotations": tool.annotations,
        "dangerous": tool.dangerous,
        "marked_dangerous": tool.marked_dangerous,
        "state": tool.state,
        "unusable_reason": tool.unusable_reason or None,
        "flags": tool.flags,
        "definition_sha256": tool.definition_sha256,
        "pending": pending,
    }


def risk_acceptances_of(server: McpServer) -> QuerySet[McpRiskAcceptance]:
    return server.risk_acceptances.select_related("server")


def risk_acceptance_state(acceptance: McpRiskAcceptance, *, now=None) -> str:
    """withdrawn; void once a change ended it (``voided_at``); expired (from ``expires_at``
    alone); void (another image or base profile than the server's now, or the server
    removed); else active."""
    now = now or timezone.now()
    server = acceptance.server
    if acceptance.withdrawn_at is not None:
        return RISK_WITHDRAWN
    if acceptance.voided_at is not None:
        return RISK_VOID
    if acceptance.expires_at <= now:
        return RISK_EXPIRED
    if server.state == McpServer.State.REMOVED or not risk_acceptance_covers(acceptance, server):
        return RISK_VOID
    return RISK_ACTIVE


def risk_acceptance_body(acceptance: McpRiskAcceptance, *, now=None) -> dict:
    return {
        "id": acceptance.public_id,
        "server": acceptance.server.public_id,
        "state": risk_acceptance_state(acceptance, now=now),
        "justification": acceptance.justification,
        "expires_at": acceptance.expires_at,
        "image_id": acceptance.image_id,
        "profile_sha256": acceptance.profile_sha256,
        "accepted_by": acceptance.accepted_by.public_id if acceptance.accepted_by else None,
        "created_at": acceptance.created_at,
        "withdrawn_at": acceptance.withdrawn_at,
        "withdrawn_by": acceptance.withdrawn_by.public_id if acceptance.withdrawn_by else None,
        "voided_at": acceptance.voided_at,
    }


def registry_inventory() -> list[dict]:
    """Every registered tool with the capability it needs (POL-7): a fixed, short list."""
    return [
        {
            "name": spec.name,
            "capability": spec.capability,
            "summary": spec.summary,
            "idempotent": spec.idempotent,
            "tier": spec.tier.value,
        }
        for spec in sorted(TOOLS.values(), key=lambda s: s.name)
    ]


def inventory_tools_of(organization) -> QuerySet[McpTool]:
    """The recorded tools of the organization's installed servers, in cursor pages.

    Many servers times their recorded tools is no bounded list, so the API pages it by
    ``inventory_key``: the server's public id (all of one length) then the tool's name,
    unique and in (server, tool) order, with no row number in a cursor. Pending definitions
    are not read: the inventory shows what is recorded."""
    return (
        McpTool.objects.filter(
            server__organization=organization, server__state__in=_LISTED_SERVER_STATES
        )
        .select_related("server", "server__environment")
        .defer("pending_definition")
        .annotate(
            inventory_key=Concat("server__public_id", Value(":"), "name", output_field=CharField())
        )
    )


def inventory_tool_body(tool: McpTool) -> dict:
    """One recorded tool of the runtime inventory: it needs ``mcp.call``; whether it is
    dangerous comes from the record (POL-8). ``callable`` is what admission checks before
    any policy: the tool enabled on a ready server (one discovering or failed calls nothing,
    whatever its tools' states)."""
    return {
        "tool": "mcp.call",
        "server": tool.server.public_id,
        "server_name": tool.server.name,
        "server_state": tool.server.state,
        "environment": tool.server.environment.public_id,
        "name": tool.name,
        "capability": "mcp.call",
        "dangerous": tool.dangerous,
        "state": tool.state,
        "callable": tool.state == McpTool.State.ENABLED
        and tool.server.state == McpServer.State.READY,
    }
