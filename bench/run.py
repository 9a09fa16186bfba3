"""``make bench``: every performance figure of Kestrel One next to a baseline from the same run.

Needs PostgreSQL, Redis and Docker on this machine (and the tool image:
``deploy/images/tool-runtime/build.sh``). Prints a table (median, p95, baseline median,
ratio, target) and writes everything, samples included, to ``bench/results/``.

    .venv/bin/python bench/run.py            # full run (throughput for 30 s), ~10 minutes
    .venv/bin/python bench/run.py --quick    # fewer samples, 8 s throughput

Figures: cold call (first ``shell.exec echo hi`` of a new thread through HTTP with
``?wait=``) and warm call (the tenth in the same thread) vs ``docker run --rm``; governed
calls per second with 8 concurrent threads vs ``docker exec`` in a loop; policy ``decide``
vs a dict lookup; the threads, events and audit list endpoints at 1,000 and 100,000 rows;
audit appends per second with 4 writers vs one, and verify time per 10,000 records vs
reading them; the console's overview, inbox, thread timeline and audit pages at 1,000 and
100,000 rows (bench/console_pages.py: p95, the 100k/1k ratio and the SQL queries per page);
a model-gateway call vs the same provider request made directly (bench/gateway.py); a
warm ``mcp.call`` through the API vs the same MCP call over stdio, and the first call of a
thread vs ``docker run`` of the server's image (bench/mcp_calls.py); a warm ``shell.exec``
through the MCP endpoint (an initialized SDK session) vs the same call through REST
(bench/mcp_endpoint.py, ``--only mcp-endpoint``).
See docs/performance.md for the method and the latest figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import governed  # noqa: E402
import policy_caps  # noqa: E402
import policy_decide  # noqa: E402
import records  # noqa: E402
from stats import Figure, format_table, percentile, timing_figure  # noqa: E402

RESULTS = ROOT / "bench" / "results"
ADMIN_DATABASE_URL = os.environ.get(
    "BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres"
)


def machine() -> dict[str, Any]:
    memory_kb = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_kb = int(line.split()[1])
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "memory_gib": round(memory_kb / 1024 / 1024, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def governed_figures(quick: bool) -> list[Figure]:
    image = governed.image_id()
    seconds = 8.0 if quick else 30.0
    threads = 4 if quick else 12
    with governed.scratch_database(
        ADMIN_DATABASE_URL, f"kestrel_bench_{uuid.uuid4().hex[:8]}"
    ) as url:
        with governed.serve(url) as server:
            workspace = governed.prepare(server)
            workspace.shell_call(workspace.new_thread("warm-up"))  # imports, first container
            print(f"cold and warm calls: {threads} threads x 10 calls ...", flush=True)
            latency = governed.latency_runs(workspace, image, threads)
            print(f"throughput: 8 threads for {seconds:.0f} s ...", flush=True)
            rate = governed.throughput(workspace, seconds)
    print(f"docker exec loop for {seconds:.0f} s ...", flush=True)
    exec_rate, exec_latencies = governed.docker_exec_rate(image, seconds)
    baseline = latency["docker_run"]
    cold = timing_figure(
        "cold call (1st in new thread)",
        latency["cold"],
        "docker run --rm",
        baseline,
        target="<= 1.5x",
        failures=len(latency["failures"]),
    )
    cold.met = cold.ratio <= 1.5 and not latency["failures"]
    warm = timing_figure(
        "warm call (10th in thread)",
        latency["warm"],
        "docker run --rm",
        baseline,
        target="<= 0.75x",
        failures=len(latency["failures"]),
    )
    warm.met = warm.ratio <= 0.75 and not latency["failures"]
    throughput = Figure(
        name="throughput, 8 threads (calls/s)",
        unit="calls/s",
        median=rate["calls_per_second"],
        p95=None,
        baseline_name="docker exec loop (calls/s)",
        baseline_median=exec_rate,
        baseline_p95=None,
        samples=rate["ok"] + rate["errors"],
        target=">= 25/s, 0 errors",
        notes={
            "errors": rate["errors"],
            "error_samples": rate["error_samples"],
            "elapsed_s": rate["elapsed_s"],
            "call_latency_median_ms": statistics.median(rate["latencies"]) * 1000
            if rate["latencies"]
            else None,
            "call_latency_p95_ms": percentile(rate["latencies"], 0.95) * 1000
            if rate["latencies"]
            else None,
            "docker_exec_latency_median_ms": statistics.median(exec_latencies) * 1000,
            "cpu_ms_per_call": rate["cpu_ms_per_call"],
        },
    )
    throughput.met = rate["calls_per_second"] >= 25 and rate["errors"] == 0
    return [cold, warm, throughput]


def policy_figure(quick: bool) -> Figure:
    policy = policy_decide.effective_policy()
    requests = policy_decide.REQUESTS
    table = {request.capability: request for request in requests}
    capabilities = [request.capability for request in requests]
    count = len(requests)
    iterations = 5_000 if quick else policy_decide.ITERATIONS

    def run_decide(index: int) -> None:
        policy_decide.decide(policy, requests[index % count], version="pol_bench")

    def run_lookup(index: int) -> None:
        table.get(capabilities[index % count])

    policy_decide.measure(run_decide, 2_000)
    policy_decide.measure(run_lookup, 2_000)
    decide_ns = policy_decide.measure(run_decide, iterations)
    lookup_ns = policy_decide.measure(run_lookup, iterations)
    figure = Figure(
        name="policy decide (µs)",
        unit="µs",
        median=statistics.median(decide_ns) / 1000,
        p95=percentile(decide_ns, 0.95) / 1000,
        baseline_name="dict lookup (µs)",
        baseline_median=statistics.median(lookup_ns) / 1000,
        baseline_p95=percentile(lookup_ns, 0.95) / 1000,
        samples=iterations,
        target="median < 20 µs",
    )
    figure.met = figure.median < policy_decide.TARGET_MEDIAN_NS / 1000
    return figure


def policy_caps_figures(quick: bool) -> list[Figure]:
    """The engine on the largest document the caps allow, each against the same operation on
    the small realistic policy of ``policy_decide`` (bench/policy_caps.py)."""
    found = policy_caps.measure(quick)
    patterns = found["path_patterns"]
    small_environment = json.dumps(policy_decide.ENVIRONMENT).encode()
    small = policy_decide.parse_policy(policy_decide.ENVIRONMENT)
    small_project = policy_decide.parse_policy(policy_decide.PROJECT)
    repeat = len(found["parse_s"])
    small_parse = policy_caps.cpu_samples(
        lambda: policy_caps.parse_policy_json(small_environment), repeat
    )
    small_meet = policy_caps.cpu_samples(lambda: policy_caps.meet_all(small, small_project), repeat)
    per_pattern = {
        "document_bytes": found["document_bytes"],
        "path_patterns": patterns,
        "list_items": found["list_items"],
    }
    parse = timing_figure(
        "policy parse at caps (ms CPU)",
        found["parse_s"],
        "parse realistic policy",
        small_parse,
        target="median < 50 ms",
        us_per_pattern=statistics.median(found["parse_s"]) * 1e6 / patterns,
        **per_pattern,
    )
    parse.met = parse.median < policy_caps.TARGET_PARSE_MS
    meet = timing_figure(
        "policy meet at caps (ms CPU)",
        found["meet_s"],
        "meet realistic policies",
        small_meet,
        target="(no target)",
        us_per_pattern=statistics.median(found["meet_s"]) * 1e6 / patterns,
        widenings_ms=statistics.median(found["widenings_s"]) * 1000,
        parse_project_ms=statistics.median(found["parse_project_s"]) * 1000,
        **per_pattern,
    )
    effective = policy_decide.effective_policy()
    small_decide = policy_caps.decide_samples(
        effective, policy_decide.REQUESTS, len(found["decide_ns"])
    )
    decide_ns = found["decide_ns"]
    decide = Figure(
        name="policy decide at caps (µs)",
        unit="µs",
        median=statistics.median(decide_ns) / 1000,
        p95=percentile(decide_ns, 0.95) / 1000,
        baseline_name="decide realistic (µs)",
        baseline_median=statistics.median(small_decide) / 1000,
        baseline_p95=percentile(small_decide, 0.95) / 1000,
        samples=len(decide_ns),
        target="median < 20 µs",
    )
    decide.met = decide.median < policy_caps.TARGET_DECIDE_US
    return [parse, meet, decide]


def record_figures(quick: bool) -> tuple[list[Figure], dict[str, Any]]:
    sizes = (1_000, 100_000)
    repeats = 15 if quick else 40
    append_seconds = 4.0 if quick else 10.0
    name = f"kestrel_bench_records_{uuid.uuid4().hex[:8]}"
    with governed.scratch_database(ADMIN_DATABASE_URL, name) as url:
        records.setup_django(url)
        print("list endpoints: organizations of 1,000 and 100,000 rows ...", flush=True)
        lists = records.list_endpoints(sizes, repeats)
        print(f"audit appends: 1 then 4 writers for {append_seconds:.0f} s each ...", flush=True)
        audit = records.audit_figures(append_seconds)
        from django.db import connections

        connections.close_all()
    figures = []
    for endpoint, by_size in lists["endpoints"].items():
        small, large = by_size[sizes[0]], by_size[sizes[1]]
        figure = timing_figure(
            f"list {endpoint} @100k rows (p50)",
            large["samples_s"],
            f"list {endpoint} @1k rows",
            small["samples_s"],
            target="<= 1.2x",
        )
        figure.met = figure.ratio <= 1.2
        figures.append(figure)
    appends = Figure(
        name="audit appends, 4 writers (/s)",
        unit="appends/s",
        median=audit["appends_per_second"],
        p95=None,
        baseline_name="1 writer (/s)",
        baseline_median=audit["single_writer_appends_per_second"],
        baseline_p95=None,
        samples=audit["appended"],
        target=">= 1000/s",
        notes={"pending_after_writers": audit["pending_after_writers"]},
    )
    appends.met = audit["appends_per_second"] >= 1000
    figures.append(appends)
    verify = audit["verify"]
    read = audit["verify_baseline_read"]
    figure = Figure(
        name="audit verify per 10k records (s)",
        unit="s",
        median=verify["seconds_per_10k_median"],
        p95=None,
        baseline_name="read same rows per 10k (s)",
        baseline_median=read["seconds_per_10k_median"],
        baseline_p95=None,
        samples=verify["records"],
        target="chain verifies",
        notes={"ok": verify["ok"]},
    )
    figure.met = verify["ok"]
    figures.append(figure)
    details = {
        "lists": {
            endpoint: {
                size: {k: v for k, v in figures_by_size.items() if k != "samples_s"}
                for size, figures_by_size in by_size.items()
            }
            for endpoint, by_size in lists["endpoints"].items()
        },
        "audit": audit,
    }
    return figures, details


def console_figures(quick: bool) -> tuple[list[Figure], dict[str, Any]]:
    """The console pages bench, in a process of its own (it sets Django up on its own
    database). A page whose route does not exist yet comes back as missing."""
    with tempfile.TemporaryDirectory(prefix="kestrel-bench-console-") as folder:
        output = Path(folder) / "console.json"
        argv = [sys.executable, str(ROOT / "bench" / "console_pages.py"), "--json", str(output)]
        completed = subprocess.run([*argv, *(["--quick"] if quick else [])], check=False)
        if not output.exists():
            raise RuntimeError(f"bench/console_pages.py failed (exit {completed.returncode})")
        found = json.loads(output.read_text())
    figures = []
    for line in found["lines"]:
        figure = Figure(
            name=f"console {line['page']} @100k (p50)",
            unit="ms",
            median=line["p50_100k_ms"],
            p95=line["p95_100k_ms"],
            baseline_name=f"console {line['page']} @1k",
            baseline_median=line["p50_1k_ms"],
            baseline_p95=line["p95_1k_ms"],
            samples=len(found["pages"][line["page"]]["by_size"]["100000"]["samples_s"]),
            target="p95 < 150 ms, <= 1.2x",
            notes={"queries_1k": line["queries_1k"], "queries_100k": line["queries_100k"]},
        )
        figure.met = line["met"]
        figures.append(figure)
    details = {
        "pages": {
            name: {
                "missing": page.get("missing", False),
                "by_size": {
                    size: {k: v for k, v in at.items() if k != "samples_s"}
                    for size, at in page.get("by_size", {}).items()
                },
            }
            for name, page in found["pages"].items()
        },
        "missing": found["missing"],
        "chains": found["chains"],
        "counts": found["counts"],
    }
    return figures, details


def gateway_figure(quick: bool) -> Figure:
    """bench/gateway.py in a process of its own (it sets Django up on its own database)."""
    with tempfile.TemporaryDirectory(prefix="kestrel-bench-gateway-") as folder:
        output = Path(folder) / "gateway.json"
        argv = [sys.executable, str(ROOT / "bench" / "gateway.py"), "--json", str(output)]
        completed = subprocess.run([*argv, *(["--quick"] if quick else [])], check=False)
        if not output.exists():
            raise RuntimeError(f"bench/gateway.py failed (exit {completed.returncode})")
        found = json.loads(output.read_text())
    samples = found["samples_s"]
    return timing_figure(
        "model gateway call",
        samples["gateway"],
        "the provider request direct",
        samples["direct"],
        target=found["target"],
        met=found["met"],
        overhead_ms=found["overhead_ms"],
    )


def mcp_figures(quick: bool) -> list[Figure]:
    """bench/mcp_calls.py in a process of its own (it runs its own serve)."""
    with tempfile.TemporaryDirectory(prefix="kestrel-bench-mcp-") as folder:
        output = Path(folder) / "mcp.json"
        argv = [sys.executable, str(ROOT / "bench" / "mcp_calls.py"), "--json", str(output)]
        sizes = ["--samples", "10", "--threads", "2"] if quick else []
        completed = subprocess.run([*argv, *sizes], check=False)
        if not output.exists():
            raise RuntimeError(f"bench/mcp_calls.py failed (exit {completed.returncode})")
        found = json.loads(output.read_text())
    # The ratio is the figure's own (computed from the medians), not an argument.
    return [
        Figure(**{key: value for key, value in figure.items() if key != "ratio"})
        for figure in found["figures"]
    ]


def mcp_endpoint_figures(quick: bool) -> list[Figure]:
    """bench/mcp_endpoint.py in a process of its own (it runs its own serve)."""
    with tempfile.TemporaryDirectory(prefix="kestrel-bench-mcp-endpoint-") as folder:
        output = Path(folder) / "mcp-endpoint.json"
        argv = [sys.executable, str(ROOT / "bench" / "mcp_endpoint.py"), "--json", str(output)]
        sizes = ["--samples", "10", "--warmup", "3"] if quick else []
        completed = subprocess.run([*argv, *sizes], check=False)
        if not output.exists():
            raise RuntimeError(f"bench/mcp_endpoint.py failed (exit {completed.returncode})")
        found = json.loads(output.read_text())
    return [
        Figure(**{key: value for key, value in figure.items() if key != "ratio"})
        for figure in found["figures"]
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples, shorter runs")
    parser.add_argument(
        "--only",
        choices=["governed", "policy", "records", "console", "gateway", "mcp", "mcp-endpoint"],
        action="append",
        help="run only these parts (repeatable)",
    )
    options = parser.parse_args(argv)
    parts = options.only or [
        "governed",
        "policy",
        "records",
        "console",
        "gateway",
        "mcp",
        "mcp-endpoint",
    ]
    started = time.perf_counter()
    figures: list[Figure] = []
    details: dict[str, Any] = {}
    if "governed" in parts:
        figures += governed_figures(options.quick)
    if "policy" in parts:
        figures.append(policy_figure(options.quick))
        figures += policy_caps_figures(options.quick)
    if "records" in parts:
        found, details = record_figures(options.quick)
        figures += found
    missing: list[str] = []
    if "console" in parts:
        found, details["console"] = console_figures(options.quick)
        figures += found
        missing = details["console"]["missing"]
        missing += [
            f"audit chain @{size} does not verify"
            for size, chain in details["console"]["chains"].items()
            if not chain["ok"]
        ]
    if "gateway" in parts:
        figures.append(gateway_figure(options.quick))
    if "mcp" in parts:
        figures += mcp_figures(options.quick)
    if "mcp-endpoint" in parts:
        figures += mcp_endpoint_figures(options.quick)
    info = machine()
    print()
    print(
        f"Kestrel One bench, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {info['cpus']} cores, "
        f"{info['memory_gib']} GiB, {'quick' if options.quick else 'full'} run"
    )
    print(format_table(figures))
    for figure in figures:
        if figure.notes.get("cpu_ms_per_call"):
            spent = ", ".join(f"{k} {v:.0f}" for k, v in figure.notes["cpu_ms_per_call"].items())
            print(f"{figure.name}: CPU ms per call: {spent}")
        if figure.notes.get("us_per_pattern"):
            print(
                f"{figure.name}: {figure.notes['us_per_pattern']:.1f} µs per path pattern "
                f"({figure.notes['path_patterns']} patterns among "
                f"{figure.notes['list_items']} list items, {figure.notes['document_bytes']} bytes)"
            )
        if "queries_1k" in figure.notes:
            print(
                f"{figure.name}: SQL queries {figure.notes['queries_1k']} @1k, "
                f"{figure.notes['queries_100k']} @100k"
            )
        if figure.notes.get("errors"):
            print(
                f"{figure.name}: {figure.notes['errors']} errors: {figure.notes['error_samples']}"
            )
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    payload = {
        "when": stamp,
        "quick": options.quick,
        "machine": info,
        "seconds": time.perf_counter() - started,
        "figures": [figure.as_dict() for figure in figures],
        "details": details,
    }
    path = RESULTS / f"bench-{stamp}.json"
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    (RESULTS / "latest.json").write_text(path.read_text())
    print(f"wrote {path}")
    if missing:
        # A console page without its route yet cannot pass by not being measured.
        print(f"console pages missing (no route yet): {', '.join(missing)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
