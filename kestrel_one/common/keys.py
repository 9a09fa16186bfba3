"""The control plane's signing key: runner commands and control messages, and audit heads.

One Ed25519 key, kept in ``KESTREL_SIGNING_KEY_FILE`` (0600). Its public half is published as
a JWKS (``GET /api/v1/keys``) so an auditor can check a signed audit head without trusting
the server that hands the head out; runners get the same public key at enrollment.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
from functools import lru_cache

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from jwt.algorithms import OKPAlgorithm

from runners.contract.tokens import generate_private_key_pem, load_private_key, public_key_pem

ALGORITHM = "EdDSA"


@lru_cache(maxsize=1)
def control_private_key():
    """Load the signing key; in single-host mode, create it (0600) on first use."""
    path = settings.KESTREL_SIGNING_KEY_FILE
    if not path.exists():
        if not settings.SINGLE_HOST:
            raise ImproperlyConfigured(f"KESTREL_SIGNING_KEY_FILE {path} does not exist")
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass  # another process created it first; read theirs
        else:
            with os.fdopen(fd, "wb") as handle:
                handle.write(generate_private_key_pem())
    if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ImproperlyConfigured(f"{path} must be readable by its owner only (chmod 600)")
    return load_private_key(path.read_bytes())


def control_public_key_pem() -> str:
    return public_key_pem(control_private_key()).decode()


def key_id(public_jwk: dict) -> str:
    """The RFC 7638 thumbprint of an OKP public key: names the key, changes when it does."""
    members = {name: public_jwk[name] for name in ("crv", "kty", "x")}
    canonical = json.dumps(members, sort_keys=True, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(hashlib.sha256(canonical).digest()).rstrip(b"=").decode()


def control_public_jwk() -> dict:
    """The public signing key as a JWK, with its ``kid``, ``alg`` and ``use``."""
    jwk = OKPAlgorithm.to_jwk(control_private_key().public_key(), as_dict=True)
    return {**jwk, "kid": key_id(jwk), "alg": ALGORITHM, "use": "sig"}


def control_jwks() -> dict:
    """What ``GET /api/v1/keys`` serves: every public key a control-plane signature may use."""
    return {"keys": [control_public_jwk()]}
