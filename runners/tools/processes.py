"""shell.exec and code.python: commands that only ever run inside a probed sandbox."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from runners.registry import MAX_OUTPUT_FILE_BYTES, MAX_OUTPUTS_TOTAL_BYTES, declared_outputs
from runners.sandbox import (
    ExecLimits,
    ExecResult,
    ExecSpec,
    SandboxBackend,
    SandboxUnavailable,
    run_confined,
)
from runners.workspace import (
    FileTooLarge,
    PathNotFound,
    PathRefused,
    Workspace,
    WrongFileType,
)

# How a declared output that cannot be returned is reported; stable codes, like errors.
_OUTPUT_ERRORS = (
    (PathNotFound, "not_found"),
    (FileTooLarge, "too_large"),
    (PathRefused, "path_refused"),
    (WrongFileType, "wrong_file_type"),
)


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
    return _result(run_confined(_required(backend), spec), workspace, args)


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
    return _result(run_confined(_required(backend), spec), workspace, args)


def _required(backend: SandboxBackend | None) -> SandboxBackend:
    if backend is None:
        raise SandboxUnavailable("no sandbox backend was given; commands never run without one")
    return backend


def collect_outputs(workspace: Path, paths: Sequence[str]) -> list[dict[str, Any]]:
    """Read each declared output back from the workspace, in the order declared.

    Runs after the command ended, whatever its exit code (a failing build's logs are often
    what one wants), on the host through the link-free workspace API, so a command cannot
    turn an output into a read of anything outside its workspace by leaving a link. Each
    file is returned whole or not at all: past ``MAX_OUTPUT_FILE_BYTES``, or once the files
    before it used up ``MAX_OUTPUTS_TOTAL_BYTES``, it is reported as ``too_large``, since a
    cut file could be mistaken for the real one.
    """
    files = Workspace(workspace)
    collected: list[dict[str, Any]] = []
    remaining = MAX_OUTPUTS_TOTAL_BYTES
    for path in paths:
        try:
            data = files.read_whole(path, max_bytes=min(MAX_OUTPUT_FILE_BYTES, remaining))
        except (PathNotFound, FileTooLarge, PathRefused, WrongFileType) as refused:
            code = next(code for kind, code in _OUTPUT_ERRORS if isinstance(refused, kind))
            collected.append({"path": path, "error": code})
            continue
        remaining -= len(data)
        collected.append(
            {
                "path": path,
                "size": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
                "content_b64": base64.b64encode(data).decode("ascii"),
            }
        )
    return collected


def _result(result: ExecResult, workspace: Path, args: Mapping[str, Any]) -> dict[str, Any]:
    # A sandbox that failed raised before this point: outputs are read only after a command
    # that actually ran, so they are never mistaken for what an earlier call left.
    outputs = declared_outputs(args)
    extra = {"outputs": collect_outputs(workspace, outputs)} if outputs else {}
    return {
        "exit_code": result.exit_code,
        "stdout": result.stdout,
        "stderr": result.stderr,
        "truncated": result.truncated,
        "duration_ms": result.duration_ms,
        "timed_out": result.timed_out,
        "oom_killed": result.oom_killed,
        "sandbox": result.sandbox,
        **extra,
    }
