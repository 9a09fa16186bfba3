"""A server's execution profile as the control plane resolves it, and its networking state.

The profile (``runners.contract.mcp.PROFILE_SCHEMA``) is resolved afresh for every call and
discovery, so an expired or withdrawn risk acceptance, or a new image, takes effect on the
next container; it is signed into the call (``mcp.call``'s ``pinned``) and the runner runs
exactly it. Networking is ``bridge`` only under a risk acceptance in force for this image
and base profile (MCP-4); an egress allowlist never changes the network (MCP-3: there is no
trusted egress gateway yet).
"""

from __future__ import annotations

from django.utils import timezone

from kestrel_one.mcp.models import McpRiskAcceptance, McpServer
from runners.contract.mcp import base_profile, profile_digest

__all__ = [
    "EGRESS_AWAITING_GATEWAY",
    "EGRESS_NONE",
    "EGRESS_VOID",
    "base_profile_sha256",
    "egress_status",
    "risk_acceptance_in_force",
    "server_profile",
]

# The egress allowlist's state, as the API shows it (``network.egress``).
EGRESS_NONE = "none"  # no entries authored
EGRESS_AWAITING_GATEWAY = "awaiting_gateway"  # authored for this image and profile; no gateway
EGRESS_VOID = "void"  # authored for another image or profile: re-approve it


def _profile(server: McpServer, risk: McpRiskAcceptance | None) -> dict:
    return {
        "server": server.public_id,
        "reference": server.reference,
        "image": server.image_id,
        "command": list(server.command),
        "workspace": server.workspace,
        "network": "bridge" if risk is not None else "none",
        "risk_acceptance": risk.public_id if risk is not None else None,
        "limits": dict(server.limits),
    }


def base_profile_sha256(server: McpServer) -> str:
    """The digest of the server's profile without networking: what grants bind to."""
    return profile_digest(base_profile(_profile(server, None)))


def risk_acceptance_in_force(server: McpServer, *, now=None) -> McpRiskAcceptance | None:
    """The newest risk acceptance that lets ``server`` have bridge networking now: custom
    servers only, not withdrawn or expired, made for its current image and base profile."""
    if server.kind != McpServer.Kind.CUSTOM or not server.image_id:
        return None
    return (
        McpRiskAcceptance.objects.in_force(now or timezone.now())
        .filter(
            server=server,
            image_id=server.image_id,
            profile_sha256=base_profile_sha256(server),
        )
        .order_by("-created_at")
        .first()
    )


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
