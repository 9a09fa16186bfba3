"""A governed ``mcp.call`` through the whole API vs the same MCP call made directly over stdio
from the runner host (issue 18; target: warm call at most 1.5x the direct one plus 15 ms),
and the first call of a thread (the server's container starts) vs ``docker run`` of the image.

A real ``python manage.py serve`` (single-host: web, control worker and an enrolled local
runner with KESTREL_SANDBOX=docker) on a scratch PostgreSQL database and Redis DB 9. A person
installs the managed ``time`` server (kestrel/mcp-time, built by ``make images``) into an
Environment whose policy grants its ``get_current_time`` tool; the agent's token then calls
it through HTTP with ``?wait=``, exactly as an agent would: the first call of each new thread
starts the server, the later ones find it warm. The baselines, measured in the same run on
the same image: an MCP client session (the MCP Python SDK, as the runner uses it) over the
stdio of a ``docker run -i`` container with the same hardening, already initialized, timing
each ``tools/call``; a warm governed ``shell.exec echo hi`` through the same API (what the
governed path costs by itself, so the difference is what MCP adds); and ``docker run --rm
-i`` of the image with its stdin closed (the container starts, the server reads end-of-input
and exits).

    .venv/bin/python bench/mcp_calls.py [--samples 30] [--threads 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import governed  # noqa: E402
from mcp import ClientSession  # noqa: E402
from mcp.client.stdio import StdioServerParameters, stdio_client  # noqa: E402
from stats import format_table, timing_figure  # noqa: E402

from runners.contract.mcp import MANAGED_SERVERS  # noqa: E402

ADMIN_DATABASE_URL = os.environ.get(
    "BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres"
)
SERVER = "time"
TOOL = "get_current_time"
ARGUMENTS = {"timezone": "UTC"}
# Listing the tool under ``dangerous`` too keeps the bench independent of its annotations.
POLICY = {
    "capabilities": {
        "mcp.call": {
            "approval": "never",
            "servers": {SERVER: {"tools": [TOOL], "dangerous": [TOOL]}},
        },
        # The second baseline: the governed path's own cost, with a warm shell call.
        "shell.exec": {"approval": "never", "limits": {"timeout_s": 30}},
    }
}
# The warm target: at most this ratio of the direct call, plus this many milliseconds.
TARGET_RATIO = 1.5
TARGET_EXTRA_MS = 15.0
# The runner's hardening (runners/mcp), for the direct baseline's container.
HARDENING = [
    "--network",
    "none",
    "--read-only",
    "--cap-drop",
    "ALL",
    "--security-opt",
    "no-new-privileges",
    "--user",
    "10001:10001",
    "--tmpfs",
    "/tmp:rw,nosuid,nodev,size=64m",  # noqa: S108 - the container's own tmpfs
    "--memory",
    "512m",
    "--pids-limit",
    "128",
]


def image_id(tag: str) -> str:
    return subprocess.run(
        ["docker", "image", "inspect", "--format", "{{.Id}}", tag],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def wait_ready(server: governed.Server, mcp_id: str) -> dict:
    """Until the server's discovery (a runner starting it and listing its tools) is done."""
    for _ in range(600):
        body = server.call("GET", f"/orgs/local/mcp-servers/{mcp_id}", as_person=True)
        if body["state"] == "ready":
            return body
        if body["state"] == "failed":
            raise RuntimeError(f"the server's discovery failed: {body['error']}")
        time.sleep(0.2)
    raise RuntimeError("the server's discovery did not finish")


def governed_call(server: governed.Server, threads_path: str, thread: str, mcp_id: str) -> float:
    started = time.perf_counter()
    body = server.call(
        "POST",
        f"{threads_path}/{thread}/actions?wait=60",
        {"tool": "mcp.call", "args": {"server": mcp_id, "tool": TOOL, "arguments": ARGUMENTS}},
        201,
    )
    took = time.perf_counter() - started
    result = body.get("result") or {}
    if body.get("state") != "succeeded" or result.get("is_error"):
        raise RuntimeError(f"the governed call did not succeed: {json.dumps(body)[:800]}")
    return took


