"""The rules every tool's arguments share: size bounds, schema pieces, request builders.

Tool modules build their schemas and policy requests from these, and both tiers check
arguments against them (``runners.contract.registry.validate_args``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from policies.request import Request

# Variables the sandbox sets itself (TMPDIR is the per-command tmpfs, HOME the workspace):
# a call's ``env`` may not name them.
FIXED_ENV_NAMES = frozenset({"HOME", "PATH", "TMPDIR"})

# Bounds that keep one call's arguments small enough to sign, log and pass to execve.
MAX_PATH_CHARS = 4096
MAX_FILE_CONTENT_CHARS = 1024 * 1024
MAX_ARGV_ITEMS = 256
MAX_ARG_CHARS = 8192
MAX_SCRIPT_CHARS = 64 * 1024
MAX_CODE_CHARS = 64 * 1024
MAX_ENV_ENTRIES = 64
MAX_TIMEOUT_S = 3600
# Declared outputs (shell.exec, code.python): files the runner reads back after the command
# and returns whole, so the control plane can keep them as artifacts. The caps keep every
# output inside one signed report (base64 adds a third; the report limit is 4 MiB).
MAX_OUTPUTS = 16
MAX_OUTPUT_PATH_CHARS = 255  # an artifact's name is the path, and names hold 255 characters
MAX_OUTPUT_FILE_BYTES = 256 * 1024
MAX_OUTPUTS_TOTAL_BYTES = 1024 * 1024

NO_NUL = "^[^\\x00]*$"

PATH = {
    "type": "string",
    "minLength": 1,
    "maxLength": MAX_PATH_CHARS,
    "pattern": NO_NUL,
    "description": "Workspace-relative path; '.' is the workspace itself.",
}

TIMEOUT = {"type": "integer", "minimum": 1, "maximum": MAX_TIMEOUT_S}

OUTPUTS = {
    "type": "array",
    "maxItems": MAX_OUTPUTS,
    "uniqueItems": True,
    "items": {**PATH, "maxLength": MAX_OUTPUT_PATH_CHARS},
    "description": "Workspace-relative files to return after the command, kept as artifacts.",
}


def object_schema(
    properties: Mapping[str, Any], required: list[str], **extra: Any
) -> dict[str, Any]:
    """A closed JSON Schema object: exactly ``properties``, ``required`` among them."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "additionalProperties": False,
        "properties": dict(properties),
        "required": required,
        **extra,
    }


def timeout_limits(args: Mapping[str, Any]) -> Mapping[str, float]:
    if "timeout_s" in args:
        return MappingProxyType({"timeout_s": float(args["timeout_s"])})
    return MappingProxyType({})


def path_request(capability: str) -> Callable[[Mapping[str, Any]], Request]:
    def build(args: Mapping[str, Any]) -> Request:
        return Request(capability=capability, paths=(args["path"],))

    return build


def whole_workspace_request(capability: str) -> Callable[[Mapping[str, Any]], Request]:
    # A checkpoint reads, and a restore may write, anywhere in the workspace: the policy
    # must grant the capability on "." (the root), which only "**" does.
    def build(args: Mapping[str, Any]) -> Request:
        return Request(capability=capability, paths=(".",))

    return build


def declared_outputs(args: Mapping[str, Any]) -> tuple[str, ...]:
    """The files validated ``args`` declare as outputs (shell.exec, code.python), in order.

    A process tool's policy request judges the program or the code, not paths (a shell.exec
    or code.exec grant has no path list), so these are not added to its ``Request``: the
    control plane judges each one separately as an ``fs.read`` request, see
    ``output_read_requests``.
    """
    return tuple(args.get("outputs", ()))


def output_read_requests(args: Mapping[str, Any]) -> tuple[Request, ...]:
    """One ``fs.read`` request per declared output: returning a file is reading it."""
    return tuple(Request(capability="fs.read", paths=(path,)) for path in declared_outputs(args))
