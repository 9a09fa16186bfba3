"""The helper process that checks ``mcp.call`` arguments against a tool's recorded input
schema (``kestrel_one.mcp.schema_check`` starts it and speaks to it).

It runs as its own script (``python -I``): the standard library and jsonschema only, nothing
of Django, so a check that must be stopped can be stopped by ending this process. One JSON
line in on stdin, ``{"schema", "arguments", "limit"}``; one JSON line out on stdout:
``{"errors": [[field, message], ...]}`` (at most ``limit``, ordered by path), or
``{"unusable": "<exception name>"}`` when the schema cannot be used (a reference that
resolves to nothing). It ends at the end of its input.

The schema is an MCP server's, so nothing it names is ever fetched: jsonschema's default
registry retrieves an unknown ``$ref`` with urllib (http, ftp, file), which would have let a
server's schema make this process read any URL or local file and quote it back in an error.
Its registry here has no retrieval: such a reference resolves to nothing.
"""

from __future__ import annotations

import heapq
import json
import sys
from collections.abc import Mapping
from typing import Any

from jsonschema import Draft202012Validator
from referencing import Registry

# jsonschema's messages repeat the value they are about; the answer carries this much of each.
MAX_MESSAGE_CHARS = 1000


def _field(error: Any) -> str:
    path = "".join(
        f"[{part}]" if isinstance(part, int) else f".{part}" for part in error.absolute_path
    )
    if error.validator == "required" and isinstance(error.instance, Mapping):
        missing = [name for name in error.validator_value or () if name not in error.instance]
        if missing:
            path += f".{missing[0]}"
    return f"args.arguments{path}"


def argument_errors(schema: Any, arguments: Any, limit: int) -> list[list[str]]:
    """``[field, message]`` of each error of ``arguments`` under ``schema``, at most
    ``limit``, ordered by path: the ``limit`` first by path of all of them.

    Only those are kept while the others are made: the schema is the server's and the
    arguments the caller's, and together they can have any number of errors (each branch of
    an ``allOf`` for each of a hundred thousand keys), each an object with its message, so
    holding all of them to sort them took hundreds of MiB within the check's time bound.
    Not the first ``limit`` found: jsonschema finds some in the order of a set (extra
    properties), which differs from one process to the next, and the same call would be
    refused with other errors each time."""
    errors = heapq.nsmallest(
        max(limit, 0),
        Draft202012Validator(schema, registry=Registry()).iter_errors(arguments),
        key=lambda error: list(map(str, error.path)),
    )
    return [[_field(error), error.message[:MAX_MESSAGE_CHARS]] for error in errors]


def main() -> None:
    while line := sys.stdin.readline():
        request = json.loads(line)
        try:
            answer: dict[str, Any] = {
                "errors": argument_errors(
                    request["schema"], request["arguments"], int(request["limit"])
                )
            }
        except Exception as error:  # a bad schema, an unresolvable reference: no common base
            answer = {"unusable": type(error).__name__}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