async def direct_calls(image: str, samples: int) -> list[float]:
    """``tools/call`` round trips over the stdio of one hardened container, initialized."""
    parameters = StdioServerParameters(
        command="docker",
        args=["run", "-i", "--rm", *HARDENING, image, *MANAGED_SERVERS[SERVER]["command"]],
    )
    timings = []
    async with stdio_client(parameters) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        await session.list_tools()
        for _ in range(samples + 1):
            started = time.perf_counter()
            result = await session.call_tool(TOOL, ARGUMENTS)
            timings.append(time.perf_counter() - started)
            if result.is_error:
                raise RuntimeError(f"the direct call failed: {result}")
    return timings[1:]  # the first pays for the server's own first-call work


def docker_run(image: str) -> float:
    started = time.perf_counter()
    subprocess.run(
        ["docker", "run", "--rm", "-i", *HARDENING, image, *MANAGED_SERVERS[SERVER]["command"]],
        input=b"",
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - started


def run(samples: int, threads: int) -> dict[str, Any]:
    image = image_id(MANAGED_SERVERS[SERVER]["image"])
    name = f"kestrel_bench_mcp_{uuid.uuid4().hex[:8]}"
    first, warm, shell, baseline_run = [], [], [], []
    with governed.scratch_database(ADMIN_DATABASE_URL, name) as database_url:
        with governed.serve(database_url) as server:
            workspace = governed.prepare(server, policy=POLICY)
            environment = server.call("GET", "/orgs/local/environments", as_person=True)["results"][
                0
            ]["id"]
            installed = server.call(
                "POST",
                "/orgs/local/mcp-servers",
                {"name": SERVER, "environment": environment, "managed": SERVER},
                201,
                as_person=True,
            )
            wait_ready(server, installed["id"])
            for index in range(threads):
                baseline_run.append(docker_run(image))
                thread = workspace.new_thread(f"mcp bench {index}")
                first.append(governed_call(server, workspace.threads_path, thread, installed["id"]))
            thread = workspace.new_thread("mcp bench warm")
            governed_call(server, workspace.threads_path, thread, installed["id"])
            warm = [
                governed_call(server, workspace.threads_path, thread, installed["id"])
                for _ in range(samples)
            ]
            shell_thread = workspace.new_thread("shell bench warm")
            workspace.shell_call(shell_thread)
            shell = []
            for _ in range(samples):
                took, body = workspace.shell_call(shell_thread)
                if not governed.succeeded(body):
                    raise RuntimeError(f"the warm shell call failed: {json.dumps(body)[:800]}")
                shell.append(took)
    direct = asyncio.run(direct_calls(image, samples))
    warm_figure = timing_figure(
        "warm mcp.call through the API (?wait=)",
        warm,
        "the same tools/call over stdio from the runner host",
        direct,
        target=f"<= {TARGET_RATIO}x + {TARGET_EXTRA_MS:.0f} ms",
    )
    allowed_ms = TARGET_RATIO * warm_figure.baseline_median + TARGET_EXTRA_MS
    warm_figure.met = warm_figure.median <= allowed_ms
    warm_figure.notes["allowed_median_ms"] = round(allowed_ms, 1)
    first_figure = timing_figure(
        "first mcp.call of a thread (the server starts)",
        first,
        "docker run --rm -i of the same image",
        baseline_run,
        target="(informational)",
    )
    pipeline_figure = timing_figure(
        "warm mcp.call through the API (?wait=)",
        warm,
        "a warm shell.exec echo through the API",
        shell,
        target="(informational: what MCP adds to a governed call)",
    )
    return {
        "figures": [warm_figure.as_dict(), pipeline_figure.as_dict(), first_figure.as_dict()],
        "warm_median_ms": statistics.median(warm) * 1000,
        "direct_median_ms": statistics.median(direct) * 1000,
        "shell_median_ms": statistics.median(shell) * 1000,
        "_table": format_table([warm_figure, pipeline_figure, first_figure]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--threads", type=int, default=5, help="first calls measured")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    options = parser.parse_args()
    figures = run(options.samples, options.threads)
    print(figures.pop("_table"))
    if options.json:
        options.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
