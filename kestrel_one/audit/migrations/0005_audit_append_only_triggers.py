"""Audit records are append-only in the database, not only in the application (AUD-1).

Triggers on ``audit_auditrecord``, on PostgreSQL and on SQLite alike:

- an ``INSERT`` adds a pending record (no sequence, no hashes): only the audit service's
  chaining gives a record its place in the chain;
- an ``UPDATE`` may only chain a pending record: set its ``sequence``, ``prev_hash`` and
  ``hash`` while every other column stays as it was; a chained record never changes;
- a ``DELETE`` happens only inside ``kestrel_one.common.erasure.erasing("audit")``, which
  retention's trim (``audit_trim``) alone uses.

The erasure permission is transaction-local: a ``set_config(..., true)`` setting on
PostgreSQL, a row of ``kestrel_erasure`` written and removed inside the transaction on
SQLite (made here). ``TRUNCATE`` (what a test database flush uses) fires no row trigger; a
truncated log is caught by a signed head (``audit_verify --head``).
"""

from django.db import migrations

MESSAGE_INSERT = (
    "audit records are appended pending; only the audit service gives one its place in the chain"
)
MESSAGE_UPDATE = "audit records are append-only: a chained record never changes"
MESSAGE_DELETE = "audit records are append-only: only the retention trim deletes them"

POSTGRESQL = [
    f"""
    CREATE FUNCTION kestrel_audit_record_guard() RETURNS trigger
    LANGUAGE plpgsql AS $$
    DECLARE
        unchained audit_auditrecord;
    BEGIN
        IF TG_OP = 'INSERT' THEN
            IF NEW.sequence IS NULL AND NEW.prev_hash = '' AND NEW.hash = '' THEN
                RETURN NEW;
            END IF;
            RAISE EXCEPTION USING ERRCODE = 'integrity_constraint_violation',
                MESSAGE = '{MESSAGE_INSERT}';
        ELSIF TG_OP = 'UPDATE' THEN
            -- The row as it would be without the chaining columns: every column the table
            -- has, now or later, must be unchanged.
            unchained := NEW;
            unchained.sequence := OLD.sequence;
            unchained.prev_hash := OLD.prev_hash;
            unchained.hash := OLD.hash;
            IF OLD.sequence IS NULL AND NEW.sequence IS NOT NULL
                    AND unchained IS NOT DISTINCT FROM OLD THEN
                RETURN NEW;
            END IF;
            RAISE EXCEPTION USING ERRCODE = 'integrity_constraint_violation',
                MESSAGE = '{MESSAGE_UPDATE} (' || OLD.public_id || ')';
        END IF;
        IF current_setting('kestrel.erase_audit', true) = 'on' THEN
            RETURN OLD;
        END IF;
        RAISE EXCEPTION USING ERRCODE = 'integrity_constraint_violation',
            MESSAGE = '{MESSAGE_DELETE} (' || OLD.public_id || ')';
    END;
    $$
    """,
    """
    CREATE TRIGGER audit_record_append_only
    BEFORE INSERT OR UPDATE OR DELETE ON audit_auditrecord
    FOR EACH ROW EXECUTE FUNCTION kestrel_audit_record_guard()
    """,
]
POSTGRESQL_REVERSE = [
    "DROP TRIGGER IF EXISTS audit_record_append_only ON audit_auditrecord",
    "DROP FUNCTION IF EXISTS kestrel_audit_record_guard()",
]

# Every column but the three chaining sets (SQLite has no row values to copy and compare).
_KEPT_COLUMNS = (
    "id",
    "public_id",
    "organization_id",
    "created_at",
    "actor_type",
    "actor_id",
    "action",
    "target_type",
    "target_id",
    "outcome",
    "data",
    "request_id",
    "source_address",
)
_UNCHANGED = " AND ".join(f"NEW.{column} IS OLD.{column}" for column in _KEPT_COLUMNS)

SQLITE = [
    "CREATE TABLE kestrel_erasure (scope TEXT NOT NULL)",
    f"""
    CREATE TRIGGER audit_record_insert_pending BEFORE INSERT ON audit_auditrecord
    WHEN NEW.sequence IS NOT NULL OR NEW.prev_hash <> '' OR NEW.hash <> ''
    BEGIN SELECT RAISE(ABORT, '{MESSAGE_INSERT}'); END
    """,
    f"""
    CREATE TRIGGER audit_record_update_chains_only BEFORE UPDATE ON audit_auditrecord
    WHEN NOT (OLD.sequence IS NULL AND NEW.sequence IS NOT NULL AND {_UNCHANGED})
    BEGIN SELECT RAISE(ABORT, '{MESSAGE_UPDATE}'); END
    """,
    f"""
    CREATE TRIGGER audit_record_delete_by_retention BEFORE DELETE ON audit_auditrecord
    WHEN NOT EXISTS (SELECT 1 FROM kestrel_erasure WHERE scope = 'audit')
    BEGIN SELECT RAISE(ABORT, '{MESSAGE_DELETE}'); END
    """,
]
SQLITE_REVERSE = [
    "DROP TRIGGER IF EXISTS audit_record_insert_pending",
    "DROP TRIGGER IF EXISTS audit_record_update_chains_only",
    "DROP TRIGGER IF EXISTS audit_record_delete_by_retention",
    "DROP TABLE IF EXISTS kestrel_erasure",
]


def _run(statements: dict[str, list[str]]):
    def run(apps, schema_editor):
        vendor = schema_editor.connection.vendor
        if vendor not in statements:
            raise RuntimeError(f"no append-only guard for the {vendor} database")
        for statement in statements[vendor]:
            schema_editor.execute(statement)

    return run


class Migration(migrations.Migration):
    dependencies = [
        ("audit", "0004_pending_records"),
    ]

    operations = [
        migrations.RunPython(
            _run({"postgresql": POSTGRESQL, "sqlite": SQLITE}),
            _run({"postgresql": POSTGRESQL_REVERSE, "sqlite": SQLITE_REVERSE}),
        ),
    ]
