"""Trimming the audit log by retention keeps what remains verifiable (AUD-6).

Time is explicit: records are written with a fixed clock, then trimmed as of a later one,
so nothing sleeps and nothing depends on when the test runs.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection

from kestrel_one.accounts.principal import system_principal
from kestrel_one.audit.models import AuditChain, AuditRecord
from kestrel_one.audit.selectors import audit_chain_verify
from kestrel_one.audit.services import audit_trim
from tests.audit.helpers import append_records, tampering
from tests.factories import OrganizationFactory

JAN = datetime(2026, 1, 1, tzinfo=UTC)
SWEEPER = system_principal("retention")


@pytest.fixture
def clock(monkeypatch):
    """A settable clock for everything that asks django.utils.timezone.now()."""
    now = {"value": JAN}
    monkeypatch.setattr("django.utils.timezone.now", lambda: now["value"])
    return now


@pytest.fixture
def dated_chain(db, clock):
    """30 records a day for 10 days from 1 January."""
    organization = OrganizationFactory(slug="dated")
    for day in range(10):
        clock["value"] = JAN + timedelta(days=day, hours=9)
        append_records(organization, 30, start=day * 30)
    return organization


def records(organization):
    return AuditRecord.objects.filter(organization=organization).order_by("sequence")


@pytest.mark.spec("AUD-6", "AUD-1")
def test_trim_removes_only_what_expired_and_the_rest_verifies(dated_chain, clock):
    clock["value"] = JAN + timedelta(days=12)
    cutoff = JAN + timedelta(days=4)
    sweep = audit_trim(organization=dated_chain, actor=SWEEPER, before=cutoff)

    remaining = list(records(dated_chain))
    assert all(record.created_at >= cutoff for record in remaining), "nothing past retention"
    assert remaining[0].sequence == 4 * 30 + 1
    assert remaining[-1] == sweep
    assert sweep.action == "audit.trim" and sweep.data["deleted"] == 120
    chain = AuditChain.objects.get(organization=dated_chain)
    assert (chain.anchor_sequence, sweep.data["anchor"]["sequence"]) == (120, 120)
    result = audit_chain_verify(dated_chain)
    assert result.ok, result.summary()
    assert result.records == 10 * 30 - 120 + 1
    assert "after anchor #120" in result.summary()


@pytest.mark.spec("AUD-6", "AUD-1")
def test_repeated_sweeps_each_audited_and_the_chain_still_verifies(dated_chain, clock):
    for day in (3, 3, 6, 9):
        clock["value"] = JAN + timedelta(days=day + 30)
        audit_trim(organization=dated_chain, actor=SWEEPER, before=JAN + timedelta(days=day))
        assert audit_chain_verify(dated_chain).ok
        # New records keep arriving between sweeps.
        append_records(dated_chain, 3)
    sweeps = list(records(dated_chain).filter(action="audit.trim").values_list("data", flat=True))
    # Every sweep is in the log (they are newer than any cutoff here); the last one names
    # the anchor. The second sweep at day 3 found nothing left to delete.
    assert [data["deleted"] for data in sweeps] == [90, 0, 90, 90]
    assert sweeps[-1]["anchor"]["sequence"] == 9 * 30
    assert audit_chain_verify(dated_chain).ok


@pytest.mark.spec("AUD-6", "AUD-1")
def test_trimming_everything_leaves_a_verifiable_sweep_record(dated_chain, clock):
    clock["value"] = JAN + timedelta(days=400)
    audit_trim(organization=dated_chain, actor=SWEEPER, before=JAN + timedelta(days=365))
    [only] = records(dated_chain)
    assert only.action == "audit.trim" and only.data["deleted"] == 300
    assert audit_chain_verify(dated_chain).ok


@pytest.mark.spec("AUD-1", "AUD-6")
def test_a_moved_anchor_hiding_deleted_records_is_detected(dated_chain, clock):
    clock["value"] = JAN + timedelta(days=20)
    audit_trim(organization=dated_chain, actor=SWEEPER, before=JAN + timedelta(days=2))
    # Someone deletes ten more old records and moves the anchor to match, in SQL.
    tenth = records(dated_chain)[9]
    with tampering(), connection.cursor() as cursor:
        cursor.execute(
            "DELETE FROM audit_auditrecord WHERE organization_id = %s AND sequence <= %s",
            [dated_chain.pk, tenth.sequence],
        )
        cursor.execute(
            "UPDATE audit_auditchain SET anchor_sequence = %s, anchor_hash = %s "
            "WHERE organization_id = %s",
            [tenth.sequence, tenth.hash, dated_chain.pk],
        )
    result = audit_chain_verify(dated_chain)
    assert not result.ok
    assert "no trim record names that anchor" in result.reason


def test_a_record_created_late_stops_the_cut_so_no_gap_opens(db, clock):
    organization = OrganizationFactory(slug="skewed")
    append_records(organization, 5)
    clock["value"] = JAN + timedelta(days=5)
    append_records(organization, 1)  # #6 is new
    clock["value"] = JAN + timedelta(days=1)
    append_records(organization, 2)  # #7, #8 carry an older time (a skewed clock)
    clock["value"] = JAN + timedelta(days=30)
    audit_trim(organization=organization, actor=SWEEPER, before=JAN + timedelta(days=3))
    assert records(organization).first().sequence == 6, "only the prefix before #6 went"
    assert audit_chain_verify(organization).ok
