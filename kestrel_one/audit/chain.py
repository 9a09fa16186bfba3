"""The hash that links one audit record to the one before it.

Kept apart from the services and selectors so that writing a record and verifying it later
hash exactly the same canonical bytes: any drift between the two would read as tampering.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

# The previous hash of an organization's very first record.
GENESIS_HASH = "0" * 64

# Every stored field the hash binds. ``organization`` is the organization's public id, so a
# row moved to another organization no longer verifies there.
HASHED_FIELDS = (
    "organization",
    "sequence",
    "created_at",
    "actor_type",
    "actor_id",
    "action",
    "target_type",
    "target_id",
    "outcome",
    "data",
    "request_id",
    "source_address",
    "prev_hash",
    "public_id",
)


def canonical_json(value: Any) -> str:
    """Sorted keys, no spaces: the same bytes for the same value, whatever the dict order."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def chain_hash(fields: Mapping[str, Any], *, organization_public_id: str) -> str:
    """SHA-256 over the canonical JSON of a record's fields and the previous hash."""
    body = {name: fields[name] for name in HASHED_FIELDS if name != "organization"}
    body["organization"] = organization_public_id
    created_at = body["created_at"]
    if isinstance(created_at, datetime):
        body["created_at"] = created_at.isoformat()
    return hashlib.sha256(canonical_json(body).encode()).hexdigest()
