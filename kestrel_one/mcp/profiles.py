"""A server's execution profile as the control plane resolves it, and its networking state.

The profile (``runners.contract.mcp.PROFILE_SCHEMA``) is resolved afresh for every call and
discovery, so an expired or withdrawn risk acceptance, or a new image, takes effect on the
next container; it is signed into the call (``mcp.call``'s ``pinned``) and the runner runs
exactly it. Networking is ``bridge`` only under a risk acceptance in force for this image
and base profile (MCP-4); an egress allowlist never changes the network (MCP-3: there is no
trusted egress gateway yet).
"""

from __future__ import annotations

import math

from django.utils import timezone

from kestrel_one.mcp.models import McpRiskAcceptance, McpServer
from runners.contract.mcp import base_profile, profile_digest

__all__ = [
    "EGRESS_AWAITING_GATEWAY",
    "EGRESS_NONE",
    "EGRESS_VOID",
    "base_profile_sha256",
    "egress_status",
    "network_of",
    "risk_acceptance_covers",
    "risk_acceptance_in_force",
    "risk_acceptances_in_force",
    "server_profile",
]

# The egress allowlist's state, as the API shows it (``network.egress``).
EGRESS_NONE = "none"  # no entries authored
EGRESS_AWAITING_GATEWAY = "awaiting_gateway"  # authored for this image and profile; no gateway
EGRESS_VOID = "void"  # authored for another image or profile: re-approve it


def _profile(server: McpServer, risk: McpRiskAcceptance | None) -> dict:
    profile = {
        "server": server.public_id,
        "reference": server.reference,
        "image": server.image_id,
        "command": list(server.command),
        "workspace": server.workspace,
        "network": "bridge" if risk is not None else "none",
        "risk_acceptance": risk.public_id if risk is not None else None,
        "limits": dict(server.limits),
    }
    if risk is not None:
        # When the decision lapses, in whole Unix seconds (rounded down: the earlier side). A
        # container started under it stops then on its own, even on a runner that misses
        # the ``mcp.risk.end`` broadcast.
        profile["risk_expires_at"] = math.floor(risk.expires_at.timestamp())
    return profile


def base_profile_sha256(server: McpServer) -> str:
    """The digest of the server's profile without networking: what grants bind to."""
    return profile_digest(base_profile(_profile(server, None)))


def risk_acceptance_covers(acceptance: McpRiskAcceptance, server: McpServer) -> bool:
    """Whether ``acceptance`` was made for what ``server`` runs now: a custom server, its
    current image and base profile (a new image or profile is a new decision)."""
    return (
        server.kind == McpServer.Kind.CUSTOM
        and bool(server.image_id)
        and acceptance.image_id == server.image_id
        and acceptance.profile_sha256 == base_profile_sha256(server)
    )


def risk_acceptances_in_force(servers, *, now=None) -> dict[int, McpRiskAcceptance]:
    """For each of ``servers`` (by primary key) that may have bridge networking now, the
    newest risk acceptance that allows it: not withdrawn or expired, covering the server
    (``risk_acceptance_covers``). One query for all of them."""
    candidates = {
        server.pk: server
        for server in servers
        if server.kind == McpServer.Kind.CUSTOM and server.image_id
    }
    found: dict[int, McpRiskAcceptance] = {}
    if not candidates:
        return found
    for acceptance in (
        McpRiskAcceptance.objects.in_force(now or timezone.now())
        .filter(server__in=list(candidates))
        .order_by("-created_at")
    ):
        server = candidates[acceptance.server_id]
        if acceptance.server_id not in found and risk_acceptance_covers(acceptance, server):
            found[acceptance.server_id] = acceptance
    return found


def risk_acceptance_in_force(server: McpServer, *, now=None) -> McpRiskAcceptance | None:
    """The newest risk acceptance that lets ``server`` have bridge networking now."""
    return risk_acceptances_in_force([server], now=now).get(server.pk)


def network_of(server: McpServer, risk: McpRiskAcceptance | None) -> dict:
    """What a container of ``server`` gets now, as the API's ``network`` says it: bridge only
    under ``risk`` (its acceptance in force), and the egress allowlist's state."""
    return {
        "mode": "bridge" if risk is not None else "none",
        "egress": egress_status(server),
        "risk_acceptance": risk.public_id if risk is not None else None,
    }


def server_profile(server: McpServer, *, now=None) -> dict:
    """The profile a container of ``server`` runs with now."""
    return _profile(server, risk_acceptance_in_force(server, now=now))


def egress_status(server: McpServer) -> str:
    """``none``, ``awaiting_gateway`` or ``void`` (see the constants). Never a network: even
    a valid grant leaves the server network-disabled until a trusted egress gateway exists."""
    if not server.egress:
        return EGRESS_NONE
    if (
        server.image_id
        and server.egress_image_id == server.image_id
        and server.egress_profile_sha256 == base_profile_sha256(server)
    ):
        return EGRESS_AWAITING_GATEWAY
    return EGRESS_VOID
