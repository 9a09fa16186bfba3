"""An adapter call through the broker from inside the sandbox vs the same HTTPS request made
directly from the runner host (CRED-3; target: at most 3x for a warm thread).

A real ``python manage.py serve`` (single-host: web, control worker, adapter worker and an
enrolled local runner with KESTREL_SANDBOX=docker) on a scratch PostgreSQL database and
Redis DB 9, and the test upstream (tests/upstream.py: HTTPS with its own CA) standing in
for api.github.com through the egress overrides. One ``shell.exec`` in one thread (a warm
container) runs a Python loop that makes the ``github issues.list`` call N times over the
broker's socket, timing each exchange (the workload's view: request written, answer read);
the same loop then times the ``kestrel-adapter`` client as a process. The baseline is the
same GET made from this process (the runner host) with a new TLS connection each time, as
the adapter worker makes it.

    .venv/bin/python bench/adapter_broker.py [--samples 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import governed  # noqa: E402
from stats import format_table, timing_figure  # noqa: E402

from tests.upstream import DEFAULT_SECRETS, upstream_start  # noqa: E402

ADMIN_DATABASE_URL = os.environ.get(
    "BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres"
)
# Redis DB 9 on the default port unless BENCH_BROKER_URL names another (it is flushed).
governed.BROKER = os.environ.get("BENCH_BROKER_URL", governed.BROKER)
OWNER, REPO = "kestrel", "one"
TARGET_RATIO = 3.0
POLICY = {
    "capabilities": {
        "shell.exec": {"approval": "never", "limits": {"timeout_s": 120}},
        "adapter.invoke": {
            "approval": "never",
            "adapters": {"github": {"operations": ["issues.list"]}},
        },
    }
}
# Inside the sandbox: N exchanges over the socket (or N runs of the client); one JSON line.
# Two calls of the thread, since a call may make at most 32 requests (runners.adapter_broker).
WORKLOAD = r"""
import json, os, socket, subprocess, sys, time
mode, n, body = sys.argv[1], int(sys.argv[2]), sys.argv[3]
request = json.loads(body)
def exchange():
    s = socket.socket(socket.AF_UNIX); s.connect(os.environ["KESTREL_ADAPTER_SOCKET"])
    s.sendall(body.encode() + b"\n"); s.shutdown(socket.SHUT_WR)
    answer = json.loads(s.makefile().read()); s.close()
    assert answer["ok"], answer
def client():
    subprocess.run(["kestrel-adapter", request["adapter"], request["operation"],
                    json.dumps(request["args"]), "--credential", request["credential"]],
                   check=True, capture_output=True)
once = exchange if mode == "socket" else client
once()  # the first request also sends the call's started report
timings = []
for _ in range(n):
    t = time.perf_counter(); once(); timings.append(time.perf_counter() - t)
print(json.dumps(timings))
"""


def direct_requests(upstream, samples: int) -> list[float]:
    """The same GET from the runner host: a new TLS connection per request (as egress)."""
    import urllib3

    host = "api.github.com"
    secret = DEFAULT_SECRETS[host]
    timings = []
    for _ in range(samples + 1):
        started = time.perf_counter()
        pool = urllib3.HTTPSConnectionPool(
            "127.0.0.1",
            port=upstream.port,
            server_hostname=host,
            assert_hostname=host,
            ca_certs=str(upstream.ca_bundle),
            retries=False,
            timeout=10,
        )
        response = pool.request(
            "GET",
            f"/repos/{OWNER}/{REPO}/issues",
            headers={
                "Host": host,
                "Authorization": f"Bearer {secret}",
                "Accept": "application/vnd.github+json",
                "User-Agent": "kestrel-bench",
            },
        )
        assert response.status == 200, response.status
        pool.close()
        timings.append(time.perf_counter() - started)
    return timings[1:]  # the first pays for imports and the CA load


def workload(server, workspace, thread: str, mode: str, samples: int, request: dict) -> list:
    """One call of the thread timing ``samples`` adapter calls from inside its sandbox."""
    body = server.call(
        "POST",
        f"{workspace.threads_path}/{thread}/actions?wait=110",
        {
            "tool": "shell.exec",
            "args": {"argv": ["python3", "-c", WORKLOAD, mode, str(samples), json.dumps(request)]},
        },
        201,
    )
    result = body.get("result") or {}
    if body.get("state") != "succeeded" or result.get("exit_code") != 0:
        raise RuntimeError(f"the workload failed: {json.dumps(result)[:3000]}")
    return json.loads(result["stdout"].strip().splitlines()[-1])


def child_phases(server, workspace, thread: str) -> dict[str, float]:
    """Median milliseconds of the child actions' phases: dispatched to the adapter worker
    (created -> started) and the adapter call itself with its recording (started ->
    finished); the rest of a brokered call is the request's and the answer's way."""
    from datetime import datetime

    listed = server.call("GET", f"{workspace.threads_path}/{thread}/actions?limit=200")
    children = [a for a in listed.get("results", listed) if a["tool"] == "adapter.invoke"]

    def ms(start: str, end: str) -> float:
        return (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds() * 1000

    return {
        "children": len(children),
        "queued_to_started_ms": statistics.median(
            ms(a["created_at"], a["started_at"]) for a in children
        ),
        "started_to_finished_ms": statistics.median(
            ms(a["started_at"], a["finished_at"]) for a in children
        ),
    }


def run(samples: int) -> dict[str, Any]:
    upstream = upstream_start(Path(tempfile.mkdtemp(prefix="kestrel-bench-upstream-")))
    try:
        name = f"kestrel_bench_broker_{uuid.uuid4().hex[:8]}"
        with governed.scratch_database(ADMIN_DATABASE_URL, name) as database_url:
            with governed.serve(database_url, extra_env=upstream.env()) as server:
                workspace = governed.prepare(server, policy=POLICY)
                credential = server.call(
                    "POST",
                    "/orgs/local/credentials",
                    {
                        "name": "bench-github",
                        "adapter": "github",
                        "secret": DEFAULT_SECRETS["api.github.com"],
                    },
                    201,
                    as_person=True,
                )["id"]
                thread = workspace.new_thread("broker bench")
                request = {
                    "adapter": "github",
                    "operation": "issues.list",
                    "args": {"owner": OWNER, "repo": REPO},
                    "credential": credential,
                }
                inside = {
                    mode: workload(server, workspace, thread, mode, samples, request)
                    for mode in ("socket", "client")
                }
                phases = child_phases(server, workspace, thread)
        direct = direct_requests(upstream, samples)
    finally:
        upstream.stop()
    brokered = timing_figure(
        "adapter call through the broker, inside a warm sandbox",
        inside["socket"],
        "the same HTTPS request from the runner host",
        direct,
        target=f"<= {TARGET_RATIO}x",
        **phases,
    )
    brokered.met = brokered.ratio <= TARGET_RATIO
    client = timing_figure(
        "the same through the kestrel-adapter client (a process each)",
        inside["client"],
        "the same HTTPS request from the runner host",
        direct,
        target="(informational)",
    )
    return {
        "figures": [brokered.as_dict(), client.as_dict()],
        "socket_median_ms": statistics.median(inside["socket"]) * 1000,
        "direct_median_ms": statistics.median(direct) * 1000,
        "child_phases": phases,
        "_table": format_table([brokered, client]) + f"\nchild actions: {phases}",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=30, help="at most 31 (a call's limit)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    options = parser.parse_args()
    figures = run(options.samples)
    print(figures.pop("_table"))
    if options.json:
        options.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
