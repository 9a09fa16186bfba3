"""What a tool is (``ToolSpec``) and what its implementation is given (``ToolContext``).

A tool's module (``runners.tools.*``) defines its ``ToolSpec`` beside its implementation;
both tiers read the spec, only the runner calls the implementation. The context carries
the runner's machinery in as values typed here (``Sandbox``), so a tool module imports
nothing of ``runners.sandbox`` and the web process can load every spec.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

from policies.request import Request

__all__ = [
    "Captures",
    "McpServers",
    "ProcessOutcome",
    "Sandbox",
    "Tier",
    "ToolContext",
    "ToolSpec",
]


class Captures(StrEnum):
    """What the control plane keeps from a tool's succeeded result."""

    # Nothing beyond the action's own result.
    NOTHING = "nothing"
    # The files the call declared as ``outputs`` become artifacts.
    OUTPUTS = "outputs"
    # The result is a workspace archive kept as a checkpoint.
    CHECKPOINT = "checkpoint"


class Tier(StrEnum):
    """Where a tool runs.

    ``runner``: on a runner, from a command the control plane signs. ``control``: in the
    control tier (a Celery queue of its own, ``runners.contract.names.CONTROL_TIER_TASKS``),
    because it needs what a runner must never hold (a provider credential: RUN-7, CRED-2); a
    control-tier tool is never signed to a runner, and a runner refuses one.
    """

    RUNNER = "runner"
    CONTROL = "control"


class ProcessOutcome(Protocol):
    """How a command that ran in the sandbox ended (``runners.sandbox.ExecResult``)."""

    exit_code: int
    stdout: str
    stderr: str
    truncated: bool
    duration_ms: int
    timed_out: bool
    oom_killed: bool
    sandbox: str


class Sandbox(Protocol):
    """Runs one command confined to the call's workspace, with the call's limits."""

    def run(
        self,
        argv: Sequence[str],
        *,
        cwd: str = ".",
        env: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> ProcessOutcome: ...


class McpServers(Protocol):
    """Calls one tool of an installed MCP server (``runners.mcp``): the server started from
    the signed profile in its own container, or the call's thread's warm one with the same
    profile, its tool definition checked against the signed digest first."""

    def call(
        self,
        pinned: Mapping[str, Any],
        tool: str,
        arguments: Mapping[str, Any],
        *,
        project: str,
        thread: str | None,
        call_id: str,
        workspace: Path,
        timeout_s: float,
    ) -> dict[str, Any]: ...


# The largest file fs.read reads and hashes (the content it returns is capped far lower).
DEFAULT_READ_MAX_FILE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class ToolContext:
    """What an implementation works on: the call's workspace and its sandbox, how large a
    file ``fs.read`` takes (the runner's KESTREL_READ_MAX_FILE_BYTES), and the MCP servers
    (``None`` where the sandbox backend cannot run them: only Docker can), with the call's
    scope and time limit that ``mcp.call`` needs to pick and bound its server."""

    workspace: Path
    sandbox: Sandbox
    read_max_file_bytes: int = DEFAULT_READ_MAX_FILE_BYTES
    mcp: McpServers | None = None
    project: str = ""
    thread: str | None = None
    call_id: str = ""
    timeout_s: float = 60.0


Implementation = Callable[[dict[str, Any], ToolContext], dict[str, Any]]


@dataclass(frozen=True)
class ToolSpec:
    """What a tool is: its name, the capability it needs, its argument schema, its code.

    ``idempotent`` says whether running the same arguments twice has the effect of running
    them once; the runner may retry an interrupted call only when it is true.
    ``runs_process`` says the call starts a process, so it runs only in a probed sandbox.
    ``adapter_broker`` says that process is the call's own, run in the call's sandbox, and
    gets the call's adapter broker (``runners.adapter_broker``, CRED-3): its one way to an
    adapter. A process that is not the call's own (mcp.call's server, whose container was
    started for the thread) gets none, so none is opened for it.
    ``captures`` says what the control plane keeps from a succeeded result.
    ``tier`` says where it runs (``Tier``); a control-tier tool's ``implementation`` only
    refuses, its work is the control tier's task.
    ``admitted`` says the control plane must check (and may complete) a call's arguments
    against what only it knows before judging it (mcp.call's installed server and recorded
    tool); like a control-tier tool, such a tool is not callable where those checks are not
    installed.
    """

    name: str
    capability: str
    summary: str
    input_schema: Mapping[str, Any]
    idempotent: bool
    build_request: Callable[[Mapping[str, Any]], Request]
    implementation: Implementation
    runs_process: bool = False
    adapter_broker: bool = False
    captures: Captures = Captures.NOTHING
    tier: Tier = Tier.RUNNER
    admitted: bool = False

    def __post_init__(self) -> None:
        if self.adapter_broker and not self.runs_process:
            raise ValueError(f"{self.name}: only a tool that runs a process gets a broker")

    def needs_checks(self) -> bool:
        """Whether a call needs the control plane's checks for this tool (fail closed)."""
        return self.tier == Tier.CONTROL or self.admitted

    def capability_request(self, args: Mapping[str, Any]) -> Request:
        """The policy request for already validated ``args``."""
        return self.build_request(args)
