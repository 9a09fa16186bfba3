# ruff: noqa: S608 - the tampering SQL is built from this file's own table and field names.
"""Tampering with any stored record, through SQL that bypasses the ORM, is detected (AUD-1).

A chain of a few hundred records is built once per test; each case edits one field of one
record, deletes one, inserts a forged one (with a correctly computed hash), swaps two, or
edits the chain head, then verifies and rolls back to a savepoint so the next case starts
from the intact chain.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from django.db import connection, transaction

from kestrel_one.audit.chain import chain_hash
from kestrel_one.audit.models import AuditChain, AuditRecord
from kestrel_one.audit.selectors import audit_chain_verify
from kestrel_one.common.ids import new_public_id
from tests.audit.helpers import append_records, tampering

RECORDS = AuditRecord._meta.db_table
CHAIN = AuditChain._meta.db_table
TEXT_FIELDS = (
    "public_id",
    "actor_type",
    "actor_id",
    "action",
    "target_type",
    "target_id",
    "outcome",
    "request_id",
    "source_address",
    "prev_hash",
    "hash",
)
EDITED_FIELDS = (*TEXT_FIELDS, "created_at", "data", "sequence", "organization_id")
CASES_PER_FIELD = 50
CASES_PER_STRUCTURAL_KIND = 100


@pytest.fixture
def chain(world):
    append_records(world.org, 300, target=world.project)
    # Another organization's chain, so moving a row there has somewhere to go.
    append_records(world.other_org, 5)
    assert audit_chain_verify(world.org).ok
    sequences = list(
        AuditRecord.objects.filter(organization=world.org)
        .order_by("sequence")
        .values_list("sequence", flat=True)
    )
    # Every case below changes rows as someone with the database's owner role could: with
    # the append-only guard switched off.
    with tampering():
        yield world, sequences


def sql(statement: str, params=()) -> int:
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return cursor.rowcount


def edit_field(org, sequence: int, field: str, rng: random.Random) -> int:
    where = "WHERE organization_id = %s AND sequence = %s"
    args = (org.pk, sequence)
    if field in TEXT_FIELDS:
        # Change one character at a random position (or add one to an empty value).
        position = rng.randint(1, 8)
        return sql(
            f"UPDATE {RECORDS} SET {field} = CASE WHEN length({field}) = 0 THEN 'x' "
            f"WHEN substr({field}, {position}, 1) = 'x' "
            f"THEN overlay({field} placing 'y' from {position} for 1) "
            f"ELSE overlay({field} placing 'x' from {position} for 1) END {where}",
            args,
        )
    if field == "created_at":
        shift = rng.choice(["1 microsecond", "1 second", "-3 days", "7 hours"])
        return sql(
            f"UPDATE {RECORDS} SET created_at = created_at + interval '{shift}' {where}", args
        )
    if field == "data":
        edit = rng.choice(
            [
                "jsonb_set(data, '{index}', '-1')",
                "jsonb_set(data, '{note}', '\"edited\"')",
                "data || '{\"added\": true}'",
                "data - 'nested'",
            ]
        )
        return sql(f"UPDATE {RECORDS} SET data = {edit} {where}", args)
    if field == "sequence":
        # Move the record to an unused sequence number (past the end or far away).
        target = rng.choice([10_000 + sequence, -sequence])
        return sql(f"UPDATE {RECORDS} SET sequence = %s {where}", (target, *args))
    if field == "organization_id":
        # Move the row into another organization's table space (an unused sequence there).
        other = AuditChain.objects.exclude(organization=org).first().organization_id
        return sql(
            f"UPDATE {RECORDS} SET organization_id = %s, sequence = sequence + 100000 {where}",
            (other, *args),
        )
    raise AssertionError(field)


def delete_record(org, sequence: int) -> int:
    return sql(
        f"DELETE FROM {RECORDS} WHERE organization_id = %s AND sequence = %s", (org.pk, sequence)
    )


def insert_forged(org, position: int, last: int) -> int:
    """Insert a record with a correct hash at ``position``, shifting later ones up by one."""
    if position <= last:
        sql(
            f"UPDATE {RECORDS} SET sequence = sequence + 1000000 "
            "WHERE organization_id = %s AND sequence >= %s",
            (org.pk, position),
        )
        sql(
            f"UPDATE {RECORDS} SET sequence = sequence - 999999 "
            "WHERE organization_id = %s AND sequence >= 1000000",
            (org.pk,),
        )
    previous = AuditRecord.objects.filter(organization=org, sequence=position - 1).first()
    head = AuditChain.objects.get(organization=org)
    prev_hash = previous.hash if previous else head.anchor_hash
    template = AuditRecord.objects.filter(organization=org).order_by("sequence").first()
    fields = {
        "sequence": position,
        "created_at": template.created_at,
        "actor_type": "system",
        "actor_id": "system:forger",
        "action": "token.create",
        "target_type": "",
        "target_id": "",
        "outcome": "success",
        "data": {"forged": True},
        "request_id": "",
        "source_address": "",
        "prev_hash": prev_hash,
        "public_id": new_public_id("aud"),
    }
    forged_hash = chain_hash(fields, organization_public_id=org.public_id)
    record = AuditRecord(organization=org, hash=forged_hash, **fields)
    # A bulk insert skips save() and any model logic, like raw SQL would.
    AuditRecord.objects.bulk_create([record])
    return 1


def swap_records(org, first: int, second: int) -> int:
    where = "WHERE organization_id = %s AND sequence = %s"
    sql(f"UPDATE {RECORDS} SET sequence = -1 {where}", (org.pk, first))
    sql(f"UPDATE {RECORDS} SET sequence = %s {where}", (first, org.pk, second))
    return sql(f"UPDATE {RECORDS} SET sequence = %s {where}", (second, org.pk, -1))


def edit_head(org, rng: random.Random) -> int:
    edit = rng.choice(
        [
            "last_sequence = last_sequence - 1",
            "last_sequence = last_sequence + 1",
            "last_hash = md5(last_hash) || md5(last_hash)",
            "anchor_sequence = 3, anchor_hash = md5('x') || md5('y')",
        ]
    )
    return sql(f"UPDATE {CHAIN} SET {edit} WHERE organization_id = %s", (org.pk,))


def tamper_cases(sequences: list[int], rng: random.Random):
    """(kind, detail, apply) for every case; apply(org) changes exactly one thing."""
    last = sequences[-1]
    for field in EDITED_FIELDS:
        for _ in range(CASES_PER_FIELD):
            sequence = rng.choice(sequences)
            yield (
                "edit",
                (field, sequence),
                lambda org, f=field, s=sequence: edit_field(org, s, f, rng),
            )
    for _ in range(CASES_PER_STRUCTURAL_KIND):
        sequence = rng.choice(sequences)
        yield "delete", sequence, lambda org, s=sequence: delete_record(org, s)
    for _ in range(CASES_PER_STRUCTURAL_KIND):
        position = rng.randint(sequences[0], last + 1)
        yield "insert", position, lambda org, p=position: insert_forged(org, p, last)
    for _ in range(CASES_PER_STRUCTURAL_KIND):
        first, second = sorted(rng.sample(sequences, 2))
        yield "swap", (first, second), lambda org, a=first, b=second: swap_records(org, a, b)
    for _ in range(20):
        yield "head", None, lambda org: edit_head(org, rng)


@pytest.mark.spec("AUD-1")
def test_every_single_record_tamper_is_detected(chain, capsys):
    world, sequences = chain
    org = world.org
    rng = random.Random(20261129)  # fixed seed: a failure reproduces
    kinds: Counter[str] = Counter()
    undetected = []
    for kind, detail, apply in tamper_cases(sequences, rng):
        with transaction.atomic():
            changed = apply(org)
            assert changed, (kind, detail)
            result = audit_chain_verify(org)
            transaction.set_rollback(True)
        kinds[kind] += 1
        if result.ok:
            undetected.append((kind, detail))
            continue
        # The verifier names where the damage is: the tampered record, its successor
        # (when the record itself vanished from its place), or the head at the end.
        if kind == "edit" and detail[0] not in {"sequence", "organization_id"}:
            assert result.bad_sequence == detail[1], (kind, detail, result)
        if kind == "swap":
            assert result.bad_sequence == detail[0], (kind, detail, result)
        if kind == "insert" and detail <= sequences[-1]:
            assert result.bad_sequence in {detail, detail + 1}, (kind, detail, result)
    assert not undetected, f"tampering not detected: {undetected[:10]}"
    total = sum(kinds.values())
    assert total >= 1000
    assert audit_chain_verify(org).ok, "every case was rolled back"
    with capsys.disabled():
        print(f"\naudit tamper cases: {total} detected ({dict(kinds)})")


@pytest.mark.spec("AUD-1")
def test_verify_names_the_first_bad_record(chain):
    world, sequences = chain
    target = sequences[120]
    edit_field(world.org, target, "data", random.Random(1))
    edit_field(world.org, sequences[200], "action", random.Random(2))
    result = audit_chain_verify(world.org)
    record = AuditRecord.objects.get(organization=world.org, sequence=target)
    assert not result.ok
    assert (result.bad_sequence, result.bad_public_id) == (target, record.public_id)
    assert "edited" in result.reason
    assert record.public_id in result.summary()


@pytest.mark.spec("AUD-1")
def test_truncating_the_end_is_detected_by_the_head(chain):
    world, sequences = chain
    for sequence in sequences[-3:]:
        delete_record(world.org, sequence)
    result = audit_chain_verify(world.org)
    assert not result.ok
    assert result.bad_sequence is None
    assert "head" in result.reason


def test_an_empty_chain_verifies(db):
    from tests.factories import OrganizationFactory

    organization = OrganizationFactory()
    result = audit_chain_verify(organization)
    assert result.ok and result.records == 0
