"""Turning a requested tool call into what the policy judges, with errors naming the field."""

from __future__ import annotations

from kestrel_one.common.errors import ValidationFailed
from runners.errors import InvalidArguments, UnknownTool
from runners.registry import get_tool, validate_args


def tool_call_request(tool_name: str, args):
    """Return (tool spec, canonical args, policy request) for a call, or a 400 naming the field.

    Tools exist only in the registry (EXT-1): an unknown name is refused, never passed on.
    """
    try:
        tool = get_tool(tool_name)
    except UnknownTool:
        raise ValidationFailed(
            f"Unknown tool {tool_name!r}; GET /api/v1/tools lists the tools.",
            details={"tool": ["unknown"]},
        ) from None
    try:
        canonical = validate_args(tool.name, args)
    except InvalidArguments as exc:
        raise ValidationFailed(str(exc), details={exc.field: [exc.reason]}) from None
    return tool, canonical, tool.capability_request(canonical)
