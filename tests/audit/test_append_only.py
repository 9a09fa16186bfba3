# ruff: noqa: S608 - the SQL is built from this file's own table names.
"""Audit records are append-only and policy versions immutable in the database itself.

Not only ``save()`` refuses: ``queryset.update()``, ``queryset.delete()``, bulk inserts and
raw SQL are refused by triggers, on PostgreSQL (this suite's database) and on SQLite (the
single-host default, in a process of its own). Retention's trim and deleting a project or an
environment with its versions are the paths that still delete.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from kestrel_one.accounts.principal import system_principal
from kestrel_one.audit.models import AuditRecord
from kestrel_one.audit.selectors import audit_chain_verify
from kestrel_one.audit.services import audit_record, audit_trim
from kestrel_one.common.erasure import erasing
from kestrel_one.governance.models import PolicyVersion
from kestrel_one.governance.services import policy_publish_project
from kestrel_one.tenancy.models import Project
from kestrel_one.tenancy.services import environment_delete, project_delete
from tests.audit.helpers import append_records
from tests.factories import EnvironmentFactory, OrganizationFactory, ProjectFactory

REPO = Path(__file__).resolve().parents[2]
RECORDS = AuditRecord._meta.db_table
VERSIONS = PolicyVersion._meta.db_table
ACTOR = system_principal("tests")
POLICY = {"capabilities": {"fs.read": {"paths": ["**"]}}}
NARROWER = {"capabilities": {"fs.read": {"paths": ["src/**"]}}}


def refused(write, match: str) -> None:
    """``write`` fails in the database, and leaves the test's transaction usable."""
    with pytest.raises(IntegrityError, match=match), transaction.atomic():
        write()


def sql(statement: str, params=()) -> None:
    with connection.cursor() as cursor:
        cursor.execute(statement, params)


@pytest.mark.spec("AUD-1")
def test_a_chained_record_cannot_be_changed_or_deleted(db):
    organization = OrganizationFactory()
    records = append_records(organization, 5)
    target = records[2]
    where = "WHERE id = %s"
    for change in (
        "data = '{}'::jsonb",
        "action = 'token.revoke'",
        "created_at = created_at - interval '1 day'",
        "hash = 'x', prev_hash = 'y'",
        "sequence = NULL",
        "sequence = sequence + 100",
        "organization_id = organization_id",  # even a no-op write of a chained row
    ):
        refused(lambda c=change: sql(f"UPDATE {RECORDS} SET {c} {where}", [target.pk]), "append")
    refused(lambda: sql(f"DELETE FROM {RECORDS} {where}", [target.pk]), "only the retention")
    queryset = AuditRecord.objects.filter(organization=organization)
    refused(lambda: queryset.update(outcome="success"), "append-only")
    refused(lambda: queryset.filter(sequence__gte=4).delete(), "only the retention trim")
    assert audit_chain_verify(organization).ok
    assert queryset.count() == 5


@pytest.mark.spec("AUD-1")
def test_records_are_appended_pending_and_only_chaining_completes_them(db):
    organization = OrganizationFactory()
    [chained] = append_records(organization, 1)
    with transaction.atomic():
        pending = audit_record(organization=organization, actor=ACTOR, action="test.pending")
    # A pending record's content is as fixed as a chained one's; only its place is not.
    refused(
        lambda: AuditRecord.objects.filter(pk=pending.pk).update(data={"forged": True}), "append"
    )
    refused(
        lambda: AuditRecord.objects.filter(pk=pending.pk).update(
            sequence=2, prev_hash=chained.hash, hash="0" * 64, action="token.revoke"
        ),
        "append-only",
    )
    # A record cannot be inserted with a place in the chain (a forged record).
    forged = AuditRecord(
        organization=organization,
        created_at=timezone.now(),
        actor_type="system",
        actor_id="system:forger",
        action="token.create",
        sequence=2,
        prev_hash=chained.hash,
        hash="f" * 64,
    )
    refused(lambda: AuditRecord.objects.bulk_create([forged]), "appended pending")


