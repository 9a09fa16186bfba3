"""MCP discovery: the signed request and report (runners.contract.mcp_discovery) and the
runner's answer on real Docker (runners.mcp.discovery, ``Runner.handle_discovery``)."""

from __future__ import annotations

import multiprocessing
import os
import secrets
import signal
import time
from pathlib import Path
from typing import Any

import anyio
import docker
import docker.errors
import pytest
import redis

from runners.callstate import CallState
from runners.contract.mcp import DEFAULT_LIMITS, tool_definition_digest
from runners.contract.mcp_discovery import (
    DISCOVERY_REPORT_TYP,
    DiscoveryRefused,
    sign_discovery_report,
    sign_discovery_request,
    unverified_discovery_runner_id,
    verify_discovery_report,
    verify_discovery_request,
)
from runners.contract.names import command_audience
from runners.contract.tokens import _sign, generate_private_key_pem, public_key_pem
from runners.mcp.discovery import discover
from runners.mcp.servers import DockerMcpServers, remove_stale_mcp_servers
from runners.mcp.session import list_tools, server_session
from runners.runner import Disposition, Runner
from tests.runners.support import RUNNER_REDIS_URL, runner_config
from tests.runners.test_mcp_servers import (  # noqa: F401 - project_workspace: a fixture
    RISK,
    bridged_profile,
    call,
    listed,
    pin,
    project_workspace,
)
from tests.runners.test_mcp_servers import make_profile as make_server_profile

SERVER = "mcp_01ARZ3NDEKTSV4RRFFQ69G5FAV"
DISCOVERY = "mdi_01ARZ3NDEKTSV4RRFFQ69G5FAV"
POOL = "pool-h1"
CONTROL_KEY = generate_private_key_pem()
RUNNER_KEY = generate_private_key_pem()


def profile(image: str | None = "sha256:" + "a" * 64, **overrides: Any) -> dict[str, Any]:
    return {
        "server": SERVER,
        "reference": f"kestrel-test/h1-mcp@{image}",
        "image": image,
        "command": [],
        "workspace": "rw",
        "network": "none",
        "risk_acceptance": None,
        "limits": dict(DEFAULT_LIMITS),
        **overrides,
    }


def request_claims(**overrides: Any) -> dict[str, Any]:
    return {
        "aud": command_audience(POOL),
        "jti": DISCOVERY,
        "org": "org_1",
        "env": "env_1",
        "profile": profile(),
        "managed": None,
        **overrides,
    }


def verify_request(token: str, **kwargs: Any) -> Any:
    return verify_discovery_request(
        token, control_public_key=public_key_pem(CONTROL_KEY), pool=POOL, **kwargs
    )


def test_a_signed_request_verifies_with_exactly_its_claims() -> None:
    token = sign_discovery_request(request_claims(), CONTROL_KEY)
    request = verify_request(token)
    assert request.discovery == DISCOVERY and request.profile == profile()
    assert request.managed is None and len(request.request_digest) == 64
    managed = sign_discovery_request(
        request_claims(managed="time", profile=profile(image=None, workspace="none")),
        CONTROL_KEY,
    )
    assert verify_request(managed).profile["image"] is None
    bridged = profile(
        network="bridge",
        risk_acceptance="rsk_01ARZ3NDEKTSV4RRFFQ69G5FAV",
        risk_expires_at=2_000_000_000,
    )
    under_risk = sign_discovery_request(request_claims(profile=bridged), CONTROL_KEY)
    assert verify_request(under_risk).profile == bridged


