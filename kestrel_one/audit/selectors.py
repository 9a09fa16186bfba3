"""Reading the audit log: verifying an organization's chain, and filtering its records."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db import connection, transaction

from kestrel_one.audit.chain import GENESIS_HASH, HASHED_FIELDS, chain_hash
from kestrel_one.audit.models import AuditChain, AuditRecord

TRIM_ACTION = "audit.trim"
_VERIFY_FIELDS = (*(name for name in HASHED_FIELDS if name != "organization"), "hash")


@dataclass(frozen=True)
class VerifyResult:
    """What a walk of one organization's chain found: intact, or the first bad record."""

    ok: bool
    organization: str
    records: int
    first_sequence: int | None
    last_sequence: int
    last_hash: str
    anchor_sequence: int
    # The first problem found: the sequence and public id of the record where the chain
    # stops verifying (None when the problem is the chain head itself), and why.
    bad_sequence: int | None = None
    bad_public_id: str | None = None
    reason: str = ""
    # Records committed but not chained yet (they have no sequence to check); a settle
    # (kestrel_one.audit.services.audit_chain_settle) chains them.
    pending: int = 0

    def summary(self) -> str:
        if self.ok:
            start = f"after anchor #{self.anchor_sequence}" if self.anchor_sequence else "from #1"
            pending = f", {self.pending} not chained yet" if self.pending else ""
            return (
                f"audit chain of {self.organization}: intact, {self.records} record(s) "
                f"{start} to #{self.last_sequence}, head {self.last_hash[:16]}{pending}"
            )
        where = (
            f"record #{self.bad_sequence} ({self.bad_public_id})"
            if self.bad_sequence is not None
            else "the chain head"
        )
        return f"audit chain of {self.organization}: BROKEN at {where}: {self.reason}"


def audit_chain_verify(organization) -> VerifyResult:
    """Walk the organization's records in sequence order and check everything that links them.

    Each record's hash is recomputed from its stored fields; each must link to its
    predecessor's hash and follow it by exactly one; the first must follow the anchor (or
    the genesis); the last must be the chain head, so dropping records from the end is
    caught; and an anchor is believed only when the latest ``audit.trim`` record in the
    verified chain names it. Editing, deleting, inserting or reordering any record
    therefore shows up as the first record where one of these stops holding.

    Outside a transaction the walk runs in one REPEATABLE READ snapshot, so records
    appended while it runs are neither half-seen nor mistaken for a broken head. Records
    not chained yet are counted as ``pending``, not checked: callers that want them
    checked settle the chain first (the ``audit_verify`` command does).
    """
    if connection.vendor == "postgresql" and not connection.in_atomic_block:
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            return _verify(organization)
    return _verify(organization)


def _verify(organization) -> VerifyResult:
    head = AuditChain.objects.filter(organization=organization).first()
    anchor_sequence = head.anchor_sequence if head else 0
    anchor_hash = head.anchor_hash if head else GENESIS_HASH
    head_sequence = head.last_sequence if head else 0
    head_hash = head.last_hash if head else GENESIS_HASH

    result = {
        "organization": organization.slug,
        "records": 0,
        "first_sequence": None,
        "last_sequence": head_sequence,
        "last_hash": head_hash,
        "anchor_sequence": anchor_sequence,
        "pending": AuditRecord.objects.filter(
            organization=organization, sequence__isnull=True
        ).count(),
    }

    def broken(reason: str, row: dict | None = None) -> VerifyResult:
        return VerifyResult(
            ok=False,
            bad_sequence=row["sequence"] if row else None,
            bad_public_id=row["public_id"] if row else None,
            reason=reason,
            **result,
        )

    expected_sequence = anchor_sequence + 1
    expected_prev = anchor_hash
    latest_trim_anchor = None
    rows = (
        AuditRecord.objects.filter(organization=organization, sequence__isnull=False)
        .order_by("sequence")
        .values(*_VERIFY_FIELDS)
        .iterator(chunk_size=2000)
    )
    for row in rows:
        if result["first_sequence"] is None:
            result["first_sequence"] = row["sequence"]
        if row["sequence"] != expected_sequence:
            what = "missing" if row["sequence"] > expected_sequence else "out of order"
            return broken(
                f"expected sequence {expected_sequence} here, found {row['sequence']} "
                f"(a record is {what})",
                row,
            )
        if row["prev_hash"] != expected_prev:
            return broken("prev_hash does not match the previous record's hash", row)
        recomputed = chain_hash(row, organization_public_id=organization.public_id)
        if recomputed != row["hash"]:
            return broken("stored fields do not match the record's hash (edited)", row)
        if row["action"] == TRIM_ACTION:
            anchor = row["data"].get("anchor") if isinstance(row["data"], dict) else None
            latest_trim_anchor = (row, anchor)
        result["records"] += 1
        expected_sequence += 1
        expected_prev = row["hash"]

    last_sequence = expected_sequence - 1
    if last_sequence != head_sequence or expected_prev != head_hash:
        return broken(
            f"the chain ends at #{last_sequence} but its head says #{head_sequence} "
            "(records were removed from or added to the end, or the head was edited)"
        )
    if anchor_sequence:
        named = latest_trim_anchor[1] if latest_trim_anchor else None
        if named != {"sequence": anchor_sequence, "hash": anchor_hash}:
            row = latest_trim_anchor[0] if latest_trim_anchor else None
            return broken(
                f"the chain starts after #{anchor_sequence}, but no trim record names that "
                "anchor (records were removed from the start)",
                row,
            )
    return VerifyResult(ok=True, **result)


def audit_records_chained(organization):
    """The organization's records that are in the chain (a record waiting to be chained has
    no sequence yet: readers settle the chain first, ``audit_chain_settle``). The API's audit
    list and the console's audit page read this."""
    return AuditRecord.objects.filter(organization=organization, sequence__isnull=False)


def audit_records_filter(
    queryset,
    *,
    actor: str | None = None,
    action: str | None = None,
    target: str | None = None,
    outcome: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
):
    """Narrow an (already organization-scoped) audit queryset by the API's filters.

    ``action`` ending in ``.*`` matches a family (``token.*``); ``since`` is inclusive and
    ``until`` exclusive, so consecutive windows never count a record twice.
    """
    if actor:
        queryset = queryset.filter(actor_id=actor)
    if action:
        if action.endswith(".*"):
            queryset = queryset.filter(action__startswith=action[:-1])
        else:
            queryset = queryset.filter(action=action)
    if target:
        queryset = queryset.filter(target_id=target)
    if outcome:
        queryset = queryset.filter(outcome=outcome)
    if since is not None:
        queryset = queryset.filter(created_at__gte=since)
    if until is not None:
        queryset = queryset.filter(created_at__lt=until)
    return queryset
