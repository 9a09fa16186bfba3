"""List endpoints at 1,000 and 100,000 rows, and the audit chain's append and verify rates.

Runs Django in this process against a PostgreSQL database made for the run (dropped after).
Rows are bulk-inserted with the ORM's ``bulk_create``, one organization per size; requests
go through Django's test client (the full middleware, authentication, DRF and serializer
path, without a socket), so the figure is the server's time for the page, not the network's.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

BATCH = 5_000


def setup_django(database_url: str, *, data_prefix: str = "kestrel-bench-db-") -> None:
    """Django in this process on ``database_url`` (migrated), single-host settings, a data
    folder of its own; the console pages bench uses it too."""
    os.environ.update(
        DJANGO_SETTINGS_MODULE="kestrel_one.settings",
        KESTREL_MODE="single-host",
        KESTREL_DATA_DIR=str(Path(tempfile.mkdtemp(prefix=data_prefix))),
        DATABASE_URL=database_url,
    )
    os.environ.pop("REDIS_URL", None)  # nothing here enqueues work
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", interactive=False, verbosity=0)


def _client(token: str):
    from django.test import Client

    return Client(HTTP_AUTHORIZATION=f"Bearer {token}", HTTP_HOST="127.0.0.1")


def list_endpoints(sizes: tuple[int, ...], repeats: int) -> dict[str, Any]:
    """p50 of each list endpoint's first page in organizations holding each size of rows.

    One organization per size, all in the same tables, each with that many threads (in one
    project), events (in one thread) and audit records. The timed requests alternate between
    the sizes, so a burst of background load on the machine lands on both alike instead of
    on whichever size happened to be timed then (run after run, timing one size and then the
    other moved the ratio between about 0.7 and 1.8 with no change in the query plans).
    """
    from django.db import connection

    orgs = {size: _list_organization(f"lists-{size}") for size in sizes}
    for size, org in orgs.items():
        _grow_to(org, size)
    with connection.cursor() as cursor:
        # What autovacuum would do after the bulk load, done now so that it does not run in
        # the background while requests are timed.
        cursor.execute("VACUUM ANALYZE")
    results: dict[str, Any] = {}
    for name in ("threads", "events", "audit"):
        paths = {size: org["paths"][name] for size, org in orgs.items()}
        samples = _time_interleaved(orgs, paths, repeats)
        results[name] = {
            size: {
                "p50_ms": statistics.median(samples[size]) * 1000,
                "samples_s": samples[size],
                "rows": orgs[size]["counts"][name],
            }
            for size in sizes
        }
    return {"endpoints": results}


def _list_organization(slug: str) -> dict[str, Any]:
    from kestrel_one.accounts.principal import system_principal
    from kestrel_one.tenancy.bootstrap import bootstrap
    from kestrel_one.tenancy.models import Organization
    from kestrel_one.tenancy.services import environment_create, project_create
    from kestrel_one.threads.services import thread_create

    created = bootstrap(org_slug=slug, email=f"{slug}@bench.invalid")
    organization = Organization.objects.get(slug=slug)
    actor = system_principal("bench")
    environment = environment_create(actor=actor, organization=organization, name="bench")
    project = project_create(
        actor=actor, organization=organization, environment=environment, name="bench"
    )
    events_thread = thread_create(actor=actor, project=project, title="events", mode="agent")
    threads_path = f"/api/v1/orgs/{slug}/projects/{project.public_id}/threads"
    return {
        "organization": organization,
        "project": project,
        "events_thread": events_thread,
        "client": _client(created["token"]),
        "paths": {
            "threads": threads_path,
            "events": f"{threads_path}/{events_thread.public_id}/events",
            "audit": f"/api/v1/orgs/{slug}/audit",
        },
    }


def _grow_to(org: dict[str, Any], size: int) -> None:
    """Bulk-insert rows until the organization holds ``size`` threads, events and records."""
    from kestrel_one.audit.services import audit_chain_settle
    from kestrel_one.threads.models import Thread, ThreadEvent

    organization, project, events_thread = (
        org["organization"],
        org["project"],
        org["events_thread"],
    )
    audit_chain_settle(organization)  # what setting it up audited, before filler follows
    counts = {
        "threads": Thread.objects.filter(project=project).count(),
        "events": ThreadEvent.objects.filter(thread=events_thread).count(),
        "audit": _audit_rows(organization),
    }
    _grow(
        "threads",
        size - counts["threads"],
        lambda n, start: Thread.objects.bulk_create(
            Thread(
                organization=organization,
                project=project,
                title=f"thread {start + i}",
                created_by="bench",
            )
            for i in range(n)
        ),
        counts,
    )
    _grow(
        "events",
        size - counts["events"],
        lambda n, start: ThreadEvent.objects.bulk_create(
            ThreadEvent(
                thread=events_thread,
                organization=organization,
                sequence=start + i + 1,
                kind="bench.event",
                data={"n": start + i},
            )
            for i in range(n)
        ),
        counts,
    )
    _grow("audit", size - counts["audit"], _audit_rows_maker(organization), counts)
    org["counts"] = counts


def _time_interleaved(orgs: dict[int, Any], paths: dict[int, str], repeats: int):
    """Seconds per GET of each size's path, taking turns: size A, size B, size A, ..."""
    samples: dict[int, list[float]] = {size: [] for size in paths}
    for size, path in paths.items():
        _check(orgs[size]["client"].get(path), path)  # imports, connection, caches
    for _ in range(repeats):
        for size, path in paths.items():
            client = orgs[size]["client"]
            started = time.perf_counter()
            response = client.get(path)
            samples[size].append(time.perf_counter() - started)
            _check(response, path)
    return samples


