"""Celery tasks and management commands act only within the organization they are given.

The API's walkers prove this for every route; these are the other surfaces of TEN-1. Each
test snapshots the other organization, runs the job for one, and finds the other unchanged.
"""

from __future__ import annotations

import itertools
import json
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import transaction
from rest_framework.test import APIClient

from kestrel_one.accounts.models import ApiToken
from kestrel_one.accounts.principal import system_principal
from kestrel_one.audit.models import AuditRecord
from kestrel_one.audit.services import audit_record
from kestrel_one.audit.tasks import chain_pending
from kestrel_one.tenancy.models import Membership
from tests.audit.helpers import append_records

pytestmark = pytest.mark.spec("TEN-1")


def snapshot(organization) -> dict:
    """What a job for another organization must leave exactly as it was."""
    return {
        "members": sorted(
            Membership.objects.filter(organization=organization).values_list(
                "user__email", "role", "all_projects"
            )
        ),
        "tokens": sorted(
            ApiToken.objects.filter(organization=organization).values_list("pk", "revoked_at")
        ),
        "audit": sorted(
            AuditRecord.objects.filter(organization=organization).values_list(
                "pk", "sequence", "hash"
            )
        ),
    }


def test_member_add_changes_only_the_organization_it_names(world, settings):
    settings.KESTREL_PUBLIC_URL = "https://kestrel.example.com"
    before = snapshot(world.other_org)
    out = StringIO()
    call_command("member_add", org="acme", email="newcomer@example.com", role="viewer", stdout=out)
    assert '"org": "acme"' in out.getvalue()
    assert Membership.objects.filter(
        organization=world.org, user__email="newcomer@example.com", role="viewer"
    ).exists()
    assert not Membership.objects.filter(
        organization=world.other_org, user__email="newcomer@example.com"
    ).exists()
    assert snapshot(world.other_org) == before


def test_bootstrap_of_one_org_leaves_the_other_alone(world):
    before = snapshot(world.other_org)
    out = StringIO()
    call_command("bootstrap", org="acme", email="owner2@example.com", stdout=out)
    assert snapshot(world.other_org) == before
    printed = json.loads(out.getvalue())
    assert printed["org"] == "acme"
    # The token it printed works for acme and is refused by globex.
    client = APIClient(REMOTE_ADDR="203.0.113.7")
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {printed['token']}")
    assert client.get("/api/v1/orgs/acme").status_code == 200
    assert client.get("/api/v1/orgs/globex").status_code == 404


def test_audit_verify_reads_only_the_organization_it_names(world):
    append_records(world.org, 3)
    append_records(world.other_org, 7)
    out = StringIO()
    call_command("audit_verify", org="acme", stdout=out)
    acme = AuditRecord.objects.filter(organization=world.org).count()
    assert acme != AuditRecord.objects.filter(organization=world.other_org).count()
    assert f"audit chain of acme: intact, {acme} record(s)" in out.getvalue()


def test_the_chain_task_chains_each_organization_into_its_own_chain(world):
    # Records left pending, as by a process that died between its commit and its settle
    # (inside the test's transaction no commit hook chains them).
    for organization, count in ((world.org, 4), (world.other_org, 2)):
        for index in range(count):
            with transaction.atomic():
                audit_record(
                    organization=organization,
                    actor=system_principal("tests"),
                    action="project.update",
                    data={"index": index},
                )
    assert AuditRecord.objects.filter(sequence__isnull=True).count() >= 6
    chain_pending.apply()
    for organization in (world.org, world.other_org):
        records = list(AuditRecord.objects.filter(organization=organization).order_by("sequence"))
        assert [r.sequence for r in records] == list(range(1, len(records) + 1))
        # Each link points at the previous record of the same organization, never the other's.
        for previous, record in itertools.pairwise(records):
            assert record.prev_hash == previous.hash
