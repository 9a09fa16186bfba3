"""Writing audit records: always inside the caller's transaction, so a rollback leaves none.

Refusals are the one exception to "a refused request changes nothing": they are recorded in
their own transaction, and only in an organization the caller has proved it belongs to (a
member's token, or the full secret of a token the organization issued), so probing another
organization never writes into its log.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta

import structlog
from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from kestrel_one.audit.chain import HASHED_FIELDS, chain_hash
from kestrel_one.audit.models import AuditChain, AuditRecord, organization_model
from kestrel_one.common import context
from kestrel_one.common.erasure import erasing
from kestrel_one.common.redaction import bounded, redact_text

AUDIT_DATA_MAX_BYTES = 8192
REFUSED = "refused"

logger = structlog.get_logger(__name__)


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
    """Write one record, pending, inside the caller's transaction; it is chained after commit.

    The insert takes no lock, so concurrent requests of one organization never queue behind
    each other's transactions. When the caller commits, the record is chained
    (:func:`audit_chain_settle`): it gets the next sequence and the hash that links it to
    its predecessor. A record rolled back with its write never reaches the chain.
    """
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("audit_record must run inside the audited write's transaction")
    record = AuditRecord.objects.create(
        organization=organization,
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
    )
    # robust: a failure to chain is logged, never turned into an error of the committed
    # write; the next commit or the sweep chains the record.
    transaction.on_commit(lambda: _chain_after_commit(organization), robust=True)
    return record


def audit_chain_settle(organization) -> int:
    """Chain the organization's pending records in the order they were written.

    One transaction per batch: lock the chain head, give each pending record the next
    sequence and its hash, move the head, commit. Many records share one lock and one
    commit, which is what lets appends outrun the single chain they feed. Every record
    committed before the call is chained when it returns. Returns how many it chained.
    """
    chained = 0
    for _ in range(SETTLE_MAX_ROUNDS):
        with transaction.atomic():
            count = _chain_pending(_lock_head(organization), organization)
        chained += count
        if count < CHAIN_BATCH:
            break
    return chained


def audit_chain_sweep() -> dict[str, int]:
    """Chain whatever a crashed process or a skipped settle left pending, in every organization."""
    pending = AuditRecord.objects.filter(sequence__isnull=True).values("organization_id")
    swept = {}
    for organization in organization_model().objects.filter(pk__in=pending):
        swept[organization.slug] = audit_chain_settle(organization)
    return swept


# A chaining transaction takes at most this many records, a settle at most this many
# transactions. Chaining after a commit, which can go on while others keep writing, stops
# after this long: the next commit or the periodic sweep chains what is left.
CHAIN_BATCH = 500
SETTLE_MAX_ROUNDS = 20
CHAINING_AFTER_COMMIT_SECONDS = 0.25
# Between two rounds of that, a pause that lets a few more commits arrive, so each chaining
# transaction carries more records (a group commit; about 10% more appends with 4 writers).
CHAINING_GATHER_SECONDS = 0.002


def _chain_after_commit(organization) -> None:
    """Chain what this commit wrote, unless another process is already chaining.

    The chaining process goes on while others keep committing, then checks for pending
    records again after it lets go; this commit came before that check, so its records are
    not left behind. While one process chains, the other writers pay one lock probe each
    instead of a chaining transaction.
    """
    if connection.vendor != "postgresql":  # SQLite serializes writers anyway
        audit_chain_settle(organization)
        return
    deadline = time.monotonic() + CHAINING_AFTER_COMMIT_SECONDS
    while True:
        if not _sql(_TRY_LOCK_SQL, [_CHAINING, organization.pk]):
            return
        try:
            # Go on while other writers keep committing: a round that found more than one
            # record found someone else's. A lone writer stops after its own, unpaused.
            while audit_chain_settle(organization) > 1 and time.monotonic() < deadline:
                time.sleep(CHAINING_GATHER_SECONDS)
        finally:
            _sql(_UNLOCK_SQL, [_CHAINING, organization.pk])
        if time.monotonic() >= deadline or not _sql(_PENDING_SQL, [organization.pk]):
            return


# The chaining path runs after every audited commit, so its fixed statements are plain SQL
# (no query to compile each time); the records themselves are read through the ORM, exactly
# as the verifier reads them, so both hash the same values.
_CHAINING = 0x6B31_4155  # session advisory lock namespace ("k1AU"); the key is the org's pk
_TRY_LOCK_SQL = "SELECT pg_try_advisory_lock(%s, %s)"
_UNLOCK_SQL = "SELECT pg_advisory_unlock(%s, %s)"
_PENDING_SQL = (
    "SELECT EXISTS (SELECT 1 FROM audit_auditrecord "
    "WHERE organization_id = %s AND sequence IS NULL)"
)
_HEAD_SQL = "SELECT id, last_sequence, last_hash FROM audit_auditchain WHERE organization_id = %s"
_MOVE_HEAD_SQL = "UPDATE audit_auditchain SET last_sequence = %s, last_hash = %s WHERE id = %s"
_LINK_SQL = (
    "UPDATE audit_auditrecord SET sequence = %s, prev_hash = %s, hash = %s "
    "WHERE id = %s AND sequence IS NULL"
)


def _sql(statement: str, params: list):
    """The first column of the first row of ``statement``, or None."""
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        row = cursor.fetchone()
    return row[0] if row else None


def _lock_head(organization) -> AuditChain:
    """The organization's chain head (its chaining fields), locked until the transaction ends.

    SQLite (single-host without PostgreSQL) has no row locks; it runs one writing transaction
    at a time, which serializes chaining just the same.
    """
    statement = _HEAD_SQL + (" FOR UPDATE" if connection.features.has_select_for_update else "")
    with connection.cursor() as cursor:
        cursor.execute(statement, [organization.pk])
        row = cursor.fetchone()
        if row is None:
            # Heads are made with their organization; this covers one made without.
            AuditChain.objects.get_or_create(organization=organization)
            cursor.execute(statement, [organization.pk])
            row = cursor.fetchone()
    head_id, last_sequence, last_hash = row
    return AuditChain(
        id=head_id, organization=organization, last_sequence=last_sequence, last_hash=last_hash
    )


def _chain_pending(head: AuditChain, organization) -> int:
    """Link the pending records (oldest write first) onto ``head``, which the caller locked."""
    rows = list(
        AuditRecord.objects.filter(organization=organization, sequence__isnull=True)
        .order_by("id")
        .values("id", *_STORED_FIELDS)[:CHAIN_BATCH]
    )
    if not rows:
        return 0
    linked = []
    for row in rows:
        row["sequence"] = head.last_sequence + 1
        row["prev_hash"] = head.last_hash
        row["hash"] = chain_hash(row, organization_public_id=organization.public_id)
        head.last_sequence, head.last_hash = row["sequence"], row["hash"]
        linked.append((row["sequence"], row["prev_hash"], row["hash"], row["id"]))
    with connection.cursor() as cursor:
        # One statement per record, sent together (psycopg pipelines executemany): several
        # times faster than bulk_update's CASE expressions at this batch size.
        cursor.executemany(_LINK_SQL, linked)
        cursor.execute(_MOVE_HEAD_SQL, [head.last_sequence, head.last_hash, head.id])
    return len(linked)


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

    At most ``settings.KESTREL_AUDIT_REFUSALS_PER_MINUTE`` such records per actor and kind in
    an organization: a caller that repeats a refused request in a loop (a leaked revoked
    token, a misconfigured script) must not grow the log without bound. Past that, the
    refusal is still answered the same; it is logged (``audit.refusals_capped``, once a minute
    per process) instead of recorded.

    A failure to record is logged, never raised: the caller is already answering with a
    refusal, and turning it into a 500 would tell the caller more than the refusal does.
    """
    if _refusals_capped(organization, actor.actor_id, action):
        return
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


