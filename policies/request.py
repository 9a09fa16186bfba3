"""What one tool call asks of the policy: the capability it needs and the resources it touches.

This is the contract between the tool registry (``runners.contract.registry``), which turns
a tool's validated arguments into a ``Request``, and ``policies.decide``, which judges it.
Keeping it here, in the pure package, lets both sides share it without importing each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True)
class Request:
    """The capability a call requires and the concrete resources it would touch."""

    capability: str
    # Workspace-relative paths the call reads or writes (fs.read, fs.write).
    paths: tuple[str, ...] = ()
    # The program a shell call runs: argv[0] for argv calls, "sh" for scripts.
    command: str | None = None
    # The names of the environment variables a shell call overlays (its ``env``), sorted.
    # Variables change what a program loads and runs (LD_PRELOAD, BASH_ENV, PYTHONPATH), so
    # the policy judges them as it judges the program (shell.exec ``env``).
    env_names: tuple[str, ...] = ()
    # Absolute URL a network call reaches (net.http).
    url: str | None = None
    # mcp.call: server and tool; adapter.invoke: adapter and operation; model.invoke: model.
    mcp_server: str | None = None
    mcp_tool: str | None = None
    adapter: str | None = None
    operation: str | None = None
    model: str | None = None
    # mcp.call: the server's configuration marks this tool dangerous, so the policy must opt
    # in to it by name (SPEC POL-8). Set by the registry from server configuration, never
    # from model or tool output.
    mcp_dangerous: bool = False
    # adapter.invoke: the operation has an external effect (a comment posted, a message
    # sent). It then always needs a person's approval bound to the exact action, whatever
    # the grant's ``approval`` says (SPEC CRED-5). Set by the control plane from its static
    # adapter registry, never from the caller or from model or tool output.
    external_effect: bool = False
    # Resource limits the caller asks for (timeout_s, memory_mb, ...); each must stay at or
    # under the policy's ceiling.
    limits: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
