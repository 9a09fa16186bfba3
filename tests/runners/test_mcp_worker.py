"""MCP on a real runner process (``python -m runners worker``), a real broker, real Docker:
discovery answered as ``runner.mcp_discover``, and a worker SIGKILLed mid ``mcp.call``.

The test plays the control plane as tests/runners/test_worker_process.py does (its
``RunnerProcess`` and ``FakeControl``).
"""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path
from typing import Any

import docker
import pytest

from runners.contract.mcp_discovery import (
    sign_discovery_request,
    verify_discovery_report,
)
from runners.contract.names import MCP_DISCOVER_TASK, MCP_DISCOVERED_TASK
from runners.mcp.session import MCP_LABEL
from runners.sandbox.docker import LABEL_PREFIX
from tests.runners.test_mcp_servers import SERVER, listed, make_profile, pin
from tests.runners.test_worker_process import (  # noqa: F401 - fixtures
    MAX_CALL_SECONDS,
    PROJECT,
    broker,
    runner_setup,
    wait_for,
)

pytestmark = [pytest.mark.docker]


@pytest.fixture
def mcp_runner(runner_setup: Any, tmp_path: Path) -> Any:  # noqa: F811 - the imported fixture
    runner, control = runner_setup
    warm = tmp_path / "warm"
    warm.mkdir(mode=0o700)
    runner.env["KESTREL_WARM_AGENT_DIR"] = str(warm)
    return runner, control, warm


@pytest.mark.spec("MCP-1")
def test_the_worker_answers_a_discovery_request_with_a_signed_report(
    mcp_runner: Any, server_image: str
) -> None:
    runner, control, _warm = mcp_runner
    runner.start(concurrency=2)
    discovery = "mdi_01ARZ3NDEKTSV4RRFFQ69G5FAV"
    token = sign_discovery_request(
        {
            "aud": f"runner.{control.pool}",
            "jti": discovery,
            "org": "org_01JORG",
            "env": "env_01JENV",
            "profile": make_profile(server_image),
            "managed": None,
        },
        control.control_key,
    )
    control.app.send_task(MCP_DISCOVER_TASK, args=[token], queue=f"runner.{control.pool}")
    reports: list[Any] = []

    def arrived() -> bool:
        while True:
            try:
                message = control.inbox.get(block=True, timeout=0.2)
            except control.inbox.Empty:
                return bool(reports)
            message.ack()
            if message.headers["task"] == MCP_DISCOVERED_TASK:
                (report_token,), _kwargs, _embed = message.payload
                reports.append(
                    verify_discovery_report(report_token, runner_public_key=control.runner_public)
                )

    wait_for(arrived, timeout=120, what="the discovery report", detail=runner.log_tail)
    (report,) = reports
    assert report.runner_id == control.runner_id and report.discovery == discovery
    assert report.error is None and report.image == server_image
    assert "echo" in [tool["name"] for tool in report.tools]


@pytest.mark.spec("MCP-1")
def test_a_worker_killed_mid_mcp_call_loses_it_once_with_no_late_effect(
    mcp_runner: Any, server_image: str, workspace_root: Path
) -> None:
    runner, control, warm = mcp_runner
    profile = make_profile(server_image)
    scratch = Path(tempfile.mkdtemp(dir=workspace_root))
    tools = listed(profile, scratch)
    runner.start(concurrency=2)
    call_id = f"act_{uuid.uuid4().hex}"
    args = {
        "server": SERVER,
        "tool": "slow",
        "arguments": {"seconds": 12, "text": "late effect"},
        "pinned": pin(profile, tools["slow"]),
    }
    control.send(control.command("mcp.call", args, call_id=call_id))
    wait_for(
        lambda: any(p.read_text() == call_id for p in warm.glob("mcp-*/call")),
        timeout=90,
        what="the call to reach its warm server",
        detail=runner.log_tail,
    )
    runner.kill()  # the worker and its pool children, not the relay (its own session)
    client = docker.from_env()

    def servers() -> list[Any]:
        return client.containers.list(
            all=True,
            filters={
                "label": [f"{MCP_LABEL}={SERVER}", f"{LABEL_PREFIX}runner={control.runner_id}"]
            },
        )

    try:
        wait_for(lambda: servers() == [], timeout=60, what="the relay to end its server")
        runner.start(concurrency=2)
        report = control.finished(call_id, timeout=MAX_CALL_SECONDS + 60 + 120)
        assert report.outcome == "failed" and report.error["code"] == "runner_lost"
        finished = {r.raw for r in control.reports_for(call_id, "finished")}
        assert len(finished) == 1
        # Long past the 12 s the tool slept: it never wrote.
        assert not (workspace_root / PROJECT / "notes.txt").exists()
        assert servers() == []
    finally:
        client.close()
