"""A call's arguments: the redacted copy that is stored and shown, and the exact copy that
is signed, kept sealed only while a command may still be signed from it.

``Action.args`` (and so receipts, replays and every response) holds
``redact_arguments(canonical)``: secret-like values masked, environment-overlay values
replaced by a fingerprint. The runner must still receive exactly what was requested, and
``args_digest`` is over exactly that, so an action that can still be signed (one awaiting a
person's approval, or queued and not yet taken by the broker) also keeps the canonical
arguments in ``sealed_args``, encrypted (Fernet, a key derived with HKDF from
``KESTREL_ARGUMENT_ENCRYPTION_KEY`` or ``SECRET_KEY``), until the call ends: report ingestion
reads the environment values from it to mask them wherever the tool printed them. It is
emptied in the same update that records the call's end (or a denial); nothing but signing,
the approval's digest check and that masking decrypts it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from functools import lru_cache
from typing import Any

from cryptography.fernet import Fernet
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings

from kestrel_one.common.redaction import redact_arguments
from runners.contract.canonical import arguments_digest, canonical_json

_PURPOSE = b"kestrel-one sealed call arguments v1"
_SALT_PURPOSE = b"kestrel-one argument digest salts v1"


@lru_cache(maxsize=4)
def _fernet(root: str) -> Fernet:
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_PURPOSE).derive(root.encode())
    return Fernet(base64.urlsafe_b64encode(key))


def _cipher() -> Fernet:
    return _fernet(settings.KESTREL_ARGUMENT_ENCRYPTION_KEY or settings.SECRET_KEY)


def arguments_shown(canonical: dict) -> dict:
    """What is stored in ``args`` and shown on every surface."""
    return redact_arguments(canonical)


def arguments_sealed(canonical: dict, shown: dict) -> str:
    """The ciphertext to keep beside ``shown``; empty when redaction changed nothing."""
    if shown == canonical:
        return ""
    return _cipher().encrypt(canonical_json(canonical)).decode()


def action_arguments(action) -> dict[str, Any]:
    """The exact canonical arguments of ``action``, for signing its command or checking its
    digest: the sealed copy when there is one, else ``args`` (which then is exact)."""
    if not action.sealed_args:
        return action.args
    return json.loads(_cipher().decrypt(action.sealed_args.encode()))


@lru_cache(maxsize=4)
def _salt_key(root: str) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_SALT_PURPOSE).derive(
        root.encode()
    )


def digest_salt(canonical: Any, shown: Any = None) -> str:
    """The salt of a call's ``args_digest``: none when the arguments are stored and shown as
    they are; else an HMAC of them under a key derived from ``SECRET_KEY``.

    The digest of exact arguments with every other argument shown lets anyone who may read
    the call test a guess of a hidden value (a short ``env`` value) against it; salted, the
    guess needs the key. Deterministic, so that a plan step's digest, an approval's check
    and a replay of the same call agree without keeping anything; the command carries it
    (``args_salt``) for the runner's own check. ``shown``: ``arguments_shown(canonical)``,
    when the caller has it already (redacting large arguments is not free)."""
    if (redact_arguments(canonical) if shown is None else shown) == canonical:
        return ""
    key = _salt_key(settings.SECRET_KEY)
    return hmac.new(key, canonical_json(canonical), hashlib.sha256).hexdigest()


def call_args_digest(canonical: Any, shown: Any = None) -> str:
    """``args_digest`` of a call with these exact arguments (salted: ``digest_salt``)."""
    return arguments_digest(canonical, digest_salt(canonical, shown))
