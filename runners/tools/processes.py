"""The process tools, shell.exec and code.python: specs and implementations.

Both only ever run inside a probed sandbox, which the runner hands in as
``ToolContext.sandbox``; declared outputs are read back from the workspace afterwards.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from policies.request import Request
from runners.contract.arguments import (
    MAX_ARG_CHARS,
    MAX_ARGV_ITEMS,
    MAX_CODE_CHARS,
    MAX_ENV_ENTRIES,
    MAX_OUTPUT_FILE_BYTES,
    MAX_OUTPUTS_TOTAL_BYTES,
    MAX_SCRIPT_CHARS,
    NO_NUL,
    OUTPUTS,
    PATH,
    TIMEOUT,
    declared_outputs,
    object_schema,
    timeout_limits,
)
from runners.contract.errors import PathRefused
from runners.contract.toolspec import Captures, ProcessOutcome, ToolContext, ToolSpec
from runners.workspace import FileTooLarge, PathNotFound, Workspace, WrongFileType

# How a declared output that cannot be returned is reported; stable codes, like errors.
_OUTPUT_ERRORS = (
    (PathNotFound, "not_found"),
    (FileTooLarge, "too_large"),
    (PathRefused, "path_refused"),
    (WrongFileType, "wrong_file_type"),
)


def shell_exec(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    # "--" keeps a script that starts with "-" from being read as options to sh.
    argv = tuple(args["argv"]) if "argv" in args else ("sh", "-c", "--", args["script"])
    cwd = args.get("cwd", ".")
    # Checked on the host, link-free, for a clear error; the sandbox confines it anyway.
    Workspace(ctx.workspace).check_directory(cwd)
    outcome = ctx.sandbox.run(
        argv, cwd=cwd, env=args.get("env", {}), timeout_s=args.get("timeout_s")
    )
    return _result(outcome, ctx.workspace, args)


def code_python(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    outcome = ctx.sandbox.run(("python3", "-c", args["code"]), timeout_s=args.get("timeout_s"))
    return _result(outcome, ctx.workspace, args)


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


def _result(result: ProcessOutcome, workspace: Path, args: Mapping[str, Any]) -> dict[str, Any]:
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


def _shell_request(args: Mapping[str, Any]) -> Request:
    # argv[0] exactly as given: a basename would let "./git" (a file in the workspace) pass a
    # rule written for "git" (the program on the sandbox's fixed PATH).
    command = args["argv"][0] if "argv" in args else "sh"
    # The overlay's names, so the policy sees what the call would change about how the
    # program loads and runs (LD_PRELOAD, BASH_ENV, ...); the values are never judged.
    return Request(
        capability="shell.exec",
        command=command,
        env_names=tuple(sorted(args.get("env", {}))),
        limits=timeout_limits(args),
    )


def _python_request(args: Mapping[str, Any]) -> Request:
    return Request(capability="code.exec", limits=timeout_limits(args))


_ARGUMENT = {"type": "string", "maxLength": MAX_ARG_CHARS, "pattern": NO_NUL}

_SHELL_SCHEMA = object_schema(
    {
        "argv": {
            "type": "array",
            "minItems": 1,
            "maxItems": MAX_ARGV_ITEMS,
            # prefixItems replaces items for argv[0]: it repeats every item rule (registry).
            "prefixItems": [{**_ARGUMENT, "minLength": 1}],
            "items": _ARGUMENT,
        },
        "script": {
            "type": "string",
            "minLength": 1,
            "maxLength": MAX_SCRIPT_CHARS,
            "pattern": NO_NUL,
        },
        "cwd": PATH,
        "env": {
            "type": "object",
            "maxProperties": MAX_ENV_ENTRIES,
            "propertyNames": {"pattern": "^[A-Za-z_][A-Za-z0-9_]{0,127}$"},
            "additionalProperties": {
                "type": "string",
                "maxLength": MAX_ARG_CHARS,
                "pattern": NO_NUL,
            },
        },
        "timeout_s": TIMEOUT,
        "outputs": OUTPUTS,
    },
    [],
    oneOf=[{"required": ["argv"]}, {"required": ["script"]}],
)

_PYTHON_SCHEMA = object_schema(
    {
        "code": {
            "type": "string",
            "minLength": 1,
            "maxLength": MAX_CODE_CHARS,
            "pattern": NO_NUL,
        },
        "timeout_s": TIMEOUT,
        "outputs": OUTPUTS,
    },
    ["code"],
)

SHELL_EXEC = ToolSpec(
    name="shell.exec",
    capability="shell.exec",
    summary="Run a program (argv) or a POSIX sh script in the sandbox.",
    input_schema=_SHELL_SCHEMA,
    idempotent=False,
    build_request=_shell_request,
    implementation=shell_exec,
    runs_process=True,
    adapter_broker=True,
    captures=Captures.OUTPUTS,
)

CODE_PYTHON = ToolSpec(
    name="code.python",
    capability="code.exec",
    summary="Run a Python 3 program in the sandbox.",
    input_schema=_PYTHON_SCHEMA,
    idempotent=False,
    build_request=_python_request,
    implementation=code_python,
    runs_process=True,
    adapter_broker=True,
    captures=Captures.OUTPUTS,
)

TOOLS = (SHELL_EXEC, CODE_PYTHON)
