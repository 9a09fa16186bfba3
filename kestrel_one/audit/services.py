"""Writing audit records: always inside the caller's transaction, so a rollback leaves none.

Refusals are the one exception to "a refused request changes nothing": they are recorded in
their own transaction, and only in an organization the caller has proved it belongs to (a
member's token, or the full secret of a token the organization issued), so probing another
organization never writes into its log.
"""

from __future__ import annotations

import json
from datetime import datetime

import structlog
from django.db import transaction
from django.utils import timezone

from kestrel_one.audit.chain import GENESIS_HASH, HASHED_FIELDS, chain_hash
from kestrel_one.audit.models import AuditChain, AuditRecord
from kestrel_one.common import context
from kestrel_one.common.redaction import bounded, redact_text

AUDIT_DATA_MAX_BYTES = 8192
REFUSED = "refused"

logger = structlog.get_logger(__name__)


def record_hash(record: AuditRecord, *, organization_public_id: str) -> str:
    """The chain hash binds every stored field of the record and the previous hash."""
    fields = {name: getattr(record, name) for name in _STORED_FIELDS}
    return chain_hash(fields, organization_public_id=organization_public_id)


# The record's own fields that the hash binds; the organization is bound by its public id.
_STORED_FIELDS = tuple(name for name in HASHED_FIELDS if name != "organization")


def audit_record(
    *,
    organization,
    actor,
    action: str,
    target=None,
    outcome: str = "success",
    data: dict | None = None,
) -> AuditRecord:
    """Append one record to the organization's chain (caller holds the transaction).

    The head row is locked ``FOR UPDATE`` first, so concurrent appends to one organization
    queue behind each other: each takes the next sequence and links to the hash its
    predecessor committed, and the chain never forks.
    """
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
        data=_stored_data(data),
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


def _stored_data(data: dict | None) -> dict:
    # Round-trip through JSON so the value hashed now is exactly what jsonb hands back to
    # the verifier later (tuples become lists, odd types become strings).
    return json.loads(json.dumps(bounded(data or {}, max_bytes=AUDIT_DATA_MAX_BYTES), default=str))


def _target_type(target) -> str:
    if target is None:
        return ""
    return target._meta.model_name


def audit_refusal_record(*, organization, actor, action: str, target=None, data: dict) -> None:
    """Record a refused request in its own transaction, so the refusal's rollback keeps it.

    A failure to record is logged, never raised: the caller is already answering with a
    refusal, and turning it into a 500 would tell the caller more than the refusal does.
    """
    try:
        with transaction.atomic():
            audit_record(
                organization=organization,
                actor=actor,
                action=action,
                target=target,
                outcome=REFUSED,
                data=data,
            )
    except Exception:
        logger.exception("audit.refusal_not_recorded", action=action)


def audit_authorization_refusal(*, organization, actor, method: str, path: str, reason: str):
    """A member (or its token) asked for something its role or scopes do not allow: a 403."""
    audit_refusal_record(
        organization=organization,
        actor=actor,
        action="request.refused",
        data={"method": method, "path": redact_text(path)[:256], "reason": reason[:256]},
    )


def audit_authentication_failure(plaintext: str) -> None:
    """Record a failed sign-in with a token the organization really issued.

    Only the full secret of a known token counts: a wrong secret, an unknown key id or a
    malformed value is noise anyone can send, and recording it in the named organization
    would let outsiders write into (and flood) a log they cannot read.
    """
    from kestrel_one.accounts import tokens
    from kestrel_one.accounts.models import ApiToken
    from kestrel_one.accounts.principal import Principal, PrincipalKind

    key_id = tokens.parse_key_id(plaintext)
    if key_id is None:
        return
    token = ApiToken.objects.select_related("organization", "user").filter(key_id=key_id).first()
    if token is None or not tokens.matches(plaintext, token.secret_hash):
        return
    reason = _token_refusal_reason(token, now=timezone.now())
    if reason is None:
        return
    audit_refusal_record(
        organization=token.organization,
        actor=Principal(PrincipalKind.TOKEN, user=token.user, token=token),
        action="auth.refused",
        target=token,
        data={"reason": reason},
    )


def _token_refusal_reason(token, *, now: datetime) -> str | None:
    if token.revoked_at is not None:
        return "revoked"
    if token.expires_at <= now:
        return "expired"
    if token.user is not None and not token.user.is_active:
        return "user_inactive"
    return None


@transaction.atomic
def audit_trim(*, organization, actor, before: datetime) -> AuditRecord:
    """Delete the oldest records (those created before ``before``) and anchor what remains.

    Only a prefix of the chain is ever removed: the cut stops at the first record that is
    not yet due, so no gap opens in the middle. The chain head stores where the remaining
    chain now starts, and this sweep's own audit record, appended in the same transaction,
    repeats that anchor inside the hashed chain; the verifier accepts an anchor only when
    the latest trim record names it, so moving the anchor to hide deletions is detected.
    """
    chain, _ = AuditChain.objects.select_for_update().get_or_create(organization=organization)
    records = AuditRecord.objects.filter(
        organization=organization, sequence__gt=chain.anchor_sequence
    )
    first_kept = (
        records.filter(created_at__gte=before)
        .order_by("sequence")
        .values_list("sequence", flat=True)
    ).first()
    cut = (first_kept - 1) if first_kept is not None else chain.last_sequence
    deleted = 0
    if cut > chain.anchor_sequence:
        last_removed = records.get(sequence=cut)
        deleted, _ = records.filter(sequence__lte=cut).delete()
        chain.anchor_sequence = cut
        chain.anchor_hash = last_removed.hash
        chain.anchored_at = timezone.now()
        chain.save(update_fields=["anchor_sequence", "anchor_hash", "anchored_at"])
    return audit_record(
        organization=organization,
        actor=actor,
        action="audit.trim",
        outcome="success",
        data={
            "before": before.isoformat(),
            "deleted": deleted,
            "anchor": {"sequence": chain.anchor_sequence, "hash": chain.anchor_hash},
        },
    )


__all__ = [
    "GENESIS_HASH",
    "audit_authentication_failure",
    "audit_authorization_refusal",
    "audit_record",
    "audit_refusal_record",
    "audit_trim",
    "record_hash",
]
