"""The artifact storage: one Django storage alias (``STORAGES["artifacts"]``).

Everything that reads or writes artifact bytes goes through here, so swapping the local
folder for an object store (docs/records.md) is a settings change only.
"""

from __future__ import annotations

import hashlib

from django.core.files.base import ContentFile
from django.core.files.storage import storages

CHUNK_BYTES = 64 * 1024


def artifact_storage():
    return storages["artifacts"]


def storage_name_for(*, organization_public_id: str, artifact_public_id: str) -> str:
    """Names are built from public ids only: nothing a tool or a caller chose reaches a path."""
    return f"{organization_public_id}/{artifact_public_id}"


def storage_save(name: str, content: bytes) -> str:
    """Store ``content``; returns the name the backend used (it may differ if taken)."""
    return artifact_storage().save(name, ContentFile(content))


def storage_read(name: str) -> bytes:
    with artifact_storage().open(name, "rb") as handle:
        return handle.read()


def storage_delete(name: str) -> None:
    artifact_storage().delete(name)


def storage_exists(name: str) -> bool:
    return artifact_storage().exists(name)


def sha256_of(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()
