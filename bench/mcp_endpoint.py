"""A warm governed ``shell.exec`` through Kestrel One's MCP endpoint vs the same call through
the REST API (issue 19; target: the MCP call's median at most 1.2x the REST call's).

A real ``python manage.py serve`` (single-host: web, control worker and an enrolled local
runner with KESTREL_SANDBOX=docker) on a scratch PostgreSQL database and Redis DB 9, as
bench/governed.py runs it. A person publishes a policy granting ``shell.exec`` without
approval and makes the project; the agent's token then makes every measured call, two ways
in the same process against the same serve:

- MCP: the MCP Python SDK's Streamable HTTP client, one initialized session (the 2025-11-25
  handshake) on ``/api/v1/orgs/local/projects/{prj}/mcp``, ``tools/call shell.exec`` with
  ``{"argv": ["echo", "hi"]}``. The session keeps one thread, so every call after the first
  finds its sandbox warm.
- REST: ``POST .../threads/{thr}/actions?wait=60`` with the same tool and arguments, on one
  keep-alive HTTP session, in a thread of its own that is warm too.

Both are warmed up first (the session's thread, its sandbox and the server's imports), then
the samples alternate MCP, REST, MCP, REST..., so load from elsewhere on the machine lands
on both alike. Every sample must succeed with ``hi`` on stdout, or the run fails.

    .venv/bin/python bench/mcp_endpoint.py [--samples 30] [--warmup 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import governed  # noqa: E402
import httpx2  # noqa: E402
from mcp import ClientSession  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402
from stats import format_table, timing_figure  # noqa: E402

ADMIN_DATABASE_URL = os.environ.get(
    "BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres"
)
TOOL = "shell.exec"
ARGUMENTS = {"argv": governed.COMMAND}
TARGET_RATIO = 1.2


def mcp_succeeded(result: Any) -> bool:
    """The endpoint's result shape (docs/mcp-endpoint.md): the action's state and its result
    in ``structuredContent``."""
    content = result.structured_content or {}
    outcome = content.get("result") or {}
    return (
        not result.is_error
        and content.get("state") == "succeeded"
        and outcome.get("exit_code") == 0
        and outcome.get("stdout") == "hi\n"
    )


async def measure(
    server: governed.Server, workspace: governed.Workspace, url: str, samples: int, warmup: int
) -> dict[str, Any]:
    rest_thread = workspace.new_thread("rest bench warm")
    headers = {"Authorization": f"Bearer {server.token}"}
    timeout = httpx2.Timeout(120.0)
    mcp_samples: list[float] = []
    rest_samples: list[float] = []
    threads = set()
    async with (
        httpx2.AsyncClient(headers=headers, timeout=timeout) as http,
        streamable_http_client(url, http_client=http) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        listed = await session.list_tools()
        names = [tool.name for tool in listed.tools]
        if TOOL not in names:
            raise RuntimeError(f"tools/list does not offer {TOOL}: {names}")
        for index in range(warmup + samples):
            started = time.perf_counter()
            result = await session.call_tool(TOOL, ARGUMENTS)
            took_mcp = time.perf_counter() - started
            if not mcp_succeeded(result):
                raise RuntimeError(f"the MCP call did not succeed: {result!r}"[:1000])
            threads.add((result.structured_content or {}).get("thread"))
            # The REST call blocks the event loop while it runs; the MCP session is idle then.
            took_rest, body = workspace.shell_call(rest_thread)
            if not governed.succeeded(body):
                raise RuntimeError(f"the REST call did not succeed: {json.dumps(body)[:800]}")
            if index >= warmup:
                mcp_samples.append(took_mcp)
                rest_samples.append(took_rest)
    if len(threads) != 1:
        raise RuntimeError(f"the MCP session's calls ran in {len(threads)} threads, not one")
    return {"mcp": mcp_samples, "rest": rest_samples, "mcp_thread": threads.pop()}


def run(samples: int, warmup: int) -> dict[str, Any]:
    name = f"kestrel_bench_mcp_endpoint_{uuid.uuid4().hex[:8]}"
    with governed.scratch_database(ADMIN_DATABASE_URL, name) as database_url:
        with governed.serve(database_url) as server:
            workspace = governed.prepare(server)
            # threads_path is /orgs/local/projects/{prj}/threads
            project_path = workspace.threads_path.rsplit("/", 1)[0]
            url = f"{server.base}/api/v1{project_path}/mcp"
            found = asyncio.run(measure(server, workspace, url, samples, warmup))
    figure = timing_figure(
        "warm shell.exec through MCP (tools/call)",
        found["mcp"],
        "the same call through REST (?wait=)",
        found["rest"],
        target=f"<= {TARGET_RATIO}x",
        warmup=warmup,
    )
    figure.met = figure.ratio <= TARGET_RATIO
    return {
        "figures": [figure.as_dict()],
        "mcp_median_ms": statistics.median(found["mcp"]) * 1000,
        "rest_median_ms": statistics.median(found["rest"]) * 1000,
        "_table": format_table([figure]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="calls of each kind not measured")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    options = parser.parse_args()
    figures = run(options.samples, options.warmup)
    print(figures.pop("_table"))
    if options.json:
        options.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
