"""Policy versions are immutable in the database, not only in ``save()`` (POL-6).

Triggers on ``governance_policyversion``, on PostgreSQL and on SQLite alike: an ``UPDATE``
is always refused (a change is a new version), and a ``DELETE`` happens only inside
``kestrel_one.common.erasure.erasing("policy")``, which deleting a project or an environment
uses to take its versions with it. Deleting a project's current version on its own would
otherwise leave the project on its environment's wider policy.

``previous`` no longer nulls itself when the version it names is deleted (that was an
``UPDATE`` Django sent): a version's predecessor belongs to the same owner, so both always
go together, in one transaction, and the deferred foreign key sees neither.
"""

import django.db.models.deletion
from django.db import migrations, models

MESSAGE_UPDATE = "policy versions are immutable; publish a new version instead"
MESSAGE_DELETE = "a policy version is deleted only with its project or environment"

POSTGRESQL = [
    f"""
    CREATE FUNCTION kestrel_policy_version_guard() RETURNS trigger
    LANGUAGE plpgsql AS $$
    BEGIN
        IF TG_OP = 'UPDATE' THEN
            RAISE EXCEPTION USING ERRCODE = 'integrity_constraint_violation',
                MESSAGE = '{MESSAGE_UPDATE} (' || OLD.public_id || ')';
        END IF;
        IF current_setting('kestrel.erase_policy', true) = 'on' THEN
            RETURN OLD;
        END IF;
        RAISE EXCEPTION USING ERRCODE = 'integrity_constraint_violation',
            MESSAGE = '{MESSAGE_DELETE} (' || OLD.public_id || ')';
    END;
    $$
    """,
    """
    CREATE TRIGGER policy_version_immutable
    BEFORE UPDATE OR DELETE ON governance_policyversion
    FOR EACH ROW EXECUTE FUNCTION kestrel_policy_version_guard()
    """,
]
POSTGRESQL_REVERSE = [
    "DROP TRIGGER IF EXISTS policy_version_immutable ON governance_policyversion",
    "DROP FUNCTION IF EXISTS kestrel_policy_version_guard()",
]
SQLITE = [
    f"""
    CREATE TRIGGER policy_version_no_update BEFORE UPDATE ON governance_policyversion
    BEGIN SELECT RAISE(ABORT, '{MESSAGE_UPDATE}'); END
    """,
    f"""
    CREATE TRIGGER policy_version_delete_with_owner BEFORE DELETE ON governance_policyversion
    WHEN NOT EXISTS (SELECT 1 FROM kestrel_erasure WHERE scope = 'policy')
    BEGIN SELECT RAISE(ABORT, '{MESSAGE_DELETE}'); END
    """,
]
SQLITE_REVERSE = [
    "DROP TRIGGER IF EXISTS policy_version_no_update",
    "DROP TRIGGER IF EXISTS policy_version_delete_with_owner",
]


def _run(statements: dict[str, list[str]]):
    def run(apps, schema_editor):
        vendor = schema_editor.connection.vendor
        if vendor not in statements:
            raise RuntimeError(f"no immutability guard for the {vendor} database")
        for statement in statements[vendor]:
            schema_editor.execute(statement)

    return run


class Migration(migrations.Migration):
    dependencies = [
        ("governance", "0001_initial"),
        # kestrel_erasure, which the SQLite delete trigger reads.
        ("audit", "0005_audit_append_only_triggers"),
    ]

    operations = [
        migrations.AlterField(
            model_name="policyversion",
            name="previous",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.DO_NOTHING,
                related_name="+",
                to="governance.policyversion",
            ),
        ),
        migrations.RunPython(
            _run({"postgresql": POSTGRESQL, "sqlite": SQLITE}),
            _run({"postgresql": POSTGRESQL_REVERSE, "sqlite": SQLITE_REVERSE}),
        ),
    ]
