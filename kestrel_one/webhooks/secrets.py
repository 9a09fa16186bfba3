"""Signing secrets: generated here, encrypted at rest, shown to a person exactly once.

The encryption key is derived with HKDF from ``KESTREL_WEBHOOK_ENCRYPTION_KEY`` when set, else
from Django's ``SECRET_KEY``, with a purpose label so the same root never serves as a key for
anything else. Changing the root makes stored secrets unreadable: rotate every endpoint's
secret afterwards (docs/webhooks.md).
"""

from __future__ import annotations

import base64
import hashlib
import secrets
from functools import lru_cache

from cryptography.fernet import Fernet, InvalidToken
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings

SECRET_PREFIX = "whsec_"  # noqa: S105 (the Standard Webhooks prefix, not a secret)
SECRET_BYTES = 32
_PURPOSE = b"kestrel-one webhook signing secrets v1"


@lru_cache(maxsize=4)
def _fernet(root: str) -> Fernet:
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_PURPOSE).derive(root.encode())
    return Fernet(base64.urlsafe_b64encode(key))


def _cipher() -> Fernet:
    return _fernet(settings.KESTREL_WEBHOOK_ENCRYPTION_KEY or settings.SECRET_KEY)


def secret_generate() -> str:
    """A new Standard Webhooks secret: ``whsec_`` and 32 random bytes in base64."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def secret_encrypt(secret: str) -> str:
    return _cipher().encrypt(secret.encode()).decode()


class SecretUnreadable(Exception):
    """A stored secret that the current key cannot decrypt: the key's root changed."""


def secret_decrypt(ciphertext: str) -> str:
    """The stored secret; SecretUnreadable when the current key did not encrypt it."""
    try:
        return _cipher().decrypt(ciphertext.encode()).decode()
    except InvalidToken:
        raise SecretUnreadable(
            "the signing secret cannot be decrypted (the encryption key changed); "
            "rotate the endpoint's secret"
        ) from None


def secret_readable(ciphertext: str) -> bool:
    try:
        secret_decrypt(ciphertext)
    except SecretUnreadable:
        return False
    return True


def secret_fingerprint(secret: str) -> str:
    """What may be shown instead of the secret: enough to tell two secrets apart, no more."""
    return "sha256:" + hashlib.sha256(secret.encode()).hexdigest()[:16]
