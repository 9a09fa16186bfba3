"""Building audit chains for the audit tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.db import connection, transaction

from kestrel_one.accounts.principal import system_principal
from kestrel_one.audit.services import audit_chain_settle, audit_record

# The triggers that keep audit records append-only and policy versions immutable
# (audit migration 0005, governance migration 0002).
GUARDS = {
    "audit_auditrecord": "audit_record_append_only",
    "governance_policyversion": "policy_version_immutable",
}


@contextmanager
def tampering() -> Iterator[None]:
    """Switch the database's append-only guards off, as someone with the database's owner
    role could, so a test can change rows the application never would (PostgreSQL)."""
    _switch_guards("DISABLE")
    try:
        yield
    finally:
        _switch_guards("ENABLE")


def _switch_guards(switch: str) -> None:
    with connection.cursor() as cursor:
        # ALTER TABLE waits for no deferred foreign-key check: run the pending ones now.
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
        for table, trigger in GUARDS.items():
            cursor.execute(f"ALTER TABLE {table} {switch} TRIGGER {trigger}")
        cursor.execute("SET CONSTRAINTS ALL DEFERRED")


ACTIONS = ("token.create", "project.update", "member.add", "policy.publish", "runner.revoke")


def append_records(organization, count: int, *, actor=None, target=None, start: int = 0):
    """Append ``count`` varied records, each in its own transaction like a real write.

    Inside a test's transaction no commit hook runs, so the records are chained here, as
    the hook would have after each commit.
    """
    actor = actor or system_principal("tests")
    records = []
    for index in range(start, start + count):
        with transaction.atomic():
            records.append(
                audit_record(
                    organization=organization,
                    actor=actor,
                    action=ACTIONS[index % len(ACTIONS)],
                    target=target if index % 3 == 0 else None,
                    outcome="refused" if index % 7 == 0 else "success",
                    data={"index": index, "note": f"record {index}", "nested": {"n": [index]}},
                )
            )
    audit_chain_settle(organization)
    for record in records:
        record.refresh_from_db(fields=["sequence", "prev_hash", "hash"])
    return records