def _refusal(token: str, **kwargs: Any) -> str:
    with pytest.raises(DiscoveryRefused) as refused:
        verify_request(token, **kwargs)
    return refused.value.code


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"extra": 1}, "malformed"),
        ({"iat": 1.5}, "malformed"),
        ({"jti": "call_1"}, "malformed"),
        ({"org": ""}, "malformed"),
        ({"managed": "ftp"}, "malformed"),
        ({"managed": True}, "malformed"),
        ({"profile": "x"}, "malformed"),
        ({"profile": profile(image=None)}, "malformed"),  # only a managed image is resolved
        ({"profile": profile(image="kestrel/x:latest")}, "malformed"),  # never a tag
        ({"profile": dict(profile(), extra=1)}, "malformed"),
        ({"profile": dict(profile(), limits=dict(DEFAULT_LIMITS, pids=128.0))}, "malformed"),
        ({"profile": dict(profile(), limits=dict(DEFAULT_LIMITS, pids=True))}, "malformed"),
        ({"profile": dict(profile(), server=SERVER + "\n")}, "malformed"),
        ({"profile": profile(network="bridge")}, "malformed"),  # no risk acceptance
        (  # bridged without saying when the risk acceptance lapses
            {
                "profile": profile(
                    network="bridge", risk_acceptance="rsk_01ARZ3NDEKTSV4RRFFQ69G5FAV"
                )
            },
            "malformed",
        ),
        ({"profile": profile(risk_expires_at=2_000_000_000)}, "malformed"),  # a lapse, no risk
        (
            {
                "profile": profile(
                    network="bridge",
                    risk_acceptance="rsk_01ARZ3NDEKTSV4RRFFQ69G5FAV",
                    risk_expires_at="2033-05-18T03:33:20Z",
                )
            },
            "malformed",
        ),
        (
            {
                "managed": "time",
                "profile": profile(
                    image=None, network="bridge", risk_acceptance="rsk_01ARZ3NDEKTSV4RRFFQ69G5FAV"
                ),
            },
            "malformed",
        ),
        ({"aud": command_audience("other")}, "wrong_audience"),
        ({"iss": "someone"}, "malformed"),
    ],
)
def test_a_request_with_a_wrong_claim_is_refused(change: dict[str, Any], code: str) -> None:
    assert _refusal(sign_discovery_request(request_claims(**change), CONTROL_KEY)) == code


def test_a_request_signed_otherwise_or_out_of_time_is_refused() -> None:
    assert _refusal(sign_discovery_request(request_claims(), RUNNER_KEY)) == "bad_signature"
    claims = request_claims()
    del claims["managed"]
    assert _refusal(sign_discovery_request(claims, CONTROL_KEY)) == "malformed"
    old = sign_discovery_request(request_claims(), CONTROL_KEY, now=int(time.time()) - 4000)
    assert _refusal(old) in ("expired", "malformed")
    stale = sign_discovery_request(
        request_claims(), CONTROL_KEY, ttl=60, now=int(time.time()) - 600
    )
    assert _refusal(stale) == "expired"
    long_lived = sign_discovery_request(request_claims(), CONTROL_KEY, ttl=7200)
    assert _refusal(long_lived) == "malformed"
    # Another token type under the same key: refused by its typ.
    payload = dict(request_claims(), iss="kestrel-control", iat=1, nbf=1, exp=2**31)
    command_typ = _sign(payload, CONTROL_KEY, typ="kestrel-command+jwt", kid="control")
    assert _refusal(command_typ) == "malformed"


def report_claims(**overrides: Any) -> dict[str, Any]:
    return {
        "iss": "run_h1",
        "discovery": DISCOVERY,
        "request_digest": "b" * 64,
        "image": "sha256:" + "a" * 64,
        "server_info": {"name": "h1-test", "version": "1.0"},
        "tools": [{"name": "echo", "description": "Return the text."}],
        "error": None,
        **overrides,
    }


def verify_report(token: str, key: bytes = RUNNER_KEY) -> Any:
    return verify_discovery_report(token, runner_public_key=public_key_pem(key))


def test_a_signed_report_verifies_and_names_its_runner() -> None:
    token = sign_discovery_report(report_claims(), RUNNER_KEY)
    assert unverified_discovery_runner_id(token) == "run_h1"
    report = verify_report(token)
    assert report.runner_id == "run_h1" and report.tools == report_claims()["tools"]
    failed = report_claims(tools=None, image=None, server_info=None)
    failed["error"] = {"code": "mcp_image_missing", "message": "no such image"}
    assert verify_report(sign_discovery_report(failed, RUNNER_KEY)).error == failed["error"]


@pytest.mark.parametrize(
    "change",
    [
        {"extra": 1},
        {"discovery": "mdi_x"},
        {"request_digest": "B" * 64},
        {"image": "kestrel/x:latest"},
        {"server_info": {"name": "x"}},
        {"server_info": {"name": "x", "version": 1}},
        {"tools": None},  # and no error
        {"error": {"code": "mcp_start_failed", "message": "x"}},  # and tools
        {"tools": [{"name": "echo", "icons": []}]},
        {"tools": [{"description": "nameless"}]},
        {"tools": [{"name": "x", "description": "d" * (16 * 1024 + 1)}]},
        {"tools": [{"name": "x", "inputSchema": {"d": "d" * 70_000}}]},
        {"tools": [{"name": f"t{i}"} for i in range(257)]},
        {"tools": None, "error": {"code": "x", "message": "m", "details": {}}},
        {"iat": "1"},
        {"iss": "not-a-runner"},
        {"aud": "someone-else"},
    ],
)
def test_a_report_with_a_wrong_claim_is_refused(change: dict[str, Any]) -> None:
    claims = report_claims(**change)
    kid = claims["iss"] if isinstance(claims["iss"], str) else "run_h1"
    payload = {"aud": "kestrel-control", "iat": int(time.time()), "jti": "j", **claims}
    payload.setdefault("exp", int(time.time()) + 60)
    if not isinstance(payload["iat"], int):
        payload["exp"] = int(time.time()) + 60
    token = _sign(payload, RUNNER_KEY, typ=DISCOVERY_REPORT_TYP, kid=kid)
    with pytest.raises(DiscoveryRefused) as refused:
        verify_report(token)
    assert refused.value.code in ("malformed", "wrong_audience")


