"""The explicit tool registry: the only place a tool comes into existence (EXT-1).

``TOOL_MODULES`` lists the modules that define tools; each tool is a literal ``ToolSpec``
in its module, beside its implementation. Nothing registers a tool at run time, so a name
that a model or a command invents can only ever meet ``UnknownTool``. The control plane
(which decides) and the runner (which checks again when it verifies a command) read one
definition.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jsonschema
import jsonschema.exceptions

from runners.contract.arguments import FIXED_ENV_NAMES, NO_NUL
from runners.contract.errors import InvalidArguments, PathRefused, UnknownTool
from runners.contract.paths import split_relative_path
from runners.contract.toolspec import ToolSpec
from runners.tools import checkpoints, control, files, mcp, processes

__all__ = [
    "TOOLS",
    "TOOL_MODULES",
    "get_tool",
    "takes",
    "validate_args",
]

# Every module that defines tools; each lists its own in ``TOOLS``, in order.
TOOL_MODULES = (processes, files, checkpoints, control, mcp)

TOOLS: Mapping[str, ToolSpec] = MappingProxyType(
    {spec.name: spec for module in TOOL_MODULES for spec in module.TOOLS}
)

_VALIDATORS = {
    name: jsonschema.Draft202012Validator(spec.input_schema) for name, spec in TOOLS.items()
}


def _prefix_items_keep_item_rules(schema: Any, where: str) -> None:
    """In JSON Schema 2020-12 ``items`` no longer applies to the positions ``prefixItems``
    describes, so a prefix entry that drops a rule lets that position escape it (an
    ``argv[0]`` with NUL or a megabyte). Every entry must repeat every item rule."""
    if isinstance(schema, Mapping):
        items = schema.get("items")
        for index, entry in enumerate(schema.get("prefixItems", ())):
            if isinstance(items, Mapping) and not entry.items() >= items.items():
                raise TypeError(f"{where}: prefixItems[{index}] drops rules of items")
        for key, value in schema.items():
            _prefix_items_keep_item_rules(value, f"{where}.{key}")
    elif isinstance(schema, list):
        for index, value in enumerate(schema):
            _prefix_items_keep_item_rules(value, f"{where}[{index}]")


for _name, _validator in _VALIDATORS.items():
    _validator.check_schema(_validator.schema)
    _prefix_items_keep_item_rules(_validator.schema, _name)


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


def takes(tool: ToolSpec) -> str:
    """The arguments ``tool`` accepts, for messages: ``fs.write takes: content, path``."""
    names = sorted(tool.input_schema["properties"])
    return f"{tool.name} takes: {', '.join(names)}" if names else f"{tool.name} takes no arguments"


def _field_error(error: jsonschema.exceptions.ValidationError, tool: ToolSpec) -> InvalidArguments:
    field = _field_path(error.absolute_path)
    instance: Any = error.instance
    expected: Any = error.validator_value
    schema: Any = error.schema
    if not error.absolute_path and error.validator == "type":
        return InvalidArguments(field, f"must be a JSON object of arguments; {takes(tool)}")
    if error.validator == "required":
        missing = [key for key in expected if key not in instance]
        return InvalidArguments(_field_path([*error.absolute_path, missing[0]]), "is required")
    if error.validator == "additionalProperties":
        allowed = schema.get("properties", {})
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
    if error.validator == "pattern" and expected == NO_NUL:
        return InvalidArguments(field, "must not contain NUL characters")
    return InvalidArguments(field, error.message)


def _field_path(parts: Any) -> str:
    text = "args"
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text
