"""shell.exec and code.python: commands that only ever run inside a probed sandbox."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runners.sandbox import (
    ExecLimits,
    ExecResult,
    ExecSpec,
    SandboxBackend,
    SandboxUnavailable,
    run_confined,
)
from runners.workspace import Workspace


def shell_exec(
    args: dict[str, Any],
    *,
    workspace: Path,
    backend: SandboxBackend | None,
    limits: ExecLimits,
    labels: Mapping[str, str],
) -> dict[str, Any]:
    # "--" keeps a script that starts with "-" from being read as options to sh.
    argv = tuple(args["argv"]) if "argv" in args else ("sh", "-c", "--", args["script"])
    cwd = args.get("cwd", ".")
    # Checked on the host, link-free, for a clear error; the sandbox confines it anyway.
    Workspace(workspace).check_directory(cwd)
    spec = ExecSpec(
        argv=argv,
        workspace=workspace,
        cwd=cwd,
        env=args.get("env", {}),
        limits=limits.with_timeout(args.get("timeout_s")),
        labels=labels,
    )
    return _result(run_confined(_required(backend), spec))


def code_python(
    args: dict[str, Any],
    *,
    workspace: Path,
    backend: SandboxBackend | None,
    limits: ExecLimits,
    labels: Mapping[str, str],
) -> dict[str, Any]:
    spec = ExecSpec(
        argv=("python3", "-c", args["code"]),
        workspace=workspace,
        limits=limits.with_timeout(args.get("timeout_s")),
        labels=labels,
    )
    return _result(run_confined(_required(backend), spec))


def _required(backend: SandboxBackend | None) -> SandboxBackend:
    if backend is None:
        raise SandboxUnavailable("no sandbox backend was given; commands never run without one")
    return backend


def _result(result: ExecResult) -> dict[str, Any]:
    return {
        "exit_code": result.exit_code,
        "stdout": result.stdout,
        "stderr": result.stderr,
        "truncated": result.truncated,
        "duration_ms": result.duration_ms,
        "timed_out": result.timed_out,
        "oom_killed": result.oom_killed,
        "sandbox": result.sandbox,
    }