@pytest.mark.spec("AUD-1", "AUD-6")
def test_the_retention_trim_is_the_one_way_records_leave(db):
    organization = OrganizationFactory()
    append_records(organization, 6)
    with transaction.atomic():
        trim = audit_trim(organization=organization, actor=ACTOR, before=timezone.now())
    assert trim.data["deleted"] == 6
    assert audit_chain_verify(organization).ok
    # The permission ended with the trim: the trim's own record cannot be deleted after it.
    refused(lambda: AuditRecord.objects.filter(pk=trim.pk).delete(), "only the retention trim")
    # A failed block withdraws the permission even when the caller goes on.
    with transaction.atomic():
        with pytest.raises(ZeroDivisionError), erasing("audit"):
            1 / 0  # noqa: B018
        refused(lambda: AuditRecord.objects.filter(pk=trim.pk).delete(), "only the retention")


@pytest.mark.spec("POL-6")
def test_a_policy_version_is_immutable_and_leaves_only_with_its_owner(world):
    project = world.project
    first = policy_publish_project(actor=ACTOR, project=project, document=POLICY)
    current = policy_publish_project(actor=ACTOR, project=project, document=NARROWER)
    where = "WHERE id = %s"
    for change in ("document = '{}'::jsonb", "sha256 = md5('x')", "project_id = project_id"):
        refused(lambda c=change: sql(f"UPDATE {VERSIONS} SET {c} {where}", [current.pk]), "immu")
    refused(lambda: PolicyVersion.objects.filter(pk=first.pk).update(created_by="x"), "immutable")
    # Deleting the project's current version would leave it on the environment's wider one.
    refused(lambda: sql(f"DELETE FROM {VERSIONS} {where}", [current.pk]), "only with its")
    refused(lambda: PolicyVersion.objects.filter(pk=current.pk).delete(), "only with its")
    project.refresh_from_db()
    assert project.policy_version_id == current.pk

    project_delete(actor=ACTOR, project=project)
    assert not Project.objects.filter(pk=project.pk).exists()
    assert not PolicyVersion.objects.filter(pk__in=[first.pk, current.pk]).exists()


@pytest.mark.spec("POL-6")
def test_an_environment_takes_its_versions_with_it(db):
    from kestrel_one.governance.services import policy_publish_environment

    environment = EnvironmentFactory()
    for document in (POLICY, NARROWER):
        policy_publish_environment(actor=ACTOR, environment=environment, document=document)
    environment_delete(actor=ACTOR, environment=environment)
    assert not PolicyVersion.objects.filter(environment_id=environment.pk).exists()
    # A project's versions stay while the project does.
    project = ProjectFactory()
    policy_publish_environment(actor=ACTOR, environment=project.environment, document=POLICY)
    policy_publish_project(actor=ACTOR, project=project, document=NARROWER)
    refused(lambda: PolicyVersion.objects.filter(project=project).delete(), "only with its")


@pytest.mark.spec("AUD-1", "POL-6")
def test_single_host_sqlite_refuses_the_same_writes(tmp_path):
    """Migrations on a fresh SQLite file, then every refused write and allowed path."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("DATABASE_URL", "KESTREL_", "DJANGO_"))
    }
    env.update(
        DJANGO_SETTINGS_MODULE="kestrel_one.settings",
        KESTREL_MODE="single-host",
        KESTREL_DATA_DIR=str(tmp_path / "data"),
        PYTHONPATH=str(REPO),
    )

    def manage(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )

    migrated = manage("migrate", "--noinput")
    assert migrated.returncode == 0, migrated.stderr
    ran = manage("shell", "-c", "from tests.audit.sqlite_guards import main; main()")
    assert ran.returncode == 0, ran.stderr
    outcome = json.loads(ran.stdout.strip().splitlines()[-1])
    assert outcome["chained"] is True
    for name in ("update_data", "update_hash", "unchain"):
        assert outcome[name].startswith("refused: audit records are append-only"), outcome
    assert outcome["delete"].startswith("refused: audit records are append-only: only the")
    assert outcome["insert_chained"].startswith("refused: audit records are appended pending")
    assert outcome["trimmed"] == 5
    assert outcome["after_trim"] is True
    assert outcome["delete_after_trim"].startswith("refused: audit records are append-only")
    assert outcome["policy_update"].startswith("refused: policy versions are immutable")
    assert outcome["policy_delete"].startswith("refused: a policy version is deleted only")
    assert outcome["project_versions_left"] == 0
    assert outcome["environment_versions_left"] == 1