def test_a_report_signed_by_another_key_or_under_another_kid_is_refused() -> None:
    with pytest.raises(DiscoveryRefused) as refused:
        verify_report(sign_discovery_report(report_claims(), CONTROL_KEY))
    assert refused.value.code == "bad_signature"
    now = int(time.time())
    payload = {"aud": "kestrel-control", "iat": now, "exp": now + 60, "jti": "j", **report_claims()}
    token = _sign(payload, RUNNER_KEY, typ=DISCOVERY_REPORT_TYP, kid="run_other")
    with pytest.raises(DiscoveryRefused) as refused:
        verify_report(token)
    assert refused.value.code == "wrong_runner"


# --- on the engine ----------------------------------------------------------------------


@pytest.fixture
def discovering_runner(
    tmp_path: Path, workspace_root: Path, runner_id: str, engine: Any
) -> tuple[Runner, list[str]]:
    reports: list[str] = []
    config = runner_config(
        tmp_path,
        runner_id=runner_id,
        pool=POOL,
        runner_key=RUNNER_KEY,
        control_public_key=public_key_pem(CONTROL_KEY),
        workspace_root=workspace_root,
    )
    from runners.mcp.discovery import discover

    runner = Runner(
        config=config,
        private_key=config.private_key(),
        control_public_key=config.control_public_key(),
        state=CallState(redis.Redis.from_url(RUNNER_REDIS_URL), worker="discovery"),
        report=lambda token: None,
        discover_mcp=lambda request: discover(
            request, runner_id=runner_id, client=docker.from_env()
        ),
        report_discovery=reports.append,
    )
    return runner, reports


def _discover(runner: Runner, reports: list[str], server_profile: dict[str, Any]) -> Any:
    token = sign_discovery_request(request_claims(profile=server_profile), CONTROL_KEY)
    assert runner.handle_discovery(token) is Disposition.APPLIED
    report = verify_report(reports.pop())
    assert report.runner_id == runner.config.runner_id
    assert report.request_digest == verify_request(token).request_digest
    return report


def _signed_request(server_profile: dict[str, Any]) -> Any:
    """A discovery request of ``server_profile`` as a runner verifies it."""
    return verify_request(
        sign_discovery_request(request_claims(profile=server_profile), CONTROL_KEY)
    )


def _discovery_containers(client: Any) -> list[Any]:
    return client.containers.list(all=True, filters={"label": f"io.kestrel.discovery={DISCOVERY}"})


@pytest.mark.docker
@pytest.mark.spec("MCP-1")
def test_discovery_lists_a_custom_servers_tools_as_the_call_check_digests_them(
    server_image: str, discovering_runner: tuple[Runner, list[str]], engine: Any, tmp_path: Path
) -> None:
    runner, reports = discovering_runner
    report = _discover(runner, reports, profile(server_image))
    assert report.error is None and report.image == server_image
    assert report.server_info == {"name": "h1-test", "version": "1.0"}
    names = [tool["name"] for tool in report.tools]
    assert names == ["echo", "append_note", "interfaces", "slow", "big", "poisoned"]
    assert report.tools[0]["annotations"] == {"readOnlyHint": True}

    # What the runner checks before a call: the same digests.
    async def listing() -> list[dict[str, Any]]:
        async with server_session(
            engine, profile(server_image), labels={"purpose": "test"}, workspace=tmp_path
        ) as (session, _init, _container):
            return await list_tools(session, timeout_s=30)

    live = {tool["name"]: tool_definition_digest(tool) for tool in anyio.run(listing)}
    assert {t["name"]: tool_definition_digest(t) for t in report.tools} == live
    assert _discovery_containers(engine) == []