def _check(response, path: str) -> None:
    if response.status_code != 200:
        raise RuntimeError(f"GET {path}: {response.status_code} {response.content[:300]!r}")


def _grow(name: str, missing: int, insert, counts: dict[str, int]) -> None:
    while missing > 0:
        batch = min(BATCH, missing)
        insert(batch, counts[name])
        counts[name] += batch
        missing -= batch


def _audit_rows(organization) -> int:
    from kestrel_one.audit.models import AuditRecord

    return AuditRecord.objects.filter(organization=organization).count()


def _audit_rows_maker(organization):
    """Bulk audit rows for the list figure only: their hashes are filler, not a chain.

    The database refuses a record inserted with a place in the chain (audit migration 0005);
    this run's own database lets the filler in with that guard off for the insert."""
    from django.db import connection, transaction
    from django.db.models import Max

    from kestrel_one.audit.models import AuditRecord

    guard = "TRIGGER audit_record_append_only"

    def insert(n: int, start: int) -> None:
        top = AuditRecord.objects.filter(organization=organization).aggregate(Max("sequence"))
        first = (top["sequence__max"] or 0) + 1
        now = datetime.now(UTC)
        with transaction.atomic(), connection.cursor() as cursor:
            # ALTER TABLE waits for no deferred foreign-key check: make them immediate.
            cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
            cursor.execute(f"ALTER TABLE audit_auditrecord DISABLE {guard}")
            AuditRecord.objects.bulk_create(
                AuditRecord(
                    organization=organization,
                    sequence=first + i,
                    created_at=now,
                    actor_type="system",
                    actor_id="bench",
                    action="bench.row",
                    outcome="success",
                    data={"n": start + i},
                    prev_hash="0" * 64,
                    hash="0" * 64,
                )
                for i in range(n)
            )
            cursor.execute(f"ALTER TABLE audit_auditrecord ENABLE {guard}")

    return insert


# --- audit appends and verification --------------------------------------------------------


