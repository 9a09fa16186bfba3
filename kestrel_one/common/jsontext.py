"""JSON text from outside: a request body, a form field, an upstream's answer.

``json.loads`` raises ``RecursionError``, not ``ValueError``, for arrays or objects nested
deeper than the interpreter's recursion limit: a few kilobytes of ``[[[[...`` from a client
or an upstream would otherwise escape every ``except ValueError`` and be a server error (or
a task's crash). A number of more than ``sys.get_int_max_str_digits()`` digits (4,300)
raises a plain ``ValueError``, which is no ``json.JSONDecodeError``. ``json_loads`` makes
both the decode error they are, so a caller's one ``except json.JSONDecodeError`` (or
``except ValueError``) covers them.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["json_loads"]


def json_loads(text: str | bytes | bytearray, **options: Any) -> Any:
    """``json.loads(text, **options)``; JSON nested too deeply, or a number with too many
    digits to read, is a ``json.JSONDecodeError``."""
    document = text if isinstance(text, str) else ""
    try:
        return json.loads(text, **options)
    except (json.JSONDecodeError, UnicodeDecodeError):
        # Bytes that are no text stay what they were, a ValueError with its own message.
        raise
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", document, 0) from None
    except ValueError:
        # int() of the digits refused (sys.set_int_max_str_digits): no value it could be
        # was ever meant to be read.
        raise json.JSONDecodeError("a number has too many digits", document, 0) from None
