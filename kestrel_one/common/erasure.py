"""The one way past the database's guard on rows it keeps: audit records and policy versions.

Audit records are append-only and policy versions immutable in the database itself, not only
in ``save()``: triggers (``audit`` migration 0005, ``governance`` migration 0002) refuse an
``UPDATE`` or ``DELETE`` that does not come from the path allowed to make it, whether it is
sent by ``queryset.update()``, ``queryset.delete()`` or raw SQL. Deleting is allowed only
inside :func:`erasing`, which the paths that legitimately delete use: retention's audit trim
(``audit``), and deleting a project or an environment together with its policy versions
(``policy``).

The permission is local to the caller's transaction, so it ends with it, commit or rollback,
and no other connection ever sees it: on PostgreSQL a transaction-local setting
(``set_config('kestrel.erase_SCOPE', 'on', true)``) the trigger reads; on SQLite a row of
``kestrel_erasure`` written and removed inside the transaction (SQLite runs one writing
transaction at a time, and nobody reads an uncommitted row).

This guards against the application's own mistakes and ad hoc SQL. Someone who can drop a
trigger can rewrite anything; the signed audit heads (``kestrel_one.audit.heads``) are what
catch that.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.db import connection, transaction

SCOPES = frozenset({"audit", "policy"})
# SQLite: the table the triggers look in (made by audit migration 0005).
SQLITE_TABLE = "kestrel_erasure"


def setting_name(scope: str) -> str:
    """The PostgreSQL setting that lets the current transaction delete ``scope``'s rows."""
    return f"kestrel.erase_{scope}"


@contextmanager
def erasing(scope: str) -> Iterator[None]:
    """Let the current transaction delete the guarded rows of ``scope`` until the block ends."""
    if scope not in SCOPES:
        raise ValueError(f"unknown erasure scope {scope!r}")
    if not connection.in_atomic_block:
        raise RuntimeError("erasing() must run inside the deleting transaction")
    # A savepoint of its own: if the block fails, rolling it back withdraws the permission
    # too, even when the caller catches the error and commits the rest.
    with transaction.atomic():
        _set(scope, on=True)
        yield
        _set(scope, on=False)


def _set(scope: str, *, on: bool) -> None:
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT set_config(%s, %s, true)", [setting_name(scope), "on" if on else ""]
            )
        elif on:
            cursor.execute(f"INSERT INTO {SQLITE_TABLE} (scope) VALUES (%s)", [scope])  # noqa: S608
        else:
            cursor.execute(f"DELETE FROM {SQLITE_TABLE} WHERE scope = %s", [scope])  # noqa: S608
