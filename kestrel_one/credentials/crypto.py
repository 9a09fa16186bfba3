"""Envelope encryption of credential secrets (CRED-1).

Every record gets a random 256-bit data key; the secret is sealed with AES-GCM under it, and
the data key is sealed (wrapped) with AES-GCM under the key-encryption key (KEK) read from
``KESTREL_CREDENTIALS_KEY_FILE``. Both seals carry the same associated data: the organization's
public id, the record's public id and its adapter. A row copied to another organization or
record, or edited to another adapter, then fails authentication instead of decrypting.

The KEK file holds 32 random bytes in base64 on one line, readable by its owner only. Hosted
mode names the file (settings refuse to start without it); single-host mode generates one
under the data folder on first use. ``KESTREL_CREDENTIALS_PREVIOUS_KEY_FILE`` may name the key
being rotated away from, so records still wrapped by it keep opening until the rotation
command has re-wrapped them (docs/credentials.md).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

KEY_BYTES = 32
NONCE_BYTES = 12
_AAD_LABEL = b"kestrel-one credential v1"
_KEY_ID_LABEL = b"kestrel-one credentials key id v1"
_FINGERPRINT_LABEL = b"kestrel-one credential fingerprint v1"


class SealBroken(Exception):
    """A sealed secret did not open: wrong key, or the row was copied or changed. Carries no
    secret material."""


@dataclass(frozen=True)
class KeyEncryptionKey:
    key: bytes

    @property
    def key_id(self) -> str:
        return hashlib.sha256(_KEY_ID_LABEL + self.key).hexdigest()[:16]


def key_generate(path: Path) -> KeyEncryptionKey:
    """Write a new KEK to ``path`` (which must not exist), readable by its owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    key = secrets.token_bytes(KEY_BYTES)
    with os.fdopen(fd, "w") as handle:
        handle.write(base64.b64encode(key).decode() + "\n")
    return KeyEncryptionKey(key)


def key_load(path: Path) -> KeyEncryptionKey:
    """Read a KEK file; refuses one that others may read or that is not 32 bytes."""
    if not path.exists():
        raise ImproperlyConfigured(f"KESTREL_CREDENTIALS_KEY_FILE {path} does not exist")
    if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ImproperlyConfigured(f"{path} must be readable by its owner only (chmod 600)")
    try:
        key = base64.b64decode(path.read_text().strip(), validate=True)
    except (binascii.Error, ValueError):
        key = b""
    if len(key) != KEY_BYTES:
        raise ImproperlyConfigured(
            f"{path} must hold {KEY_BYTES} random bytes in base64 on one line "
            "(manage.py rotate_credentials_key --generate writes one)"
        )
    return KeyEncryptionKey(key)


def current_key() -> KeyEncryptionKey:
    """The KEK new seals use. Read from the file on each use (it is small), so a key file
    replaced after a rotation takes effect without a stale copy in memory."""
    path = Path(settings.KESTREL_CREDENTIALS_KEY_FILE)
    if not path.exists() and settings.SINGLE_HOST:
        try:
            return key_generate(path)
        except FileExistsError:
            pass  # another process created it first; read theirs
    return key_load(path)


def known_keys() -> dict[str, KeyEncryptionKey]:
    """Every KEK a record may be wrapped by: the current one and, during a rotation, the
    previous one."""
    keys = [current_key()]
    previous = getattr(settings, "KESTREL_CREDENTIALS_PREVIOUS_KEY_FILE", None)
    if previous:
        keys.append(key_load(Path(previous)))
    return {key.key_id: key for key in keys}


def associated_data(*, organization_id: str, record_id: str, adapter: str) -> bytes:
    """What both seals bind: where the record lives and what it is for."""
    parts = (_AAD_LABEL, organization_id.encode(), record_id.encode(), adapter.encode())
    return b"\x00".join(parts)


@dataclass(frozen=True)
class Sealed:
    secret_ciphertext: bytes
    data_key_wrapped: bytes
    key_id: str


def _seal(key: bytes, plaintext: bytes, aad: bytes) -> bytes:
    nonce = secrets.token_bytes(NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, aad)


def _open(key: bytes, sealed: bytes, aad: bytes) -> bytes:
    try:
        return AESGCM(key).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], aad)
    except (InvalidTag, ValueError):
        raise SealBroken("the sealed value does not open with this key and place") from None


def seal(secret: str, *, aad: bytes, kek: KeyEncryptionKey | None = None) -> Sealed:
    kek = kek or current_key()
    data_key = AESGCM.generate_key(bit_length=KEY_BYTES * 8)
    return Sealed(
        secret_ciphertext=_seal(data_key, secret.encode(), aad),
        data_key_wrapped=_seal(kek.key, data_key, aad),
        key_id=kek.key_id,
    )


def unseal(*, secret_ciphertext: bytes, data_key_wrapped: bytes, key_id: str, aad: bytes) -> str:
    kek = known_keys().get(key_id)
    if kek is None:
        raise SealBroken("the record is wrapped by a key this server does not hold")
    data_key = _open(kek.key, bytes(data_key_wrapped), aad)
    return _open(data_key, bytes(secret_ciphertext), aad).decode()


def rewrap(
    *,
    data_key_wrapped: bytes,
    key_id: str,
    aad: bytes,
    old: dict[str, KeyEncryptionKey],
    new: KeyEncryptionKey,
) -> bytes:
    """The same data key wrapped by ``new``; the secret's own ciphertext does not change."""
    kek = old.get(key_id)
    if kek is None:
        raise SealBroken("the record is wrapped by a key this server does not hold")
    data_key = _open(kek.key, bytes(data_key_wrapped), aad)
    return _seal(new.key, data_key, aad)


def fingerprint(secret: str) -> str:
    """What may be shown instead of the secret: keyed (HMAC under a key derived from the
    server's secret key), so even a short secret cannot be guessed back from it."""
    key = hashlib.sha256(_FINGERPRINT_LABEL + settings.SECRET_KEY.encode()).digest()
    return "hmac-sha256:" + hmac.new(key, secret.encode(), hashlib.sha256).hexdigest()[:16]
