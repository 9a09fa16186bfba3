"""What the credentials tests share: the forms a leaked secret could take, and principals."""

from __future__ import annotations

import base64
import binascii
from urllib.parse import quote

from kestrel_one.accounts.principal import Principal, PrincipalKind


def secret_forms(secret: str) -> list[str]:
    """The secret as it could leak: plain, base64 (both alphabets, unpadded), hex, URL-encoded."""
    raw = secret.encode()
    return [
        secret,
        base64.b64encode(raw).decode().rstrip("="),
        base64.urlsafe_b64encode(raw).decode().rstrip("="),
        binascii.hexlify(raw).decode(),
        quote(secret, safe=""),
    ]


def assert_secret_free(text: str | bytes, *secrets: str) -> None:
    if isinstance(text, bytes):
        text = text.decode("latin-1")
    for secret in secrets:
        for form in secret_forms(secret):
            assert form not in text, f"a form of the secret leaked: {form[:6]}..."


def person(actor) -> Principal:
    """The world actor acting through their own token."""
    return Principal(PrincipalKind.TOKEN, user=actor.user, token=actor.token)
