"""The explicit tool registry: the only place a tool comes into existence (EXT-1).

Every tool is a literal ``ToolSpec`` entry below. Nothing registers a tool at run time,
so a name that a model or a command invents can only ever meet ``UnknownTool``. Each entry
carries the JSON Schema its arguments must match and the ``policies.request.Request`` its
arguments ask of the policy, so the control plane (which decides) and the runner (which
validates again before it acts) read one definition.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import jsonschema
import jsonschema.exceptions

from policies.request import Request
from runners.errors import InvalidArguments, UnknownTool
from runners.sandbox.base import FIXED_ENV_NAMES
from runners.workspace import PathRefused, split_relative_path

__all__ = [
    "TOOLS",
    "InvalidArguments",
    "ToolSpec",
    "UnknownTool",
    "declared_outputs",
    "get_tool",
    "output_read_requests",
    "validate_args",
]

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

_NO_NUL = "^[^\\x00]*$"

_PATH = {
    "type": "string",
    "minLength": 1,
    "maxLength": MAX_PATH_CHARS,
    "pattern": _NO_NUL,
    "description": "Workspace-relative path; '.' is the workspace itself.",
}

_TIMEOUT = {"type": "integer", "minimum": 1, "maximum": MAX_TIMEOUT_S}

_OUTPUTS = {
    "type": "array",
    "maxItems": MAX_OUTPUTS,
    "uniqueItems": True,
    "items": {**_PATH, "maxLength": MAX_OUTPUT_PATH_CHARS},
    "description": "Workspace-relative files to return after the command, kept as artifacts.",
}


def _object(properties: Mapping[str, Any], required: list[str], **extra: Any) -> dict:
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "additionalProperties": False,
        "properties": dict(properties),
        "required": required,
        **extra,
    }


@dataclass(frozen=True)
class ToolSpec:
    """What a tool is: its name, the capability it needs, its argument schema.

    ``idempotent`` says whether running the same arguments twice has the effect of running
    them once; the runner may retry an interrupted call only when it is true.
    """

    name: str
    capability: str
    summary: str
    input_schema: Mapping[str, Any]
    idempotent: bool
    build_request: Callable[[Mapping[str, Any]], Request]

    def capability_request(self, args: Mapping[str, Any]) -> Request:
        """The policy request for already validated ``args``."""
        return self.build_request(args)


def _limits(args: Mapping[str, Any]) -> Mapping[str, float]:
    if "timeout_s" in args:
        return MappingProxyType({"timeout_s": float(args["timeout_s"])})
    return MappingProxyType({})


def _path_request(capability: str) -> Callable[[Mapping[str, Any]], Request]:
    def build(args: Mapping[str, Any]) -> Request:
        return Request(capability=capability, paths=(args["path"],))

    return build


def _shell_request(args: Mapping[str, Any]) -> Request:
    # argv[0] exactly as given: a basename would let "./git" (a file in the workspace) pass a
    # rule written for "git" (the program on the sandbox's fixed PATH).
    command = args["argv"][0] if "argv" in args else "sh"
    return Request(capability="shell.exec", command=command, limits=_limits(args))


def _python_request(args: Mapping[str, Any]) -> Request:
    return Request(capability="code.exec", limits=_limits(args))


def _whole_workspace_request(capability: str) -> Callable[[Mapping[str, Any]], Request]:
    # A checkpoint reads, and a restore may write, anywhere in the workspace: the policy
    # must grant the capability on "." (the root), which only "**" does.
    def build(args: Mapping[str, Any]) -> Request:
        return Request(capability=capability, paths=(".",))

    return build


# A checkpoint archive is at most 1 MiB (runners.tools.checkpoints), base64 a third more.
MAX_ARCHIVE_B64_CHARS = 1024 * 1024 * 4 // 3 + 4

_SHELL_SCHEMA = _object(
    {
        "argv": {
            "type": "array",
            "minItems": 1,
            "maxItems": MAX_ARGV_ITEMS,
            "prefixItems": [{"type": "string", "minLength": 1}],
            "items": {"type": "string", "maxLength": MAX_ARG_CHARS, "pattern": _NO_NUL},
        },
        "script": {
            "type": "string",
            "minLength": 1,
            "maxLength": MAX_SCRIPT_CHARS,
            "pattern": _NO_NUL,
        },
        "cwd": _PATH,
        "env": {
            "type": "object",
            "maxProperties": MAX_ENV_ENTRIES,
            "propertyNames": {"pattern": "^[A-Za-z_][A-Za-z0-9_]{0,127}$"},
            "additionalProperties": {
                "type": "string",
                "maxLength": MAX_ARG_CHARS,
                "pattern": _NO_NUL,
            },
        },
        "timeout_s": _TIMEOUT,
        "outputs": _OUTPUTS,
    },
    [],
    oneOf=[{"required": ["argv"]}, {"required": ["script"]}],
)

TOOLS: Mapping[str, ToolSpec] = MappingProxyType(
    {
        spec.name: spec
        for spec in (
            ToolSpec(
                name="shell.exec",
                capability="shell.exec",
                summary="Run a program (argv) or a POSIX sh script in the sandbox.",
                input_schema=_SHELL_SCHEMA,
                idempotent=False,
                build_request=_shell_request,
            ),
            ToolSpec(
                name="code.python",
                capability="code.exec",
                summary="Run a Python 3 program in the sandbox.",
                input_schema=_object(
                    {
                        "code": {
                            "type": "string",
                            "minLength": 1,
                            "maxLength": MAX_CODE_CHARS,
                            "pattern": _NO_NUL,
                        },
                        "timeout_s": _TIMEOUT,
                        "outputs": _OUTPUTS,
                    },
                    ["code"],
                ),
                idempotent=False,
                build_request=_python_request,
            ),
            ToolSpec(
                name="fs.read",
                capability="fs.read",
                summary="Read a file in the workspace.",
                input_schema=_object({"path": _PATH}, ["path"]),
                idempotent=True,
                build_request=_path_request("fs.read"),
            ),
            ToolSpec(
                name="fs.list",
                capability="fs.read",
                summary="List a directory in the workspace.",
                input_schema=_object({"path": _PATH}, ["path"]),
                idempotent=True,
                build_request=_path_request("fs.read"),
            ),
            ToolSpec(
                name="fs.write",
                capability="fs.write",
                summary="Create or replace a file in the workspace with the given text.",
                input_schema=_object(
                    {
                        "path": _PATH,
                        "content": {"type": "string", "maxLength": MAX_FILE_CONTENT_CHARS},
                    },
                    ["path", "content"],
                ),
                # Writing the same content again leaves the same file and the same result.
                idempotent=True,
                build_request=_path_request("fs.write"),
            ),
            ToolSpec(
                name="fs.delete",
                capability="fs.write",
                summary="Delete a file, a symbolic link or an empty directory in the workspace.",
                input_schema=_object({"path": _PATH}, ["path"]),
                # A second delete finds nothing and fails, unlike the first.
                idempotent=False,
                build_request=_path_request("fs.write"),
            ),
            ToolSpec(
                name="workspace.checkpoint",
                capability="fs.read",
                summary="Snapshot the whole workspace as a bounded tar.gz (no links or devices).",
                input_schema=_object({}, []),
                idempotent=True,
                build_request=_whole_workspace_request("fs.read"),
            ),
            ToolSpec(
                name="workspace.restore",
                capability="fs.write",
                summary="Write a checkpoint's files back into the workspace, checked first.",
                input_schema=_object(
                    {
                        "archive_b64": {
                            "type": "string",
                            "minLength": 1,
                            "maxLength": MAX_ARCHIVE_B64_CHARS,
                            "pattern": "^[A-Za-z0-9+/]*={0,2}$",
                        },
                        "sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
                        # Also remove what the checkpoint does not hold.
                        "exact": {"type": "boolean"},
                    },
                    ["archive_b64", "sha256"],
                ),
                # Writing the same files again leaves the same workspace.
                idempotent=True,
                build_request=_whole_workspace_request("fs.write"),
            ),
        )
    }
)

_VALIDATORS = {
    name: jsonschema.Draft202012Validator(spec.input_schema) for name, spec in TOOLS.items()
}
for _validator in _VALIDATORS.values():
    _validator.check_schema(_validator.schema)


def get_tool(name: str) -> ToolSpec:
    """The registered tool called ``name``; anything else raises ``UnknownTool``."""
    try:
        return TOOLS[name]
    except (KeyError, TypeError):
        raise UnknownTool(f"unknown tool {name!r}") from None


def validate_args(name: str, args: Any) -> dict[str, Any]:
    """Check ``args`` against tool ``name``'s schema and return them as a plain copy.

    The copy holds only JSON types and is what the caller should hash, sign and run, never
    the object it was given. Errors name the offending field (``args.argv[0]``).
    """
    tool = get_tool(name)
    validator = _VALIDATORS[tool.name]
    error = jsonschema.exceptions.best_match(validator.iter_errors(args))
    if error is not None:
        raise _field_error(error, tool)
    for field in ("path", "cwd"):
        if field in args:
            try:
                split_relative_path(args[field])
            except PathRefused as refused:
                raise InvalidArguments(f"args.{field}", refused.reason) from None
    for index, output in enumerate(args.get("outputs", ())):
        # The same path rules as the file tools: the path the policy judged is the one read.
        try:
            if not split_relative_path(output):
                raise PathRefused(output, "is the workspace itself; declare files")
        except PathRefused as refused:
            raise InvalidArguments(f"args.outputs[{index}]", refused.reason) from None
    for variable in sorted(args.get("env", {})):
        # The sandbox owns these (TMPDIR is the per-command tmpfs, HOME the workspace);
        # refusing beats silently ignoring. A contract, not a boundary: a script may export
        # anything it likes once it runs.
        if variable in FIXED_ENV_NAMES:
            raise InvalidArguments(
                f"args.env.{variable}", "is set by the sandbox and cannot be overridden"
            )
    return copy.deepcopy(args)


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


def takes(tool: ToolSpec) -> str:
    """The arguments ``tool`` accepts, for messages: ``fs.write takes: content, path``."""
    names = sorted(tool.input_schema["properties"])
    return f"{tool.name} takes: {', '.join(names)}" if names else f"{tool.name} takes no arguments"


def _field_error(error: jsonschema.exceptions.ValidationError, tool: ToolSpec) -> InvalidArguments:
    field = _field_path(error.absolute_path)
    instance = error.instance
    if not error.absolute_path and error.validator == "type":
        return InvalidArguments(field, f"must be a JSON object of arguments; {takes(tool)}")
    if error.validator == "required":
        missing = [key for key in error.validator_value if key not in instance]
        return InvalidArguments(_field_path([*error.absolute_path, missing[0]]), "is required")
    if error.validator == "additionalProperties":
        allowed = error.schema.get("properties", {})
        unexpected = sorted(str(key) for key in instance if key not in allowed)
        # The caller's own key, echoed bounded: it is what they must remove.
        name = unexpected[0] if len(unexpected[0]) <= 64 else unexpected[0][:64] + "..."
        reason = (
            f"unknown argument {name!r}; {takes(tool)}"
            if not error.absolute_path
            else f"unknown key {name!r}; allowed: {', '.join(sorted(allowed))}"
        )
        return InvalidArguments(_field_path([*error.absolute_path, unexpected[0]]), reason)
    if error.validator == "oneOf" and not error.absolute_path:
        return InvalidArguments(field, "give exactly one of 'argv' or 'script'")
    if error.validator == "propertyNames":
        return InvalidArguments(field, f"{instance!r} is not a valid environment variable name")
    if error.validator == "pattern" and error.validator_value == _NO_NUL:
        return InvalidArguments(field, "must not contain NUL characters")
    return InvalidArguments(field, error.message)


def _field_path(parts: Any) -> str:
    text = "args"
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text