@pytest.mark.docker
def test_a_listing_that_fails_fails_the_discovery_with_its_own_error(
    server_image: str, engine: Any, runner_id: str
) -> None:
    """What the listing raised inside the server's session came out wrapped in the SDK's
    exception groups, past ``discover``'s ``McpError``: no report was sent, and the server
    stayed "discovering" until the control plane's own timeout. It is the report's error."""
    command = ["python3", "/opt/h1-test/server.py", "--list-delay", "5"]
    request = _signed_request(profile(server_image, command=command))
    report = discover(request, runner_id=runner_id, list_timeout=1)
    assert report["tools"] is None and report["image"] == server_image
    assert report["error"] == {
        "code": "mcp_timeout",
        "message": "the server did not list its tools in time",
    }
    assert _discovery_containers(engine) == []


@pytest.mark.docker
def test_a_discovery_ends_within_the_runners_ceiling_with_a_report(
    server_image: str, engine: Any, runner_id: str
) -> None:
    """A discovery could take its start's 60 s and its listing's 60 s whatever the runner's
    KESTREL_MAX_CALL_SECONDS, within which Celery lets a task run: past it the worker was
    ended and no report sent, and the server stayed "discovering". Both now share that
    ceiling, and what is past it is the report's error."""
    command = ["python3", "/opt/h1-test/server.py", "--list-delay", "20"]
    request = _signed_request(profile(server_image, command=command))
    report = discover(request, runner_id=runner_id, max_seconds=10)
    assert report["tools"] is None and report["image"] == server_image
    assert report["error"]["code"] in {"mcp_timeout", "mcp_start_failed"}, report["error"]
    assert _discovery_containers(engine) == []


@pytest.mark.docker
@pytest.mark.spec("MCP-1")
def test_discovery_verifies_a_custom_image_against_the_engine(
    server_image: str, discovering_runner: tuple[Runner, list[str]], engine: Any
) -> None:
    runner, reports = discovering_runner
    cases = {
        "mcp_image_mismatch": [
            dict(profile(server_image), reference=f"other/repository@{server_image}"),
            dict(profile(server_image), reference=f"kestrel-test/h1-mcp@sha256:{'c' * 64}"),
            dict(profile(server_image), reference="kestrel-test/h1-mcp:latest"),
        ],
        "mcp_image_missing": [profile("sha256:" + "0" * 64)],
    }
    for code, profiles in cases.items():
        for server_profile in profiles:
            report = _discover(runner, reports, server_profile)
            assert report.tools is None and report.error["code"] == code, server_profile
    assert _discovery_containers(engine) == []


def test_a_runner_without_docker_answers_mcp_unavailable_and_a_bad_request_nothing(
    discovering_runner: tuple[Runner, list[str]],
) -> None:
    runner, reports = discovering_runner
    runner.discover_mcp = None
    report = _discover(runner, reports, profile())
    assert report.error["code"] == "mcp_unavailable"
    forged = sign_discovery_request(request_claims(), RUNNER_KEY)
    assert runner.handle_discovery(forged) is Disposition.REFUSED
    assert reports == []


@pytest.mark.spec("MCP-4")
def test_a_discovery_under_an_ended_risk_acceptance_starts_nothing(
    discovering_runner: tuple[Runner, list[str]], runner_redis: Any
) -> None:
    """A refresh's request signed before its server's risk acceptance ended names a bridged
    profile: once an ``mcp.risk.end`` reached the pool, it starts no server with a network
    (the call path's check, ``refuse_ended_risk``)."""
    runner, reports = discovering_runner
    started: list[Any] = []

    def discover(request: Any) -> dict[str, Any]:
        started.append(request)
        return {"image": None, "server_info": None, "tools": [], "error": None}

    runner.discover_mcp = discover
    bridged = bridged_profile("sha256:" + "a" * 64, RISK)
    runner.state.mark_risk_ended(RISK)
    report = _discover(runner, reports, bridged)
    assert report.error["code"] == "mcp_start_failed"
    assert f"{RISK} that let this server have a network has ended" in report.error["message"]
    assert started == []
    # Another acceptance's, or no network at all: discovered as ever.
    _discover(runner, reports, bridged_profile("sha256:" + "a" * 64, RISK[:-1] + "W"))
    _discover(runner, reports, profile())
    assert len(started) == 2


# --- what a killed discovering process leaves ----------------------------------------------

# A server that never answers: its discovery waits, its container running, until killed.
SILENT_SERVER = ["python3", "-c", "import time; time.sleep(600)"]


