"""The API token format: ``kst_<key id>_<secret>``, stored only as a SHA-256 hash.

The key id is a public lookup handle; the secret is 256 random bits, so a fast hash is
enough (there is nothing to brute-force) and verification stays cheap on every request.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

TOKEN_PREFIX = "kst_"  # noqa: S105 - the public prefix
_KEY_ALPHABET = "abcdefghijklmnopqrstuvwxyz234567"
_TOKEN_RE = re.compile(r"^kst_([a-z2-7]{12})_([A-Za-z0-9_-]{43})$")


def generate() -> tuple[str, str, str]:
    """Return (token, key_id, secret_hash); only the hash and key id are ever stored."""
    key_id = "".join(secrets.choice(_KEY_ALPHABET) for _ in range(12))
    token = f"{TOKEN_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"
    return token, key_id, hash_token(token)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def parse_key_id(token: str) -> str | None:
    match = _TOKEN_RE.match(token)
    return match.group(1) if match else None


def matches(token: str, secret_hash: str) -> bool:
    return hmac.compare_digest(hash_token(token), secret_hash)
