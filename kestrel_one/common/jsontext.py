"""JSON text from outside: a request body, a form field, an upstream's answer.

``json.loads`` raises ``RecursionError``, not ``ValueError``, for arrays or objects nested
deeper than the interpreter's recursion limit: a few kilobytes of ``[[[[...`` from a client
or an upstream would otherwise escape every ``except ValueError`` and be a server error (or
a task's crash). ``json_loads`` makes it the decode error it is, so a caller's one
``except ValueError`` (or ``json.JSONDecodeError``) covers it.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["json_loads"]


def json_loads(text: str | bytes | bytearray, **options: Any) -> Any:
    """``json.loads(text, **options)``; JSON nested too deeply is a ``json.JSONDecodeError``."""
    try:
        return json.loads(text, **options)
    except RecursionError:
        raise json.JSONDecodeError(
            "nested too deeply", text if isinstance(text, str) else "", 0
        ) from None
