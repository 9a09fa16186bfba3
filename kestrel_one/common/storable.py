"""Text a runner reported, made fit to store: JSON columns and UTF-8 files.

A report is JSON, and JSON can carry what a database cannot keep: PostgreSQL's ``jsonb``
refuses the NUL character (``\\u0000``), and no UTF-8 encoder takes an unpaired surrogate
(``\\ud800``), which SQLite and every artifact file would need. A command printing either
made the report impossible to record, so its call was lost. Both are replaced by U+FFFD in
what is stored as JSON; artifacts keep NULs (a file holds any byte), losing only unpaired
surrogates, which no file can hold as text.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["json_storable", "utf8_encodable"]

_NOT_IN_JSON_COLUMNS = re.compile("[\x00\ud800-\udfff]")
_NOT_IN_UTF8 = re.compile("[\ud800-\udfff]")
REPLACEMENT = "\ufffd"


def json_storable(value: Any) -> Any:
    """``value`` with NUL and unpaired surrogates replaced in every string and key."""
    return _replaced(value, _NOT_IN_JSON_COLUMNS)


def utf8_encodable(value: Any) -> Any:
    """``value`` with unpaired surrogates replaced in every string and key (NULs kept)."""
    return _replaced(value, _NOT_IN_UTF8)


def _replaced(value: Any, pattern: re.Pattern[str]) -> Any:
    if isinstance(value, str):
        return pattern.sub(REPLACEMENT, value)
    if isinstance(value, dict):
        return {_replaced(key, pattern): _replaced(item, pattern) for key, item in value.items()}
    if isinstance(value, list):
        return [_replaced(item, pattern) for item in value]
    return value
