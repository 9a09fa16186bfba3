"""Running one tool call on the runner: the context it gets and the one entry point.

``run_verified`` runs a command whose arguments ``verify_command`` already checked (the
runner's one validation); ``execute`` validates first, for callers that hold arguments
nobody checked yet. Process tools run only through a probed sandbox backend
(``runners.sandbox.ConfinedSandbox``); there is no other way for them to run.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runners.contract.registry import get_tool, validate_args
from runners.contract.toolspec import DEFAULT_READ_MAX_FILE_BYTES, McpServers, ToolContext
from runners.sandbox import ConfinedSandbox, ExecLimits, SandboxBackend
from runners.workspace import WorkspaceFull
from runners.write_budget import CallWriteBudget, WriteBudgetExceeded

__all__ = ["execute", "run_verified"]


def run_verified(
    tool_name: str,
    args: dict[str, Any],
    *,
    workspace: Path,
    backend: SandboxBackend | None,
    limits: ExecLimits,
    labels: Mapping[str, str],
    read_max_file_bytes: int = DEFAULT_READ_MAX_FILE_BYTES,
    write_budget_bytes: int = 0,
    adapter_dir: Path | None = None,
    mcp: McpServers | None = None,
    project: str = "",
    thread: str | None = None,
    call_id: str = "",
) -> dict[str, Any]:
    """Run one call whose ``args`` were already validated for ``tool_name``.

    Raises a ``runners.contract.errors.RunnerError`` subclass when the call cannot run
    (unsafe path, no sandbox...), each with a ``code``. ``backend`` may be None only for
    tools that run no process. With ``write_budget_bytes`` the call may grow its workspace,
    which must then be a mounted quota filesystem, by that much at most
    (``runners.write_budget``); one that uses it up fails ``write_budget_exceeded``.
    ``adapter_dir`` is the call's adapter broker directory, mounted into its sandbox
    (``runners.adapter_broker``). ``mcp`` is the runner's MCP servers where its backend
    can run them (Docker), and ``project``/``thread``/``call_id`` the call's scope, which
    ``mcp.call`` picks (and labels) its server by; its time limit is ``limits.timeout_s``.
    """
    tool = get_tool(tool_name)
    workspace = Path(workspace)
    sandbox = ConfinedSandbox(
        backend, workspace=workspace, limits=limits, labels=labels, adapter_dir=adapter_dir
    )
    context = ToolContext(
        workspace=workspace,
        sandbox=sandbox,
        read_max_file_bytes=read_max_file_bytes,
        mcp=mcp,
        project=project,
        thread=thread,
        call_id=call_id,
        timeout_s=limits.timeout_s,
    )
    # A tool the policy lets only read cannot grow the workspace; it needs no budget, and
    # must not be failed for what a concurrent call of the project wrote.
    budget = CallWriteBudget(workspace, 0 if tool.capability == "fs.read" else write_budget_bytes)
    try:
        with budget:
            result = tool.implementation(args, context)
    except WorkspaceFull:
        if budget.bounded:
            raise WriteBudgetExceeded(write_budget_bytes) from None
        raise
    if budget.exceeded:
        raise WriteBudgetExceeded(write_budget_bytes)
    return result


def execute(
    tool_name: str,
    args: Any,
    *,
    workspace: Path,
    backend: SandboxBackend | None,
    limits: ExecLimits,
    labels: Mapping[str, str],
    write_budget_bytes: int = 0,
) -> dict[str, Any]:
    """Validate ``args`` for ``tool_name`` (``UnknownTool``, ``InvalidArguments``), then run."""
    canonical = validate_args(get_tool(tool_name).name, args)
    return run_verified(
        tool_name,
        canonical,
        workspace=workspace,
        backend=backend,
        limits=limits,
        labels=labels,
        write_budget_bytes=write_budget_bytes,
    )
