# ruff: noqa: S608 - the SQL is built from this file's own table names.
"""Run inside a single-host process (SQLite) by test_append_only: try every write the
database must refuse, and the paths it must let through, and print what happened as JSON."""

from __future__ import annotations

import json

from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from kestrel_one.accounts.principal import system_principal
from kestrel_one.audit.models import AuditRecord
from kestrel_one.audit.selectors import audit_chain_verify
from kestrel_one.audit.services import audit_chain_settle, audit_record, audit_trim
from kestrel_one.governance.models import PolicyVersion
from kestrel_one.governance.services import policy_publish_environment, policy_publish_project
from kestrel_one.tenancy.models import Environment, Organization, Project
from kestrel_one.tenancy.services import project_delete

ACTOR = system_principal("tests")
POLICY = {"capabilities": {"fs.read": {"paths": ["**"]}}}
NARROWER = {"capabilities": {"fs.read": {"paths": ["src/**"]}}}


def attempt(statement: str, params=()) -> str:
    """'refused: ...' when the database refuses the statement, else how many rows it hit."""
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(statement, params)
            return f"changed {cursor.rowcount}"
    except DatabaseError as error:
        return f"refused: {error}"


def main() -> None:
    assert connection.vendor == "sqlite", connection.vendor
    organization = Organization.objects.create(slug="lite", name="Lite")
    for index in range(5):
        with transaction.atomic():
            audit_record(organization=organization, actor=ACTOR, action="test.x", data={"i": index})
    audit_chain_settle(organization)
    records = AuditRecord._meta.db_table
    chained = AuditRecord.objects.get(organization=organization, sequence=3)
    outcome = {
        "chained": audit_chain_verify(organization).ok,
        "update_data": attempt(f"UPDATE {records} SET data = '{{}}' WHERE id = %s", [chained.pk]),
        "update_hash": attempt(
            f"UPDATE {records} SET hash = 'x', prev_hash = 'y' WHERE id = %s", [chained.pk]
        ),
        "unchain": attempt(f"UPDATE {records} SET sequence = NULL WHERE id = %s", [chained.pk]),
        "delete": attempt(f"DELETE FROM {records} WHERE id = %s", [chained.pk]),
        "insert_chained": attempt(
            f"INSERT INTO {records} (public_id, organization_id, sequence, created_at, "
            "actor_type, actor_id, action, target_type, target_id, outcome, data, request_id, "
            "source_address, prev_hash, hash) VALUES ('aud_forged', %s, 99, %s, 'system', "
            "'x', 'x', '', '', 'success', '{}', '', '', 'p', 'h')",
            [organization.pk, timezone.now().isoformat()],
        ),
    }
    # Retention's trim deletes, and the chain still verifies; afterwards no delete passes.
    with transaction.atomic():
        trim = audit_trim(organization=organization, actor=ACTOR, before=timezone.now())
    outcome["trimmed"] = trim.data["deleted"]
    outcome["after_trim"] = audit_chain_verify(organization).ok
    outcome["delete_after_trim"] = attempt(f"DELETE FROM {records}")

    environment = Environment.objects.create(organization=organization, name="env")
    policy_publish_environment(actor=ACTOR, environment=environment, document=POLICY)
    project = Project.objects.create(organization=organization, environment=environment, name="p")
    policy_publish_project(actor=ACTOR, project=project, document=POLICY)
    version = policy_publish_project(actor=ACTOR, project=project, document=NARROWER)
    versions = PolicyVersion._meta.db_table
    outcome["policy_update"] = attempt(
        f"UPDATE {versions} SET document = '{{}}' WHERE id = %s", [version.pk]
    )
    outcome["policy_delete"] = attempt(f"DELETE FROM {versions} WHERE id = %s", [version.pk])
    project_delete(actor=ACTOR, project=Project.objects.get(pk=project.pk))
    outcome["project_versions_left"] = PolicyVersion.objects.filter(project_id=project.pk).count()
    outcome["environment_versions_left"] = PolicyVersion.objects.filter(
        environment=environment
    ).count()
    print(json.dumps(outcome))
