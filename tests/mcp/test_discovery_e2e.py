"""A discovery and a call through real processes: the control plane signs the request, a
real runner worker starts the managed time server (kestrel/mcp-time) in its container and
lists its tools, a real control worker verifies the signed report and pins them; then an
mcp.call of a pinned tool runs through the same runner and is recorded with a receipt."""

from __future__ import annotations

import subprocess
import time

import pytest
from django.db import connection, transaction

from kestrel_one.accounts.principal import Principal, PrincipalKind
from kestrel_one.audit.models import AuditRecord
from kestrel_one.execution.models import Action, ActionState, Receipt
from kestrel_one.execution.services import action_request
from kestrel_one.mcp.discovery import discovery_start
from kestrel_one.mcp.models import McpDiscovery, McpServer, McpTool
from runners.contract.mcp import DEFAULT_LIMITS, MANAGED_SERVERS
from tests.execution.workers import governed_thread, real_workers

RUNNER_ID = "run_MCPDISCOVERYE2E00000000000"
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.docker]

POLICY = {
    "capabilities": {
        "mcp.call": {
            "servers": {
                "time": {
                    "tools": ["get_current_time", "convert_time"],
                    "dangerous": ["get_current_time", "convert_time"],
                }
            }
        }
    }
}


@pytest.fixture(scope="module")
def workers(django_db_setup, django_db_blocker, tmp_path_factory, docker_backend):
    with django_db_blocker.unblock():
        database = connection.settings_dict
    with real_workers(
        tmp_path_factory.mktemp("mcp-runner"), runner_id=RUNNER_ID, database=database
    ) as files:
        yield files


def logs(workers) -> str:
    return "".join(
        (workers["logs"] / name).read_text()[-4000:]
        for name in ("runner.log", "control.log", "reports.log")
    )


def until(workers, what: str, done) -> None:
    for _ in range(600):  # bounded by attempts: 600 polls of 0.2 s
        if done():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what} never happened; worker logs:\n{logs(workers)}")


def image_id(reference: str) -> str:
    return subprocess.run(
        ["docker", "image", "inspect", "--format", "{{.Id}}", reference],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


@pytest.mark.spec("MCP-1", "POL-8")
def test_a_managed_server_is_discovered_by_a_real_runner_and_its_tool_called(workers, world):
    thread = governed_thread(
        workers, world.org, runner_id=RUNNER_ID, policy=POLICY, name="mcp-discovery"
    )
    entry = MANAGED_SERVERS["time"]
    with transaction.atomic():
        server = McpServer.objects.create(
            organization=world.org,
            environment=thread.project.environment,
            name="time",
            kind=McpServer.Kind.MANAGED,
            managed="time",
            reference=entry["image"],
            command=entry["command"],
            workspace=entry["workspace"],
            limits=dict(DEFAULT_LIMITS),
        )
        discovery = discovery_start(server=server)

    def finished() -> bool:
        discovery.refresh_from_db()
        return discovery.state != McpDiscovery.State.PENDING

    until(workers, "the discovery", finished)
    assert discovery.state == McpDiscovery.State.DONE, (discovery.error, logs(workers))
    server.refresh_from_db()
    assert server.state == McpServer.State.READY
    assert server.image_id == image_id(entry["image"])
    tools = {tool.name: tool for tool in server.tools.all()}
    assert {"get_current_time", "convert_time"} <= set(tools)
    assert all(tool.state == McpTool.State.ENABLED for tool in tools.values())
    audit = AuditRecord.objects.get(action="mcp.discovered", target_id=server.public_id)
    assert audit.actor_id == RUNNER_ID

    owner = world["owner"]
    action = action_request(
        actor=Principal(PrincipalKind.TOKEN, user=owner.user, token=owner.token),
        thread=thread,
        tool="mcp.call",
        args={
            "server": server.public_id,
            "tool": "get_current_time",
            "arguments": {"timezone": "UTC"},
        },
    )
    assert action.state == ActionState.QUEUED, action.decision

    def ended() -> bool:
        action.refresh_from_db()
        return action.state in {ActionState.SUCCEEDED, ActionState.FAILED}

    until(workers, "the mcp.call", ended)
    assert action.state == ActionState.SUCCEEDED, (action.error, logs(workers))
    assert action.result["server"] == server.public_id
    assert action.result["tool"] == "get_current_time" and action.result["is_error"] is False
    assert "UTC" in str(action.result["content"])
    receipt = Receipt.objects.get(action=action)
    assert receipt.runner == RUNNER_ID and receipt.args["pinned"]["name"] == "time"
    assert Action.objects.filter(pk=action.pk, args__pinned__profile__image=server.image_id)
