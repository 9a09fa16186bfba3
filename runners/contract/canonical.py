"""The one byte form of a JSON value, and the digests that bind arguments and tokens.

The bytes that are signed are the bytes that are hashed: both tiers compute ``digest`` of
a call's arguments and ``token_digest`` of a command exactly as sent.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["canonical_json", "digest", "token_digest"]


def canonical_json(value: Any) -> bytes:
    """The one byte form of a JSON value that is hashed and signed (sorted keys, no spaces)."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def digest(value: Any) -> str:
    """sha256 hex of ``canonical_json(value)``: what binds arguments across the system."""
    return hashlib.sha256(canonical_json(value)).hexdigest()


def token_digest(token: str) -> str:
    """sha256 hex of a token string exactly as sent: a result names its command by this."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()
