"""Console pages at 1,000 and 100,000 rows: p50/p95 and SQL queries of each page.

Run: ``.venv/bin/python bench/console_pages.py [--quick] [--pages overview,tokens]``
(``make bench`` runs it through bench/run.py). Needs PostgreSQL at 127.0.0.1:5432 (trust
auth, as the other benches); makes its own database and drops it after.

Two organizations in the same tables, one per size N (1,000 and 100,000). Each holds, in
one project: a thread with N actions that succeeded (each with its receipt) and N events;
N more threads with one action each awaiting approval; N audit records. Rows go in with
``bulk_create``; the audit records are inserted unchained, as ``audit_record`` leaves them,
and then chained by ``audit_chain_settle`` itself, so the chain is real and is verified
(``audit_chain_verify``) before anything is timed. The actions' and records' times are
spread over 30 days, so the overview's chart of actions per day has 30 days to draw.

Each page is requested by the organization's owner, signed in, through Django's test client
(full middleware and the console view, without a socket), taking turns between the sizes
so background load lands on both alike. Per page: p50 and p95 at each size (target: p95
under 150 ms), the 100k/1k p50 ratio (target: at most 1.2x) and the number of SQL queries
at each size (which must be equal). A page whose route does not exist yet is reported as
missing, and the run then exits non-zero naming it: the figure cannot silently pass.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import records  # noqa: E402
from stats import percentile  # noqa: E402

ADMIN_DATABASE_URL = os.environ.get(
    "BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres"
)
SIZES = (1_000, 100_000)
BATCH = 5_000
DAYS = 30
TARGET_P95_MS = 150.0
TARGET_RATIO = 1.2

# The pages measured, by name: their path in an organization (API.md, "Console").
PAGES = {
    "overview": "/console/{org}/",
    "approvals": "/console/{org}/approvals",
    "timeline": "/console/{org}/projects/{prj}/threads/{thr}",
    "audit": "/console/{org}/audit",
    # Not a figure of the issue: a page that exists from the start, to try the harness on.
    "tokens": "/console/{org}/tokens",
}
DEFAULT_PAGES = ("overview", "approvals", "timeline", "audit")


def setup_django(database_url: str) -> None:
    records.setup_django(database_url, data_prefix="kestrel-bench-console-")


# --- seeding ---------------------------------------------------------------------------------


def seed(size: int) -> dict[str, Any]:
    """An organization of ``size`` rows of each kind (module docstring), and its owner."""
    from django.db import connection

    from kestrel_one.accounts.models import User
    from kestrel_one.accounts.principal import system_principal
    from kestrel_one.audit.services import audit_chain_settle
    from kestrel_one.governance.services import policy_publish_environment
    from kestrel_one.tenancy.bootstrap import bootstrap
    from kestrel_one.tenancy.models import Organization
    from kestrel_one.tenancy.services import environment_create, project_create
    from kestrel_one.threads.services import thread_create

    slug = f"pages-{size}"
    created = bootstrap(org_slug=slug, email=f"{slug}@bench.invalid", owner_token=False)
    organization = Organization.objects.get(slug=slug)
    actor = system_principal("bench")
    environment = environment_create(actor=actor, organization=organization, name="bench")
    policy_publish_environment(
        actor=actor,
        environment=environment,
        document={"capabilities": {"shell.exec": {"approval": "always"}}},
    )
    project = project_create(
        actor=actor, organization=organization, environment=environment, name="bench"
    )
    timeline = thread_create(actor=actor, project=project, title="timeline", mode="agent")
    audit_chain_settle(organization)  # what the setup audited, before the filler
    started = time.perf_counter()
    counts = {
        "actions_in_timeline": _timeline(organization, environment, project, timeline, size),
        "awaiting_across_threads": _awaiting(organization, environment, project, size),
        "audit_records": _audit(organization, size),
    }
    with connection.cursor() as cursor:
        # Spread the actions over the last 30 days (auto_now_add set them all to now).
        cursor.execute(
            "UPDATE execution_action SET created_at = now() - (id %% %s) * interval '1 day' "
            "- (id %% 86400) * interval '1 second' WHERE organization_id = %s",
            [DAYS, organization.pk],
        )
    counts["seed_seconds"] = round(time.perf_counter() - started, 1)
    return {
        "size": size,
        "slug": slug,
        "organization": organization,
        "user": User.objects.get(email=created["user"]),
        "kwargs": {"org": slug, "prj": project.public_id, "thr": timeline.public_id},
        "counts": counts,
    }


def _batches(total: int):
    start = 0
    while start < total:
        yield start, min(BATCH, total - start)
        start += BATCH


def _action(organization, environment, project, thread, *, state: str, index: int):
    from kestrel_one.execution.models import Action

    digest = f"{index:064x}"
    return Action(
        organization=organization,
        environment=environment,
        project=project,
        thread=thread,
        tool="shell.exec",
        args={"argv": ["make", "test", str(index)]},
        args_digest=digest,
        action_digest=digest,
        mode="agent",
        state=state,
        decision={"outcome": "needs_approval", "reasons": ["shell.exec: approval always"]},
        policy_version="pol_bench",
        limits={"timeout_s": 60},
        requested_by="tok_bench",
        pool="default",
        result={"exit_code": 0, "stdout": "ok"} if state == "succeeded" else None,
    )


def _timeline(organization, environment, project, thread, size: int) -> int:
    """``size`` succeeded actions with receipts, and ``size`` events, in one thread."""
    from kestrel_one.execution.models import Action, Receipt
    from kestrel_one.threads.models import Thread, ThreadEvent

    thread.refresh_from_db()
    first = thread.last_event_sequence  # thread_create's own events come first
    for start, count in _batches(size):
        actions = Action.objects.bulk_create(
            _action(organization, environment, project, thread, state="succeeded", index=start + i)
            for i in range(count)
        )
        Receipt.objects.bulk_create(
            Receipt(
                action=action,
                organization=organization,
                call_id=action.public_id,
                tool=action.tool,
                args=action.args,
                args_digest=action.args_digest,
                action_digest=action.action_digest,
                scope={"prj": project.public_id, "thr": thread.public_id},
                outcome="succeeded",
                result=action.result,
                policy_version=action.policy_version,
            )
            for action in actions
        )
        ThreadEvent.objects.bulk_create(
            ThreadEvent(
                thread=thread,
                organization=organization,
                sequence=first + start + i + 1,
                kind="action.succeeded",
                action=action,
                data={"tool": action.tool},
            )
            for i, action in enumerate(actions)
        )
    Thread.objects.filter(pk=thread.pk).update(last_event_sequence=first + size)
    return size


def _awaiting(organization, environment, project, size: int) -> int:
    """``size`` threads, each with one action awaiting approval."""
    from kestrel_one.execution.models import Action
    from kestrel_one.threads.models import Thread

    for start, count in _batches(size):
        threads = Thread.objects.bulk_create(
            Thread(
                organization=organization,
                project=project,
                title=f"thread {start + i}",
                created_by="bench",
            )
            for i in range(count)
        )
        Action.objects.bulk_create(
            _action(
                organization,
                environment,
                project,
                thread,
                state="awaiting_approval",
                index=size + start + i,
            )
            for i, thread in enumerate(threads)
        )
    return size


def _audit(organization, size: int) -> int:
    """``size`` audit records, inserted unchained as ``audit_record`` leaves them, then
    chained by the service itself: the bench's chain is as real as production's."""
    from kestrel_one.audit.models import AuditRecord
    from kestrel_one.audit.services import audit_chain_settle

    now = datetime.now(UTC)
    for start, count in _batches(size):
        AuditRecord.objects.bulk_create(
            AuditRecord(
                organization=organization,
                created_at=now - timedelta(seconds=DAYS * 86400 * (size - start - i) / size),
                actor_type="token",
                actor_id="tok_bench",
                action="action.request",
                target_type="action",
                target_id=f"act_bench_{start + i}",
                data={"tool": "shell.exec", "n": start + i},
            )
            for i in range(count)
        )
    while audit_chain_settle(organization):
        pass
    return size


def verify_chain(organization) -> dict[str, Any]:
    from kestrel_one.audit.selectors import audit_chain_verify

    started = time.perf_counter()
    result = audit_chain_verify(organization)
    return {
        "ok": bool(result.ok and result.pending == 0),
        "records": result.records,
        "seconds": round(time.perf_counter() - started, 2),
    }


# --- timing ----------------------------------------------------------------------------------


def signed_in(user):
    from django.test import Client

    client = Client(HTTP_HOST="127.0.0.1")
    client.force_login(user)
    return client


def route_exists(path: str) -> bool:
    from django.urls import Resolver404, resolve

    try:
        resolve(path)
    except Resolver404:
        return False
    return True


def queries_of(client, path: str) -> int:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as captured:
        _check(client.get(path), path)
    return len(captured)


def _check(response, path: str) -> None:
    if response.status_code != 200:
        raise RuntimeError(f"GET {path}: {response.status_code} {response.content[:300]!r}")


def measure(pages: tuple[str, ...], repeats: int) -> dict[str, Any]:
    from django.db import connection

    orgs = {}
    for size in SIZES:
        print(f"seeding an organization of {size:,} rows of each kind ...", flush=True)
        orgs[size] = seed(size)
    with connection.cursor() as cursor:
        # What autovacuum would do after the bulk load, done now so that it does not run in
        # the background while requests are timed.
        cursor.execute("VACUUM ANALYZE")
    # Seeding left hundreds of thousands of Python objects in this process, which a server
    # process never holds; without this the garbage collector walks them during the timed
    # requests (p95s of 200 ms that are the seeding's, not a page's).
    gc.collect()
    gc.freeze()
    chains = {size: verify_chain(org["organization"]) for size, org in orgs.items()}
    clients = {size: signed_in(org["user"]) for size, org in orgs.items()}
    results: dict[str, Any] = {}
    missing: list[str] = []
    for name in pages:
        paths = {size: PAGES[name].format(**org["kwargs"]) for size, org in orgs.items()}
        if not route_exists(paths[SIZES[0]]):
            missing.append(name)
            results[name] = {"missing": True, "path": PAGES[name]}
            print(f"{name}: no route for {PAGES[name]} yet: missing", flush=True)
            continue
        print(f"{name}: {repeats} requests at each size ...", flush=True)
        queries = {size: queries_of(clients[size], path) for size, path in paths.items()}
        samples: dict[int, list[float]] = {size: [] for size in SIZES}
        for _ in range(repeats):
            for size in SIZES:
                started = time.perf_counter()
                response = clients[size].get(paths[size])
                samples[size].append(time.perf_counter() - started)
                _check(response, paths[size])
        results[name] = {
            "path": PAGES[name],
            "by_size": {
                size: {
                    "p50_ms": statistics.median(samples[size]) * 1000,
                    "p95_ms": percentile(samples[size], 0.95) * 1000,
                    "queries": queries[size],
                    "samples_s": samples[size],
                }
                for size in SIZES
            },
        }
    return {
        "pages": results,
        "missing": missing,
        "chains": chains,
        "counts": {size: org["counts"] for size, org in orgs.items()},
    }


def verdicts(found: dict[str, Any]) -> list[dict[str, Any]]:
    """One line per measured page: p95 at both sizes, the p50 ratio, the query counts."""
    small, large = SIZES
    lines = []
    for name, page in found["pages"].items():
        if page.get("missing"):
            continue
        at = page["by_size"]
        ratio = at[large]["p50_ms"] / at[small]["p50_ms"]
        same_queries = at[small]["queries"] == at[large]["queries"]
        p95_ok = max(at[small]["p95_ms"], at[large]["p95_ms"]) < TARGET_P95_MS
        lines.append(
            {
                "page": name,
                "p50_1k_ms": at[small]["p50_ms"],
                "p95_1k_ms": at[small]["p95_ms"],
                "p50_100k_ms": at[large]["p50_ms"],
                "p95_100k_ms": at[large]["p95_ms"],
                "ratio": ratio,
                "queries_1k": at[small]["queries"],
                "queries_100k": at[large]["queries"],
                "met": p95_ok and ratio <= TARGET_RATIO and same_queries,
            }
        )
    return lines


def format_lines(lines: list[dict[str, Any]]) -> str:
    header = (
        f"{'console page':<12} {'p50 1k':>8} {'p95 1k':>8} {'p50 100k':>9} {'p95 100k':>9} "
        f"{'ratio':>7} {'queries':>9}  target"
    )
    rows = [header, "-" * len(header)]
    for line in lines:
        verdict = "met" if line["met"] else "MISSED"
        rows.append(
            f"{line['page']:<12} {line['p50_1k_ms']:>8.1f} {line['p95_1k_ms']:>8.1f} "
            f"{line['p50_100k_ms']:>9.1f} {line['p95_100k_ms']:>9.1f} {line['ratio']:>6.2f}x "
            f"{line['queries_1k']:>4}/{line['queries_100k']:<4}  "
            f"p95 < {TARGET_P95_MS:.0f} ms, <= {TARGET_RATIO}x, same queries [{verdict}] (ms)"
        )
    return "\n".join(rows)


def run(pages: tuple[str, ...], quick: bool) -> dict[str, Any]:
    import governed

    repeats = 10 if quick else 30
    name = f"kestrel_bench_console_{uuid.uuid4().hex[:8]}"
    with governed.scratch_database(ADMIN_DATABASE_URL, name) as url:
        setup_django(url)
        try:
            found = measure(pages, repeats)
        finally:
            from django.db import connections

            connections.close_all()
    found["lines"] = verdicts(found)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 requests per page, not 30")
    parser.add_argument(
        "--pages",
        default=",".join(DEFAULT_PAGES),
        help=f"comma-separated, from {', '.join(PAGES)} (default: {', '.join(DEFAULT_PAGES)})",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    options = parser.parse_args(argv)
    pages = tuple(page.strip() for page in options.pages.split(",") if page.strip())
    unknown = sorted(set(pages) - set(PAGES))
    if unknown:
        parser.error(f"unknown pages: {', '.join(unknown)}")
    found = run(pages, options.quick)
    print()
    print(format_lines(found["lines"]))
    for size, chain in found["chains"].items():
        print(
            f"audit chain @{size:,}: {chain['records']:,} records, "
            f"{'verifies' if chain['ok'] else 'DOES NOT VERIFY'} ({chain['seconds']} s)"
        )
    if options.json:
        options.json.write_text(json.dumps(found, indent=2, default=str) + "\n")
    failed = [f"{name} (no route {PAGES[name]})" for name in found["missing"]]
    failed += [f"audit chain @{size}" for size, c in found["chains"].items() if not c["ok"]]
    if failed:
        print(f"console pages bench incomplete: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
