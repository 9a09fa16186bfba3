"""Records are written pending and chained after their transaction commits, in batches.

These tests commit for real (``transaction=True``) where the commit hook is what they
check; elsewhere they stand in for a process that died between its commit and its hook.
"""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection, transaction

from kestrel_one.accounts.principal import system_principal
from kestrel_one.audit.models import AuditChain, AuditRecord
from kestrel_one.audit.selectors import audit_chain_verify
from kestrel_one.audit.services import CHAIN_BATCH, audit_chain_settle, audit_record
from kestrel_one.audit.tasks import chain_pending
from tests.audit.helpers import append_records, tampering
from tests.factories import OrganizationFactory

ACTOR = system_principal("tests")


def write(organization, action: str = "test.write") -> AuditRecord:
    with transaction.atomic():
        return audit_record(organization=organization, actor=ACTOR, action=action)


def head(organization) -> tuple[int, str]:
    chain = AuditChain.objects.get(organization=organization)
    return chain.last_sequence, chain.last_hash


@pytest.mark.spec("AUD-1")
@pytest.mark.django_db(transaction=True)
def test_a_record_is_pending_inside_its_transaction_and_chained_when_it_commits():
    organization = OrganizationFactory(slug="commits")
    before, _ = head(organization)
    with transaction.atomic():
        record = audit_record(organization=organization, actor=ACTOR, action="test.write")
        stored = AuditRecord.objects.get(pk=record.pk)
        assert (stored.sequence, stored.prev_hash, stored.hash) == (None, "", "")
    record.refresh_from_db()
    assert record.sequence == before + 1
    assert head(organization) == (record.sequence, record.hash)
    result = audit_chain_verify(organization)
    assert result.ok and result.pending == 0, result.summary()


@pytest.mark.spec("AUD-1")
@pytest.mark.django_db(transaction=True)
def test_a_rolled_back_record_never_reaches_the_chain():
    organization = OrganizationFactory(slug="rollback")
    before = head(organization)
    with pytest.raises(RuntimeError), transaction.atomic():
        audit_record(organization=organization, actor=ACTOR, action="test.undone")
        raise RuntimeError("the audited write failed")
    assert not AuditRecord.objects.filter(action="test.undone").exists()
    assert head(organization) == before
    assert audit_chain_verify(organization).ok


@pytest.mark.spec("AUD-1")
def test_pending_records_are_counted_not_checked_until_the_sweep_chains_them(world):
    # Inside the test's transaction no commit hook runs: like a process that died after
    # committing and before chaining.
    organization = world.org
    audit_chain_settle(organization)  # what the fixture wrote, also without a commit
    left = [write(organization, "test.left") for _ in range(3)]
    result = audit_chain_verify(organization)
    assert result.ok, result.summary()
    assert result.pending == 3
    assert "not chained yet" in result.summary()

    chain_pending()  # the beat task

    result = audit_chain_verify(organization)
    assert result.ok and result.pending == 0, result.summary()
    sequences = [AuditRecord.objects.get(pk=r.pk).sequence for r in left]
    assert sequences == sorted(sequences) and None not in sequences, "chained in write order"
    assert head(organization)[0] == result.last_sequence


@pytest.mark.spec("AUD-1")
def test_a_settle_chains_more_than_one_batch(world):
    organization = OrganizationFactory(slug="burst")
    with transaction.atomic():
        for index in range(CHAIN_BATCH + 20):
            audit_record(
                organization=organization, actor=ACTOR, action="test.burst", data={"i": index}
            )
    assert audit_chain_settle(organization) >= CHAIN_BATCH + 20
    result = audit_chain_verify(organization)
    assert result.ok and result.pending == 0, result.summary()


@pytest.mark.spec("AUD-1")
def test_clearing_a_chained_records_sequence_to_hide_it_is_detected(world):
    organization = OrganizationFactory(slug="hidden")
    records = append_records(organization, 6)
    with tampering(), connection.cursor() as cursor:
        cursor.execute(
            "UPDATE audit_auditrecord SET sequence = NULL WHERE id = %s", [records[2].pk]
        )
    result = audit_chain_verify(organization)
    assert not result.ok
    assert result.bad_sequence == records[3].sequence, result.summary()

    # Chaining it again does not repair the gap it left.
    audit_chain_settle(organization)
    assert not audit_chain_verify(organization).ok


@pytest.mark.spec("AUD-1")
def test_readers_chain_pending_records_first(world):
    organization = world.org
    written = write(organization, "test.just_written")

    listed = world["owner"].client().get("/api/v1/orgs/acme/audit?action=test.just_written")
    assert listed.status_code == 200, listed.content
    [item] = listed.json()["results"]
    assert item["id"] == written.public_id and item["sequence"] is not None

    write(organization, "test.before_verify")
    out = StringIO()
    call_command("audit_verify", "--org", "acme", stdout=out)
    assert "intact" in out.getvalue() and "not chained" not in out.getvalue()
