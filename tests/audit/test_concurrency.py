"""Four writers appending to one organization's chain at once against PostgreSQL.

Each writer is a real thread with its own database connection and its own transactions.
Records are chained after each commit by whichever writer gets the chaining lock; the
others skip, trusting it to look again, so this also checks that no record is left
unchained when the writers stop.
"""

from __future__ import annotations

import pytest
from django.db import transaction

from kestrel_one.accounts.principal import system_principal
from kestrel_one.audit.models import AuditRecord
from kestrel_one.audit.selectors import audit_chain_verify
from kestrel_one.audit.services import audit_record
from tests.factories import OrganizationFactory
from tests.support import at_once

WRITERS = 4
APPENDS_PER_WRITER = 40


@pytest.mark.spec("AUD-1")
@pytest.mark.django_db(transaction=True)
def test_four_concurrent_writers_never_fork_the_chain():
    organization = OrganizationFactory(slug="busy")

    def writer(number: int) -> None:
        actor = system_principal(f"writer-{number}")
        for index in range(APPENDS_PER_WRITER):
            with transaction.atomic():
                audit_record(
                    organization=organization,
                    actor=actor,
                    action="test.append",
                    data={"writer": number, "index": index},
                )

    at_once(WRITERS, writer)

    result = audit_chain_verify(organization)
    assert result.ok, result.summary()
    total = WRITERS * APPENDS_PER_WRITER
    assert result.records == total
    assert result.pending == 0, "every committed record was chained without a sweep"
    rows = list(
        AuditRecord.objects.filter(organization=organization)
        .order_by("sequence")
        .values_list("sequence", "prev_hash", "hash", "actor_id")
    )
    assert [row[0] for row in rows] == list(range(1, total + 1)), "no gaps, no duplicates"
    assert len({row[1] for row in rows}) == total, "no two records share a parent (no fork)"
    writers_seen = {row[3] for row in rows}
    assert writers_seen == {f"system:writer-{n}" for n in range(WRITERS)}
