"""Surface policy versions: one policy per surface (api, console, mcp) of an organization.

Immutable in the database as policy versions are (migration 0002): an ``UPDATE`` is always
refused and a ``DELETE`` passes only inside ``kestrel_one.common.erasure.erasing("policy")``.
"""

import django.db.models.deletion
import functools
import kestrel_one.common.ids
from django.db import migrations, models


MESSAGE_UPDATE = "policy versions are immutable; publish a new version instead"
MESSAGE_DELETE = "a surface policy version is deleted only with its organization"

POSTGRESQL = [
    f"""
    CREATE FUNCTION kestrel_surface_policy_version_guard() RETURNS trigger
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
    CREATE TRIGGER surface_policy_version_immutable
    BEFORE UPDATE OR DELETE ON governance_surfacepolicyversion
    FOR EACH ROW EXECUTE FUNCTION kestrel_surface_policy_version_guard()
    """,
]
POSTGRESQL_REVERSE = [
    "DROP TRIGGER IF EXISTS surface_policy_version_immutable ON governance_surfacepolicyversion",
    "DROP FUNCTION IF EXISTS kestrel_surface_policy_version_guard()",
]
SQLITE = [
    f"""
    CREATE TRIGGER surface_policy_version_no_update
    BEFORE UPDATE ON governance_surfacepolicyversion
    BEGIN SELECT RAISE(ABORT, '{MESSAGE_UPDATE}'); END
    """,
    f"""
    CREATE TRIGGER surface_policy_version_delete_with_owner
    BEFORE DELETE ON governance_surfacepolicyversion
    WHEN NOT EXISTS (SELECT 1 FROM kestrel_erasure WHERE scope = 'policy')
    BEGIN SELECT RAISE(ABORT, '{MESSAGE_DELETE}'); END
    """,
]
SQLITE_REVERSE = [
    "DROP TRIGGER IF EXISTS surface_policy_version_no_update",
    "DROP TRIGGER IF EXISTS surface_policy_version_delete_with_owner",
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
        ("governance", "0003_policy_drafts"),
        ("tenancy", "0004_membership_auditor_role"),
    ]

    operations = [
        migrations.CreateModel(
            name="SurfacePolicyVersion",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                (
                    "public_id",
                    models.CharField(
                        default=functools.partial(
                            kestrel_one.common.ids.new_public_id, *("spv",), **{}
                        ),
                        editable=False,
                        max_length=40,
                        unique=True,
                    ),
                ),
                (
                    "surface",
                    models.CharField(
                        choices=[
                            ("api", "REST API"),
                            ("console", "Console"),
                            ("mcp", "MCP endpoint"),
                        ],
                        max_length=16,
                    ),
                ),
                ("document", models.JSONField()),
                ("sha256", models.CharField(max_length=64)),
                ("created_by", models.CharField(max_length=64)),
                ("created_at", models.DateTimeField(auto_now_add=True)),
                (
                    "organization",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="surface_policy_versions",
                        to="tenancy.organization",
                    ),
                ),
                (
                    "previous",
                    models.ForeignKey(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.DO_NOTHING,
                        related_name="+",
                        to="governance.surfacepolicyversion",
                    ),
                ),
            ],
            options={
                "indexes": [
                    models.Index(
                        fields=["organization", "surface", "-id"],
                        name="governance__organiz_5884d0_idx",
                    )
                ],
            },
        ),
        migrations.RunPython(
            _run({"postgresql": POSTGRESQL, "sqlite": SQLITE}),
            _run({"postgresql": POSTGRESQL_REVERSE, "sqlite": SQLITE_REVERSE}),
        ),
    ]
