"""One redaction pass for everything that is stored or shown: audit, events, receipts, logs.

Secret-like keys have their values masked whatever the value; secret-like values are masked
wherever they appear; the result is bounded in size with an explicit marker when cut.
"""

from __future__ import annotations

import json
import re
from typing import Any

MASK = "[redacted]"
TRUNCATED = "[truncated]"

_SECRET_KEY = re.compile(
    r"(pass(word|wd|phrase)?|secret|token|api[-_]?key|apikey|authori[sz]ation|cookie|"
    r"private[-_]?key|credential|signature|session)",
    re.IGNORECASE,
)
_SECRET_VALUE = re.compile(
    r"(kst_[a-z0-9]{12}_[A-Za-z0-9_-]{20,}"  # Kestrel API tokens
    r"|-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?(-----END [A-Z ]*PRIVATE KEY-----|$)"
    r"|\b(sk|pk|rk)_(live|test)_[A-Za-z0-9]{16,}"
    r"|\bgh[pousr]_[A-Za-z0-9]{30,}"
    r"|\bxox[abpr]-[A-Za-z0-9-]{10,}"
    r"|\bAKIA[0-9A-Z]{16}\b"
    r"|\b[Bb]earer\s+[A-Za-z0-9._~+/=-]{12,})"
)


def redact_text(text: str) -> str:
    return _SECRET_VALUE.sub(MASK, text)


def redact(value: Any, *, _depth: int = 0) -> Any:
    """Mask secret-like keys and values in JSON-like data."""
    if _depth > 32:
        return TRUNCATED
    if isinstance(value, dict):
        return {
            str(key): MASK
            if _SECRET_KEY.search(str(key)) and item not in (None, "", [], {})
            else redact(item, _depth=_depth + 1)
            for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        return [redact(item, _depth=_depth + 1) for item in value]
    if isinstance(value, str):
        return redact_text(value)
    return value


def bounded(value: Any, *, max_bytes: int = 8192) -> Any:
    """Redact, then keep the JSON form under ``max_bytes``, marking what was cut."""
    clean = redact(value)
    encoded = json.dumps(clean, sort_keys=True, default=str)
    if len(encoded.encode()) <= max_bytes:
        return clean
    return {TRUNCATED: True, "preview": encoded[: max(0, max_bytes - 64)]}
