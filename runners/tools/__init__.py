"""Tool implementations behind the registry: ``execute`` is the one entry point.

``execute`` validates again (a runner trusts no caller with its arguments, RUN-2), then
runs the tool. File tools act on the runner host through ``runners.workspace``; they
never start a process. Process tools (shell.exec, code.python) run only through a sandbox
backend, probed first; there is no other way for them to run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from runners.registry import get_tool, validate_args
from runners.sandbox import ExecLimits, SandboxBackend
from runners.tools import checkpoints, files, processes

__all__ = ["IMPLEMENTATIONS", "execute"]

Implementation = Callable[..., dict[str, Any]]

# One implementation per registry entry; a test keeps the two sets equal.
IMPLEMENTATIONS: Mapping[str, Implementation] = {
    "fs.read": files.read,
    "fs.write": files.write,
    "fs.list": files.list_directory,
    "fs.delete": files.delete,
    "shell.exec": processes.shell_exec,
    "code.python": processes.code_python,
    "workspace.checkpoint": checkpoints.checkpoint,
    "workspace.restore": checkpoints.restore,
}


def execute(
    tool_name: str,
    args: Mapping[str, Any],
    *,
    workspace: Path,
    backend: SandboxBackend | None,
    limits: ExecLimits,
    labels: Mapping[str, str],
) -> dict[str, Any]:
    """Run one tool call and return its typed result.

    Raises a ``runners.errors.RunnerError`` subclass when the call is refused or cannot
    run (unknown tool, invalid arguments, unsafe path, no sandbox...), each with a ``code``.
    ``backend`` may be None only for file tools.
    """
    tool = get_tool(tool_name)
    canonical = validate_args(tool.name, args)
    return IMPLEMENTATIONS[tool.name](
        canonical, workspace=Path(workspace), backend=backend, limits=limits, labels=labels
    )