def _discover_until_killed(request: Any, runner_id: str) -> None:
    """A worker process's discovery (``runner.mcp_discover``), in a child the test kills."""
    discover(request, runner_id=runner_id, start_timeout=600)


def _start_discovering(server_image: str, runner_id: str, discovery: str) -> Any:
    silent = profile(server_image, command=SILENT_SERVER, workspace="none")
    # Verified here: the child, a new interpreter, has keys of its own.
    request = verify_request(
        sign_discovery_request(request_claims(jti=discovery, profile=silent), CONTROL_KEY)
    )
    child = multiprocessing.get_context("spawn").Process(
        target=_discover_until_killed, args=(request, runner_id)
    )
    child.start()
    return child


def _running_discovery(client: Any, discovery: str, timeout: float = 90) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for container in client.containers.list(
            filters={"label": f"io.kestrel.discovery={discovery}", "status": "running"}
        ):
            return container
        time.sleep(0.1)
    raise AssertionError(f"the discovery {discovery} started no server")


def _discovery_id() -> str:
    return "mdi_" + "".join(secrets.choice("0123456789ABCDEFGHJKMNPQRSTVWXYZ") for _ in range(26))


def _exists(client: Any, container: Any) -> bool:
    try:
        client.containers.get(container.id)
    except docker.errors.NotFound:
        return False
    return True


@pytest.mark.docker
def test_a_discovery_a_killed_worker_left_is_removed_and_live_servers_are_kept(
    server_image: str,
    engine: Any,
    runner_id: str,
    project: str,
    project_workspace: Path,  # noqa: F811 - the imported fixture
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A real SIGKILL of a discovering process: its server's container stays behind, running
    (under a risk acceptance it would keep its network). Runner start removes it, and so
    does the next discovery (the one a dead worker left is delivered again); a live relay's
    server and a running discovery's are kept."""
    warm = tmp_path / "warm"
    warm.mkdir(mode=0o700)
    monkeypatch.setenv("KESTREL_WARM_AGENT_DIR", str(warm))
    relays = DockerMcpServers(runner_id=runner_id, idle_seconds=120, max_servers=4, root=warm)
    server = make_server_profile(server_image)
    pinned = pin(server, listed(server, project_workspace)["echo"])
    discoveries = {name: _discovery_id() for name in ("killed", "live", "again")}
    children = {}
    try:
        answer = call(
            relays,
            pinned,
            "echo",
            {"text": "warm"},
            project=project,
            thread="thr_kept",
            workspace=project_workspace,
        )
        assert answer["content"][0]["text"] == "warm"
        (relay_server,) = engine.containers.list(filters={"label": f"io.kestrel.project={project}"})
        for name in ("killed", "live"):
            children[name] = _start_discovering(server_image, runner_id, discoveries[name])
        killed = _running_discovery(engine, discoveries["killed"])
        live = _running_discovery(engine, discoveries["live"])
        os.kill(children["killed"].pid, signal.SIGKILL)
        children["killed"].join(30)
        assert _exists(engine, killed)  # dead, the process removed nothing

        assert remove_stale_mcp_servers(runner_id) == 1
        assert not _exists(engine, killed)
        assert _exists(engine, live) and _exists(engine, relay_server)

        # Killed again, mid-discovery: the discovery delivered again removes what it left.
        children["again"] = _start_discovering(server_image, runner_id, discoveries["again"])
        again = _running_discovery(engine, discoveries["again"])
        os.kill(children["again"].pid, signal.SIGKILL)
        children["again"].join(30)
        report = discover(
            verify_request(
                sign_discovery_request(request_claims(profile=profile(server_image)), CONTROL_KEY)
            ),
            runner_id=runner_id,
        )
        assert report["error"] is None
        assert not _exists(engine, again)
        assert _exists(engine, live) and _exists(engine, relay_server)
        assert (
            call(
                relays,
                pinned,
                "echo",
                {"text": "still warm"},
                project=project,
                thread="thr_kept",
                workspace=project_workspace,
            )["content"][0]["text"]
            == "still warm"
        )
    finally:
        for child in children.values():
            if child.is_alive():
                os.kill(child.pid, signal.SIGKILL)
            child.join(30)
        relays.end_thread(project, "thr_kept")
        for discovery in discoveries.values():
            for container in engine.containers.list(
                all=True, filters={"label": f"io.kestrel.discovery={discovery}"}
            ):
                container.remove(force=True, v=True)
        deadline = time.monotonic() + 60
        while any(p.is_dir() for p in warm.glob("mcp-*")) and time.monotonic() < deadline:
            time.sleep(0.1)
