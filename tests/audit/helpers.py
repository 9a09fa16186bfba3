"""Building audit chains for the audit tests."""

from __future__ import annotations

from django.db import transaction

from kestrel_one.accounts.principal import system_principal
from kestrel_one.audit.services import audit_chain_settle, audit_record

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