REFUSAL_WINDOW = timedelta(minutes=1)
# (organization pk, actor id, action) -> the window in which this process last logged it.
_capped_logged: dict[tuple[int, str, str], int] = {}


def _refusals_capped(organization, actor_id: str, action: str) -> bool:
    """True once this actor's refusals of this kind filled the last minute's allowance."""
    now = timezone.now()
    recent = AuditRecord.objects.filter(
        organization=organization,
        created_at__gte=now - REFUSAL_WINDOW,
        actor_id=actor_id,
        action=action,
        outcome=REFUSED,
    )
    allowance = settings.KESTREL_AUDIT_REFUSALS_PER_MINUTE
    if recent[:allowance].count() < allowance:
        return False
    key, window = (organization.pk, actor_id, action), int(now.timestamp() // 60)
    if _capped_logged.get(key) != window:
        if len(_capped_logged) > 10_000:
            _capped_logged.clear()
        _capped_logged[key] = window
        logger.warning(
            "audit.refusals_capped",
            organization=organization.slug,
            actor=actor_id,
            action=action,
            per_minute=allowance,
        )
    return True


def audit_authorization_refusal(
    *, organization, actor, method: str, path: str, reason: str, policy_version: str = ""
):
    """A member (or its token) asked for something its role, scopes or policy do not allow:
    a 403 (``policy_version`` names the policy's versions when it was the policy)."""
    data = {"method": method, "path": redact_text(path)[:256], "reason": reason[:256]}
    if policy_version:
        data["policy_version"] = policy_version
    audit_refusal_record(
        organization=organization, actor=actor, action="request.refused", data=data
    )


@transaction.atomic
def audit_trim(*, organization, actor, before: datetime) -> AuditRecord:
    """Delete the oldest records (those created before ``before``) and anchor what remains.

    Only a prefix of the chain is ever removed: the cut stops at the first record that is
    not yet due, so no gap opens in the middle. The chain head stores where the remaining
    chain now starts, and this sweep's own audit record, appended in the same transaction,
    repeats that anchor inside the hashed chain; the verifier accepts an anchor only when
    the latest trim record names it, so moving the anchor to hide deletions is detected.
    Pending records are chained first, and the trim's record is chained before commit, so
    the anchor and the record naming it become visible together.
    """
    head = _lock_head(organization)
    while _chain_pending(head, organization) == CHAIN_BATCH:
        pass
    chain = AuditChain.objects.get(pk=head.pk)  # locked above; the anchor fields too
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
        # The one deletion the database lets through (audit migration 0005).
        with erasing("audit"):
            deleted, _ = records.filter(sequence__lte=cut).delete()
        chain.anchor_sequence = cut
        chain.anchor_hash = last_removed.hash
        chain.anchored_at = timezone.now()
        chain.save(update_fields=["anchor_sequence", "anchor_hash", "anchored_at"])
    record = audit_record(
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
    _chain_pending(chain, organization)
    record.refresh_from_db(fields=["sequence", "prev_hash", "hash"])
    return record


__all__ = [
    "audit_authorization_refusal",
    "audit_chain_settle",
    "audit_chain_sweep",
    "audit_record",
    "audit_refusal_record",
    "audit_trim",
]
