"""The MCP servers' wire contract: the pinned server profile, tool definition digests, bounds.

An installed MCP server (docs/mcp.md) runs from a *profile*: everything that shapes its
container (the image id, its command, the workspace mount, the network, the limits). The
control plane resolves it and signs it into each ``mcp.call`` command inside the call's
arguments (``pinned``), so the action's argument digest, and any approval of it, bind the
exact image, profile and tool definition; the runner builds the container from the signed
profile and nothing else. Both tiers compute ``profile_digest`` and
``tool_definition_digest`` here, so that what the control plane recorded at install is what
the runner checks before each call (a server whose tool changed is refused, MCP "rug pull").
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from runners.contract.canonical import digest

__all__ = [
    "DEFAULT_LIMITS",
    "DEFINITION_FIELDS",
    "IMAGE_ID",
    "MANAGED_SERVERS",
    "MAX_DESCRIPTION_CHARS",
    "MAX_OUTPUT_CHARS",
    "MAX_SCHEMA_BYTES",
    "MAX_TOOLS",
    "NETWORKS",
    "PINNED_SCHEMA",
    "PROFILE_SCHEMA",
    "SERVER_ID",
    "SERVER_NAME",
    "TOOL_NAME",
    "WORKSPACE_MOUNTS",
    "base_profile",
    "profile_digest",
    "tool_definition",
    "tool_definition_digest",
]

_ULID = "[0-9A-HJKMNP-TV-Z]{26}"
# An installed server's public id (kestrel_one.common.ids, prefix "mcp").
SERVER_ID = re.compile(f"mcp_{_ULID}")
# A server's name in its Environment: what policies name it by (mcp.call ``servers``).
SERVER_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
# A tool's name as policies name it (policies.parse ``_TOOL_OR_OPERATION``). A server tool
# whose name does not fit is recorded as unusable, never renamed.
TOOL_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
# An image id as the engine reports it (the sha256 of the image's configuration).
IMAGE_ID = re.compile(r"sha256:[0-9a-f]{64}")

# How the project's workspace is mounted into the server's container: not at all, read-only
# or writable (the managed filesystem server's), always at /workspace.
WORKSPACE_MOUNTS = ("none", "ro", "rw")
# The server container's network: ``none`` (the default and, without a risk acceptance, the
# only choice) or ``bridge`` (a custom server's unrestricted networking, MCP-4; the Docker
# host and its gateway address stay blocked).
NETWORKS = ("none", "bridge")
# What a bridged server's forwarded traffic never reaches, besides the Docker host's own
# addresses: the link-local range (cloud metadata and container credential endpoints) and the
# metadata services outside it (Alibaba Cloud's). The runner's firewall drops them
# (runners/mcp/network.py); the console names them where an admin accepts the risk.
BRIDGE_BLOCKED_DESTINATIONS = ("169.254.0.0/16", "100.100.100.200")

# Bounds on what a server may tell us: its tool list and each definition (recorded, signed
# into commands, shown to admins), and one call's output as returned to the control plane.
MAX_TOOLS = 256
MAX_DESCRIPTION_CHARS = 16 * 1024
MAX_SCHEMA_BYTES = 64 * 1024
MAX_OUTPUT_CHARS = 256 * 1024

# The fields of a listed tool that make its definition: a change in any of them (a new
# description is how tool poisoning arrives) changes its digest.
DEFINITION_FIELDS = ("name", "title", "description", "inputSchema", "outputSchema", "annotations")

_LIMITS_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "memory_mb": {"type": "integer", "minimum": 32, "maximum": 65536},
        "cpus": {"type": "number", "minimum": 0.01, "maximum": 64},  # the engine's least
        "pids": {"type": "integer", "minimum": 8, "maximum": 4096},
        "tmp_mb": {"type": "integer", "minimum": 1, "maximum": 4096},
    },
    "required": ["memory_mb", "cpus", "pids", "tmp_mb"],
}

# The server profile, as signed: the control plane writes it, the runner runs exactly it.
PROFILE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "server": {"type": "string", "pattern": f"^{SERVER_ID.pattern}$"},
        # What the admin installed (``repo@sha256:...``, or the managed image's name).
        "reference": {"type": "string", "minLength": 1, "maxLength": 512},
        # The image id the container is created from: never a tag.
        "image": {"type": "string", "pattern": f"^{IMAGE_ID.pattern}$"},
        # The server's argv; empty: the image's own entrypoint and command.
        "command": {
            "type": "array",
            "maxItems": 64,
            "items": {
                "type": "string",
                "minLength": 1,
                "maxLength": 4096,
                "pattern": "^[^\\x00]*$",
            },
        },
        "workspace": {"enum": list(WORKSPACE_MOUNTS)},
        "network": {"enum": list(NETWORKS)},
        # The risk acceptance that allows ``bridge`` (null with ``none``), and when it lapses
        # (Unix seconds; only with ``bridge``): the runner stops the container then.
        "risk_acceptance": {"type": ["string", "null"], "pattern": f"^rsk_{_ULID}$"},
        "risk_expires_at": {"type": "integer", "minimum": 0, "maximum": 2**53},
        "limits": _LIMITS_SCHEMA,
    },
    "required": [
        "server",
        "reference",
        "image",
        "command",
        "workspace",
        "network",
        "risk_acceptance",
        "limits",
    ],
    # ``risk_expires_at`` with ``bridge``, and only then; and ``bridge`` only for a custom
    # server, whose reference is pinned by digest (a managed server's is its image's tag and
    # never gets a network, MCP-4): the runner refuses one the control plane should never sign.
    "if": {"properties": {"network": {"const": "bridge"}}},
    "then": {
        "required": ["risk_expires_at"],
        "properties": {"reference": {"pattern": "@sha256:[0-9a-f]{64}$"}},
    },
    "else": {"not": {"required": ["risk_expires_at"]}},
}

# ``mcp.call``'s ``pinned`` argument: set by the control plane when it admits the call (a
# caller's own is refused), so the argument digest covers it.
PINNED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        # The server's name, as the policy names it.
        "name": {"type": "string", "pattern": f"^{SERVER_NAME.pattern}$"},
        "profile": PROFILE_SCHEMA,
        "profile_sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
        # The recorded definition of the tool called; the runner refuses the call when the
        # running server's definition of it differs.
        "tool_sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
        # From the recorded tool (its annotations or an admin's marking), never the caller.
        "dangerous": {"type": "boolean"},
    },
    "required": ["name", "profile", "profile_sha256", "tool_sha256", "dangerous"],
}


# A server's container limits unless its install says otherwise.
DEFAULT_LIMITS: dict[str, int | float] = {"memory_mb": 512, "cpus": 1.0, "pids": 128, "tmp_mb": 64}

# The managed servers: images Kestrel builds locally from packages (deploy/images/mcp-servers),
# each with its fixed command and workspace mount. Never networked (MCP-4).
MANAGED_SERVERS: dict[str, dict[str, Any]] = {
    # @modelcontextprotocol/server-filesystem (npm), confined to the project's workspace.
    "filesystem": {
        "image": "kestrel/mcp-filesystem:latest",
        "command": ["mcp-server-filesystem", "/workspace"],
        "workspace": "rw",
    },
    # mcp-server-git (PyPI) on the project's workspace: its tools name the repository
    # (``repo_path``, /workspace or a folder in it). Not ``--repository /workspace``: the
    # server then refuses to start on a workspace that is not a repository yet.
    "git": {
        "image": "kestrel/mcp-git:latest",
        "command": ["mcp-server-git"],
        "workspace": "rw",
    },
    # mcp-server-time (PyPI): no workspace at all.
    "time": {
        "image": "kestrel/mcp-time:latest",
        "command": ["mcp-server-time", "--local-timezone", "UTC"],
        "workspace": "none",
    },
}


def profile_digest(profile: Mapping[str, Any]) -> str:
    """The digest of a server profile: what an egress grant and a risk acceptance bind to."""
    return digest(dict(profile))


def base_profile(profile: Mapping[str, Any]) -> dict[str, Any]:
    """``profile`` without its networking (network ``none``, no risk acceptance): what an
    egress grant and a risk acceptance are bound to, so that accepting a risk does not void
    the grant it was made beside, while a new image, command, mount or limit voids both."""
    base = {**profile, "network": "none", "risk_acceptance": None}
    base.pop("risk_expires_at", None)
    return base


def tool_definition(listed: Mapping[str, Any]) -> dict[str, Any]:
    """The definition of a tool as a server listed it (its JSON form): ``DEFINITION_FIELDS``
    only, absent or null fields left out, so the same definition always has one form."""
    return {
        name: listed[name]
        for name in DEFINITION_FIELDS
        if name in listed and listed[name] is not None
    }


def tool_definition_digest(listed: Mapping[str, Any]) -> str:
    """sha256 hex of a listed tool's definition (``tool_definition``)."""
    return digest(tool_definition(listed))
