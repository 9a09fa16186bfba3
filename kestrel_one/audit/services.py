"""Writing audit records: always inside the caller's transaction, so a rollback leaves none."""

from __future__ import annotations

import hashlib
import json

from django.db import transaction
from django.utils import timezone

from kestrel_one.audit.models import AuditChain, AuditRecord
from kestrel_one.common import context
from kestrel_one.common.redaction import bounded

AUDIT_DATA_MAX_BYTES = 8192


def record_hash(record: AuditRecord, *, organization_public_id: str) -> str:
    """The chain hash binds every stored field of the record and the previous hash."""
    body = {
        "organization": organization_public_id,
        "sequence": record.sequence,
        "created_at": record.created_at.isoformat(),
        "actor_type": record.actor_type,
        "actor_id": record.actor_id,
        "action": record.action,
        "target_type": record.target_type,
        "target_id": record.target_id,
        "outcome": record.outcome,
        "data": record.data,
        "request_id": record.request_id,
        "source_address": record.source_address,
        "prev_hash": record.prev_hash,
        "public_id": record.public_id,
    }
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def audit_record(
    *,
    organization,
    actor,
    action: str,
    target=None,
    outcome: str = "success",
    data: dict | None = None,
) -> AuditRecord:
    """Append one record to the organization's chain (caller holds the transaction)."""
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("audit_record must run inside the audited write's transaction")
    chain, _ = AuditChain.objects.select_for_update().get_or_create(organization=organization)
    record = AuditRecord(
        organization=organization,
        sequence=chain.last_sequence + 1,
        created_at=timezone.now(),
        actor_type=actor.actor_type,
        actor_id=actor.actor_id,
        action=action,
        target_type=_target_type(target),
        target_id=getattr(target, "public_id", "") or "",
        outcome=outcome,
        data=bounded(data or {}, max_bytes=AUDIT_DATA_MAX_BYTES),
        request_id=context.request_id.get() or "",
        source_address=context.source_address.get() or "",
        prev_hash=chain.last_hash,
    )
    record.hash = record_hash(record, organization_public_id=organization.public_id)
    record.save()
    chain.last_sequence = record.sequence
    chain.last_hash = record.hash
    chain.save(update_fields=["last_sequence", "last_hash"])
    return record


def _target_type(target) -> str:
    if target is None:
        return ""
    return target._meta.model_name