def _append_worker(org_id: int, seconds: float, queue) -> None:
    from django.db import transaction

    from kestrel_one.accounts.principal import system_principal
    from kestrel_one.audit.services import audit_record
    from kestrel_one.tenancy.models import Organization

    organization = Organization.objects.get(pk=org_id)
    actor = system_principal("bench")
    appended = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        with transaction.atomic():
            audit_record(
                organization=organization,
                actor=actor,
                action="bench.append",
                data={"n": appended},
            )
        appended += 1
    queue.put(appended)


def audit_figures(seconds: float, writers: int = 4) -> dict[str, Any]:
    """Appends per second with ``writers`` processes on one organization, then verify."""
    from django.db import connections

    from kestrel_one.audit.selectors import audit_chain_verify
    from kestrel_one.audit.services import audit_chain_settle
    from kestrel_one.tenancy.bootstrap import bootstrap
    from kestrel_one.tenancy.models import Organization

    bootstrap(org_slug="audit-bench", email="audit@bench.invalid")
    organization = Organization.objects.get(slug="audit-bench")

    # Baseline: one writer, same code, same database, same run.
    single = _appends(organization.pk, seconds, 1)
    connections.close_all()
    parallel = _appends(organization.pk, seconds, writers)
    # Records committed but not chained when the writers stopped: a chain that fell behind
    # would show here, so the append rate cannot hide unfinished work.
    pending = _pending(organization)
    audit_chain_settle(organization)  # the beat sweep's job, were any left
    samples = []
    for _ in range(3):
        started = time.perf_counter()
        result = audit_chain_verify(organization)
        samples.append(time.perf_counter() - started)
    return {
        "writers": writers,
        "appends_per_second": parallel["rate"],
        "appended": parallel["appended"],
        "single_writer_appends_per_second": single["rate"],
        "pending_after_writers": pending,
        "verify_baseline_read": _read_rate(organization),
        "verify": {
            "ok": result.ok and result.pending == 0,
            "records": result.records,
            "seconds": samples,
            "seconds_per_10k_median": statistics.median(samples) / max(result.records, 1) * 10_000,
        },
    }


def _pending(organization) -> int:
    from kestrel_one.audit.models import AuditRecord

    return AuditRecord.objects.filter(organization=organization, sequence__isnull=True).count()


def _read_rate(organization) -> dict[str, Any]:
    """Baseline for verify: reading the same records' hashed fields, without checking them."""
    from kestrel_one.audit.models import AuditRecord

    samples = []
    rows = 0
    for _ in range(3):
        started = time.perf_counter()
        rows = sum(
            1
            for _ in AuditRecord.objects.filter(organization=organization)
            .order_by("sequence")
            .values_list("sequence", "prev_hash", "hash", "data")
            .iterator(chunk_size=2000)
        )
        samples.append(time.perf_counter() - started)
    return {
        "records": rows,
        "seconds": samples,
        "seconds_per_10k_median": statistics.median(samples) / max(rows, 1) * 10_000,
    }


def _appends(org_id: int, seconds: float, writers: int) -> dict[str, Any]:
    from django.db import connections

    connections.close_all()  # each forked writer opens its own connection
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    processes = [
        context.Process(target=_append_worker, args=(org_id, seconds, queue))
        for _ in range(writers)
    ]
    started = time.perf_counter()
    for process in processes:
        process.start()
    appended = sum(queue.get(timeout=seconds + 120) for _ in processes)
    for process in processes:
        process.join(30)
    elapsed = time.perf_counter() - started
    return {"appended": appended, "rate": appended / elapsed}


def dict_append_rate(seconds: float) -> float:
    """In-memory baseline: appending a hashed record to a Python list, per second."""
    import hashlib
    import json

    records: list[dict] = []
    previous = "0" * 64
    deadline = time.perf_counter() + seconds
    started = time.perf_counter()
    while time.perf_counter() < deadline:
        record = {"sequence": len(records) + 1, "prev": previous, "data": {"n": len(records)}}
        previous = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()
        records.append(record)
    return len(records) / (time.perf_counter() - started)
