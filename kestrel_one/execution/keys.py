"""The control plane's command-signing key."""

from __future__ import annotations

import os
import stat
from functools import lru_cache

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from runners.contract.tokens import generate_private_key_pem, load_private_key, public_key_pem


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
