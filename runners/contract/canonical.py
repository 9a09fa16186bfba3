"""The one byte form of a JSON value, and the digests that bind arguments and tokens.

The bytes that are signed are the bytes that are hashed: both tiers compute ``digest`` of
a call's arguments and ``token_digest`` of a command exactly as sent.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["arguments_digest", "canonical_json", "digest", "token_digest"]


def canonical_json(value: Any) -> bytes:
    """The one byte form of a JSON value that is hashed and signed (sorted keys, no spaces)."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def digest(value: Any) -> str:
    """sha256 hex of ``canonical_json(value)``: what binds arguments across the system."""
    return hashlib.sha256(canonical_json(value)).hexdigest()


def arguments_digest(args: Any, salt: str = "") -> str:
    """What binds a call's arguments (``args_digest``): ``digest(args)``, or, with the
    control plane's ``salt``, the digest of both. A call whose stored and shown arguments
    hide a value (an ``env`` value, a secret) is salted, so that a reader of what is shown
    cannot test a guess of the hidden value against the digest (docs/records.md)."""
    return digest(args) if not salt else digest({"args": args, "salt": salt})


def token_digest(token: str) -> str:
    """sha256 hex of a token string exactly as sent: a result names its command by this."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()
