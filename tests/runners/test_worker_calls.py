"""What the runner does with each delivery of a command, in process, against real Redis.

``Runner.handle`` is the whole task body; here it runs with real call state (Redis DB 14),
real workspaces and real file tools, and reports into a list instead of the broker. The
real worker process, Docker and SIGKILL are in ``test_worker_process.py``.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kombu.exceptions
import pytest
import redis

from runners import dispatch
from runners.callstate import RETENTION_SECONDS, CallState, Lease, LeaseKeeper
from runners.config import RunnerConfig
from runners.contract.canonical import canonical_json, digest, token_digest
from runners.contract.registry import TOOLS
from runners.contract.tokens import (
    COMMAND_CLAIMS,
    RESULT_LIFETIME_SECONDS,
    generate_private_key_pem,
    public_key_pem,
    sign_command,
    sign_control_message,
    verify_result,
)
from runners.runner import Disposition, Runner
from runners.sandbox import (
    ExecResult,
    ExecSpec,
    ProbeResult,
    SandboxBackend,
    SandboxStartFailed,
    SandboxUnavailable,
)
from runners.started import StartedReport, daemon_timer
from runners.tools import processes
from tests.runners.support import runner_config
from tests.runners.test_mcp_servers import SERVER, make_profile, pin
from tests.runners.test_protocol import (
    CONTROL_KEY,
    CONTROL_PUBLIC,
    POOL,
    STRANGER_KEY,
    altered,
    command_claims,
    payload_of,
    raw_signed,
    with_payload,
)

pytestmark = pytest.mark.spec("RUN-1", "RUN-2", "RUN-7")

RUNNER_ID = "run_01JWORKERTEST"
PROJECT = "prj_01JPRJ"


@pytest.fixture
def state_client(runner_redis: redis.Redis) -> redis.Redis:
    return runner_redis


@pytest.fixture
def runner_key() -> bytes:
    return generate_private_key_pem()


@pytest.fixture
def config(tmp_path: Path, workspace_root: Path, runner_key: bytes) -> RunnerConfig:
    return runner_config(
        tmp_path,
        runner_id=RUNNER_ID,
        pool=POOL,
        runner_key=runner_key,
        control_public_key=CONTROL_PUBLIC,
        workspace_root=workspace_root,
    )


class ManualTimer:
    """Stands in for a started-report timer; it fires only when the test says so."""

    def __init__(self, delay_s: float, function: Callable[[], None]) -> None:
        self.delay_s = delay_s
        self.function = function
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    def fire(self) -> None:
        """Run the timer's function, cancelled or not: like a timer thread that had already
        woken up when the call was cancelled."""
        self.function()


class Recorder:
    """Stands in for the broker, the sandbox choice, the orphan reaper and the timers.

    Timers never fire on their own, so by default every call is a quick one.
    """

    def __init__(self) -> None:
        self.reports: list[str] = []
        self.executions: list[tuple[str, dict[str, Any]]] = []
        self.reaped: list[str] = []
        self.backend: SandboxBackend | None = None
        self.timers: list[ManualTimer] = []

    def start_timer(self, delay_s: float, function: Callable[[], None]) -> ManualTimer:
        timer = ManualTimer(delay_s, function)
        self.timers.append(timer)
        return timer

    def report(self, token: str) -> None:
        self.reports.append(token)

    def reap(self, call_id: str) -> int:
        self.reaped.append(call_id)
        return 0

    def choose_backend(self, preference: str) -> SandboxBackend:
        if self.backend is None:
            raise SandboxUnavailable("no sandbox backend works, refusing to run: test")
        return self.backend


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """Counts every call of ``runners.dispatch.run_verified``: the only way a tool runs."""
    recorder = Recorder()
    real_execute = dispatch.run_verified

    def spy(tool_name: str, args: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        recorder.executions.append((tool_name, args))
        return real_execute(tool_name, args, **kwargs)

    monkeypatch.setattr(dispatch, "run_verified", spy)
    return recorder


def make_runner(config: RunnerConfig, client: redis.Redis, recorder: Recorder, **kw) -> Runner:
    """A runner on real call state; ``report`` and ``start_timer`` replace the recorder's,
    the other keywords go to ``CallState``."""
    report = kw.pop("report", recorder.report)
    start_timer = kw.pop("start_timer", recorder.start_timer)
    return Runner(
        config=config,
        private_key=config.private_key(),
        control_public_key=config.control_public_key(),
        state=CallState(client, worker=kw.pop("worker", "test-worker"), **kw),
        report=report,
        choose_backend=recorder.choose_backend,
        reap_orphans=recorder.reap,
        start_timer=start_timer,
    )


@pytest.fixture
def runner(config: RunnerConfig, state_client: redis.Redis, recorder: Recorder) -> Runner:
    return make_runner(config, state_client, recorder)


def command(**overrides: Any) -> str:
    overrides.setdefault("prj", PROJECT)
    return sign_command(command_claims(**overrides), CONTROL_KEY)


def reports(recorder: Recorder, runner_key: bytes):
    public = public_key_pem(runner_key)
    return [
        verify_result(token, runner_public_key=public, runner_id=RUNNER_ID)
        for token in recorder.reports
    ]


# --- refusals: nothing is touched ------------------------------------------------------


def _tampered(claim: str) -> str:
    token = command()
    payload = payload_of(token)
    payload[claim] = altered(payload[claim])
    return with_payload(token, payload)


def _missing(claim: str) -> str:
    now = int(time.time())
    claims = command_claims(prj=PROJECT, iat=now, nbf=now, exp=now + 120)
    del claims[claim]
    return raw_signed({"typ": "kestrel-command+jwt", "kid": "control"}, canonical_json(claims))


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unsigned() -> str:
    header = _b64(b'{"alg":"none","kid":"control","typ":"kestrel-command+jwt"}')
    return f"{header}.{_b64(canonical_json(payload_of(command())))}."


def _hs256() -> str:
    header = _b64(b'{"alg":"HS256","kid":"control","typ":"kestrel-command+jwt"}')
    payload = _b64(canonical_json(payload_of(command())))
    mac = hmac.new(CONTROL_PUBLIC, f"{header}.{payload}".encode(), hashlib.sha256).digest()
    return f"{header}.{payload}.{_b64(mac)}"


def _args_swapped() -> str:
    token = command()
    payload = payload_of(token)
    payload["args"] = {"path": "marker.txt", "content": "evil"}
    payload["args_digest"] = digest(payload["args"])
    return with_payload(token, payload)


REFUSALS = {
    **{
        f"tampered-{claim}": (lambda c=claim: _tampered(c), "bad_signature")
        for claim in sorted(COMMAND_CLAIMS)
    },
    "wrong-audience": (lambda: command(aud="runner.green"), "wrong_audience"),
    "expired": (
        lambda: sign_command(command_claims(prj=PROJECT), CONTROL_KEY, now=int(time.time()) - 300),
        "expired",
    ),
    "not-yet-valid": (
        lambda: sign_command(command_claims(prj=PROJECT), CONTROL_KEY, now=int(time.time()) + 300),
        "not_yet_valid",
    ),
    "unsigned": (_unsigned, "bad_signature"),
    "hs256-with-public-key": (_hs256, "bad_signature"),
    "other-key": (
        lambda: sign_command(command_claims(prj=PROJECT), STRANGER_KEY),
        "bad_signature",
    ),
    "args-swapped-with-digest": (_args_swapped, "bad_signature"),
    "digest-mismatch": (
        lambda: command(args_digest=digest({"path": "x", "content": "y"})),
        "digest_mismatch",
    ),
    "unknown-tool": (lambda: command(tool="net.fetch"), "unknown_tool"),
    "invalid-args": (
        lambda: command(args={"path": "/etc/marker.txt", "content": "ran"}),
        "invalid_arguments",
    ),
    "extra-claim": (lambda: command(scope="admin"), "malformed"),
    **{
        f"missing-{claim}": (lambda c=claim: _missing(c), "malformed")
        for claim in sorted(COMMAND_CLAIMS)
    },
    "not-a-token": (lambda: "hello", "malformed"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refused_command_is_logged_and_never_executed(
    case, runner, recorder, state_client, workspace_root, caplog
):
    make_token, code = REFUSALS[case]
    token = make_token()
    caplog.set_level(logging.INFO, logger="kestrel.runner")

    assert runner.handle(token) is Disposition.REFUSED

    assert recorder.executions == []
    assert recorder.reports == []
    assert not (workspace_root / PROJECT / "marker.txt").exists()
    assert state_client.keys("*") == [], "a refused command must not touch call state"
    logged = [json.loads(record.getMessage()) for record in caplog.records]
    assert [(entry["event"], entry["code"]) for entry in logged] == [("command_refused", code)]
    if code not in {"bad_signature", "malformed"}:
        assert logged[0]["call_id"] == "act_01JTESTCALL"


def test_refusals_cover_every_command_claim():
    tampered = {case.removeprefix("tampered-") for case in REFUSALS if case.startswith("tampered")}
    missing = {case.removeprefix("missing-") for case in REFUSALS if case.startswith("missing")}
    claims = set(payload_of(command()))
    assert tampered == claims
    assert missing == claims


# --- a call's life -----------------------------------------------------------------------


def test_valid_command_runs_once_and_reports_its_result(
    runner, recorder, runner_key, workspace_root
):
    token = command()
    assert runner.handle(token) is Disposition.RAN

    assert (workspace_root / PROJECT / "marker.txt").read_text() == "ran"
    assert len(recorder.executions) == 1
    (finished,) = reports(recorder, runner_key)
    assert finished.event == "finished" and finished.outcome == "succeeded"
    assert finished.call_id == "act_01JTESTCALL"
    assert finished.command_digest == token_digest(token)
    assert finished.attempt == 1
    assert finished.runner_id == RUNNER_ID
    assert finished.result["size"] == 3
    # File tools start no process: the workspace's openat walk is their boundary, and the
    # receipt names it.
    assert finished.sandbox == "workspace"
    assert finished.started_at is not None and finished.finished_at is not None


def test_a_dedicated_runner_refuses_another_organizations_command_and_says_so(
    config, state_client, recorder, runner_key, workspace_root, caplog
):
    """A runner enrolled for one organization never claims, runs or stores a command bound to
    another one, however it reached its queue; its signed refusal lets the control plane
    record it. The same command bound to its own organization runs."""
    dedicated = make_runner(
        dataclasses.replace(config, organization="org_01JMINE"), state_client, recorder
    )
    caplog.set_level(logging.INFO, logger="kestrel.runner")

    assert dedicated.handle(command(org="org_01JORG")) is Disposition.REFUSED

    assert recorder.executions == []
    assert not (workspace_root / PROJECT / "marker.txt").exists()
    assert state_client.keys("*") == [], "a refused command must not touch call state"
    (refusal,) = reports(recorder, runner_key)
    assert refusal.outcome == "failed" and refusal.error["code"] == "wrong_organization"
    assert refusal.call_id == "act_01JTESTCALL"
    logged = [json.loads(record.getMessage()) for record in caplog.records]
    assert [(entry["event"], entry["code"]) for entry in logged] == [
        ("command_refused", "wrong_organization")
    ]
    assert dedicated.handle(command(org="org_01JMINE", jti="act_01JMINE")) is Disposition.RAN
    assert (workspace_root / PROJECT / "marker.txt").read_text() == "ran"


# --- the started report: only for calls that outlive the delay ---------------------------


def _tool_that(monkeypatch: pytest.MonkeyPatch, during: Callable[[], None]) -> None:
    """Make every tool call run ``during`` first, then the real tool."""
    real_execute = dispatch.run_verified

    def execute(tool_name: str, args: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        during()
        return real_execute(tool_name, args, **kwargs)

    monkeypatch.setattr(dispatch, "run_verified", execute)


@pytest.mark.spec("RUN-7")
def test_a_quick_call_sends_only_its_finished_report(runner, recorder, runner_key):
    assert runner.config.started_report_delay_s == 1.0  # the default

    runner.handle(command())

    (timer,) = recorder.timers
    assert timer.delay_s == 1.0
    assert timer.cancelled, "the timer is cancelled once the tool returned"
    (finished,) = reports(recorder, runner_key)
    assert finished.event == "finished" and finished.outcome == "succeeded"
    assert finished.started_at is not None  # the control plane records the start from it


@pytest.mark.spec("RUN-7")
def test_a_call_still_running_after_the_delay_sends_started_then_finished(
    runner, recorder, runner_key, monkeypatch
):
    # The delay runs out while the tool runs.
    _tool_that(monkeypatch, lambda: recorder.timers[-1].fire())

    runner.handle(command())

    started, finished = reports(recorder, runner_key)
    assert started.event == "started" and started.outcome is None
    assert finished.event == "finished" and finished.outcome == "succeeded"
    for report in (started, finished):
        assert report.call_id == "act_01JTESTCALL"
        assert report.attempt == 1
        assert report.runner_id == RUNNER_ID
    assert started.command_digest == finished.command_digest
    assert finished.started_at == started.started_at


@pytest.mark.spec("RUN-7")
def test_with_a_real_timer_a_long_call_reports_started_while_it_runs(
    config, state_client, recorder, runner_key, monkeypatch
):
    # The tool returns only once the started report was sent: no clock is read, and the
    # order is the point (a started report must reach the broker while the call runs).
    started_sent = threading.Event()

    def report(token: str) -> None:
        recorder.report(token)
        if len(recorder.reports) == 1:
            started_sent.set()

    def wait_for_started() -> None:
        assert started_sent.wait(timeout=30), "the started report never came"

    _tool_that(monkeypatch, wait_for_started)
    quick = dataclasses.replace(config, started_report_delay_s=0.05)
    runner = make_runner(quick, state_client, recorder, report=report, start_timer=daemon_timer)

    runner.handle(command())

    assert [r.event for r in reports(recorder, runner_key)] == ["started", "finished"]


@pytest.mark.spec("RUN-7")
def test_with_no_delay_started_is_sent_before_the_tool_runs(
    config, state_client, recorder, runner_key, monkeypatch
):
    seen_by_the_tool: list[int] = []
    _tool_that(monkeypatch, lambda: seen_by_the_tool.append(len(recorder.reports)))
    runner = make_runner(
        dataclasses.replace(config, started_report_delay_s=0), state_client, recorder
    )

    runner.handle(command())

    assert recorder.timers == [], "no timer: started goes at once, as before the delay"
    assert seen_by_the_tool == [1]
    assert [r.event for r in reports(recorder, runner_key)] == ["started", "finished"]


@pytest.mark.spec("RUN-7")
def test_a_timer_firing_after_the_call_finished_sends_nothing(runner, recorder, runner_key):
    runner.handle(command())
    (timer,) = recorder.timers

    # The timer thread woke up just as the call ended: cancel came too late to stop it.
    timer.fire()
    timer.fire()

    assert [r.event for r in reports(recorder, runner_key)] == ["finished"]


@pytest.mark.spec("RUN-7")
def test_a_timer_firing_while_the_finished_report_is_made_sends_nothing(
    runner, recorder, runner_key, monkeypatch
):
    # Fire the timer at the last moment it could: while the finished report is signed.
    real_finished = Runner._finished

    def finished_with_a_late_timer(self: Runner, *args: Any, **kwargs: Any) -> str:
        recorder.timers[-1].fire()
        return real_finished(self, *args, **kwargs)

    monkeypatch.setattr(Runner, "_finished", finished_with_a_late_timer)

    runner.handle(command())

    assert [r.event for r in reports(recorder, runner_key)] == ["finished"]


@pytest.mark.spec("RUN-7")
def test_a_started_report_being_sent_is_sent_before_the_call_can_finish():
    # The timer's send is under way (held in the broker call) when the call ends: finish()
    # must wait for it, so the finished report cannot overtake it.
    events: list[str] = []
    sending, release = threading.Event(), threading.Event()
    timers: list[ManualTimer] = []

    def send() -> None:
        sending.set()
        assert release.wait(timeout=30)
        events.append("started sent")

    def start_timer(delay_s: float, function: Callable[[], None]) -> ManualTimer:
        timers.append(ManualTimer(delay_s, function))
        return timers[-1]

    started = StartedReport(send, delay_s=1.0, timer=start_timer)
    timer_thread = threading.Thread(target=timers[0].fire)
    timer_thread.start()
    assert sending.wait(timeout=30)

    def finish() -> None:
        started.finish()
        events.append("finish returned")

    finishing = threading.Thread(target=finish)
    finishing.start()
    release.set()
    timer_thread.join(timeout=30)
    finishing.join(timeout=30)

    assert events == ["started sent", "finish returned"]
    timers[0].fire()  # and nothing more afterwards
    assert events == ["started sent", "finish returned"]


@pytest.mark.spec("RUN-7")
def test_a_started_report_that_cannot_be_sent_is_a_warning(
    runner, recorder, runner_key, monkeypatch, caplog
):
    def broker_refuses_started(token: str) -> None:
        if (
            verify_result(
                token, runner_public_key=public_key_pem(runner_key), runner_id=RUNNER_ID
            ).event
            == "started"
        ):
            raise kombu.exceptions.OperationalError("broker down")
        recorder.report(token)

    runner.report = broker_refuses_started
    _tool_that(monkeypatch, lambda: recorder.timers[-1].fire())
    caplog.set_level(logging.WARNING, logger="kestrel.runner")

    assert runner.handle(command()) is Disposition.RAN

    assert [r.event for r in reports(recorder, runner_key)] == ["finished"]
    assert "could not send the started report of call act_01JTESTCALL" in caplog.text


def test_redelivered_finished_call_whose_report_went_out_runs_and_sends_nothing(runner, recorder):
    token = command()
    runner.handle(token)
    assert len(recorder.reports) == 1

    assert runner.handle(token) is Disposition.REPORTED
    assert runner.handle(command(attempt=2)) is Disposition.REPORTED
    assert len(recorder.reports) == 1
    assert len(recorder.executions) == 1


def _broker_refuses_once(recorder: Recorder) -> Callable[[str], None]:
    refused: list[str] = []

    def report(token: str) -> None:
        if not refused:
            refused.append(token)
            raise kombu.exceptions.OperationalError("broker down")
        recorder.report(token)

    return report


def test_a_report_the_broker_did_not_take_is_resent_to_the_next_delivery(
    config, state_client, recorder
):
    runner = make_runner(config, state_client, recorder, report=_broker_refuses_once(recorder))
    token = command()
    with pytest.raises(kombu.exceptions.OperationalError):
        runner.handle(token)  # the worker hands the message back (runners.worker)

    assert runner.handle(token) is Disposition.RESENT
    assert runner.handle(command(attempt=2)) is Disposition.REPORTED
    assert len(recorder.reports) == 1
    assert len(recorder.executions) == 1


@pytest.mark.spec("CRED-1")
def test_call_state_keeps_no_output_once_the_report_went_out(
    runner, recorder, runner_key, state_client, workspace_root
):
    secret = "ghp_" + "S3cr3tT0k3nValue" * 3
    (workspace_root / PROJECT).mkdir(exist_ok=True)
    (workspace_root / PROJECT / "notes.txt").write_text(secret)
    token = command(tool="fs.read", args={"path": "notes.txt"})
    runner.handle(token)
    (finished,) = reports(recorder, runner_key)
    assert finished.result["content"] == secret  # the report itself carries the output

    stored = state_client.get("kestrel:result:act_01JTESTCALL").decode()
    assert stored == "reported:" + token_digest(finished.raw)
    for key in state_client.scan_iter("*"):
        assert secret.encode() not in (state_client.get(key) or b"")
    # Kept while a copy of the command could still verify, not for days.
    assert 0 < state_client.ttl("kestrel:result:act_01JTESTCALL") <= RETENTION_SECONDS
    assert 0 < state_client.ttl("kestrel:call:act_01JTESTCALL") <= RETENTION_SECONDS
    assert RETENTION_SECONDS < 2 * 3600


def test_an_unsent_report_is_kept_no_longer_than_it_can_be_accepted(config, state_client, recorder):
    runner = make_runner(config, state_client, recorder, report=_broker_refuses_once(recorder))
    with pytest.raises(kombu.exceptions.OperationalError):
        runner.handle(command())
    ttl = state_client.ttl("kestrel:result:act_01JTESTCALL")
    assert 0 < ttl <= RESULT_LIFETIME_SECONDS


def test_copy_of_a_call_running_elsewhere_is_dropped_as_replayed(
    config, state_client, runner, recorder, caplog
):
    token = command()
    elsewhere = CallState(state_client, worker="other-worker")
    lease = elsewhere.claim("act_01JTESTCALL", attempt=1, command_digest=token_digest(token))
    caplog.set_level(logging.INFO, logger="kestrel.runner")

    with LeaseKeeper(elsewhere, lease, interval=0.2):
        assert runner.handle(token) is Disposition.REPLAYED

    assert recorder.executions == []
    assert recorder.reports == []
    logged = [json.loads(record.getMessage()) for record in caplog.records]
    assert logged[-1]["code"] == "replayed"
    assert logged[-1]["call_id"] == "act_01JTESTCALL"


def _dead_lease(state_client: redis.Redis, token: str, *, accepted_at: float | None = None):
    """The lease a worker left when it died: claimed, never refreshed, now expired."""
    now = time.time()
    lease = Lease(
        call_id="act_01JTESTCALL",
        holder="dead-worker#1",
        worker="dead-worker",
        attempt=1,
        command_digest=token_digest(token),
        accepted_at=now - 30 if accepted_at is None else accepted_at,
        lease_until=now - 1,
    )
    state_client.set("kestrel:call:act_01JTESTCALL", lease.encode())


@pytest.mark.spec("RUN-9")
def test_idempotent_call_of_a_dead_worker_runs_again(
    runner, recorder, runner_key, state_client, workspace_root
):
    token = command()
    _dead_lease(state_client, token)

    assert runner.handle(token) is Disposition.RERAN

    assert recorder.reaped == ["act_01JTESTCALL"]
    assert len(recorder.executions) == 1
    finished = reports(recorder, runner_key)[-1]
    assert finished.outcome == "succeeded"
    assert (workspace_root / PROJECT / "marker.txt").read_text() == "ran"


@pytest.mark.spec("RUN-9")
def test_non_idempotent_call_of_a_dead_worker_ends_runner_lost(
    runner, recorder, runner_key, state_client, workspace_root
):
    (workspace_root / PROJECT).mkdir(exist_ok=True)
    (workspace_root / PROJECT / "keep.txt").write_text("still here")
    token = command(tool="fs.delete", args={"path": "keep.txt"})
    _dead_lease(state_client, token)

    assert runner.handle(token) is Disposition.LOST

    assert recorder.executions == []
    assert recorder.reaped == ["act_01JTESTCALL"]
    assert (workspace_root / PROJECT / "keep.txt").read_text() == "still here"
    (lost,) = reports(recorder, runner_key)
    assert lost.event == "finished" and lost.outcome == "failed"
    assert lost.error["code"] == "runner_lost"
    # Every later delivery finds the call ended and reported; the tool never runs.
    assert runner.handle(token) is Disposition.REPORTED
    assert recorder.reports == [lost.raw]
    assert recorder.executions == []


@pytest.mark.spec("RUN-9")
def test_lease_of_a_worker_that_just_died_is_waited_out_not_dropped(
    config, state_client, recorder, runner_key
):
    # A killed child's message is requeued at once, while its lease is still live for a
    # moment: the copy must wait for the lease to run out and recover, not be dropped.
    token = command(tool="fs.delete", args={"path": "keep.txt"})
    dead = CallState(state_client, worker="dead-worker", lease_seconds=1.5)
    dead.claim("act_01JTESTCALL", attempt=1, command_digest=token_digest(token))
    runner = make_runner(config, state_client, recorder)

    assert runner.handle(token) is Disposition.LOST
    assert reports(recorder, runner_key)[-1].error["code"] == "runner_lost"


@pytest.mark.spec("RUN-9")
def test_expired_redelivery_of_a_command_accepted_in_time_is_recovered(
    runner, recorder, runner_key, state_client
):
    now = int(time.time())
    token = sign_command(command_claims(prj=PROJECT), CONTROL_KEY, ttl=120, now=now - 600)
    _dead_lease(state_client, token, accepted_at=now - 590)

    assert runner.handle(token) is Disposition.RERAN
    assert reports(recorder, runner_key)[-1].outcome == "succeeded"


def test_expired_command_never_accepted_is_refused(runner, recorder, state_client):
    now = int(time.time())
    token = sign_command(command_claims(prj=PROJECT), CONTROL_KEY, ttl=120, now=now - 600)
    assert runner.handle(token) is Disposition.REFUSED

    # Nor does a state left by a different token for the same call id make it acceptable.
    _dead_lease(state_client, command(), accepted_at=now - 590)
    assert runner.handle(token) is Disposition.REFUSED
    assert recorder.executions == []


def test_concurrent_deliveries_run_the_call_once(config, state_client, recorder, workspace_root):
    token = command()
    runners = [make_runner(config, state_client, recorder, worker=f"w{i}") for i in range(4)]
    outcomes: list[Disposition] = []
    threads = [
        threading.Thread(target=lambda r=r: outcomes.append(r.handle(token))) for r in runners
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    assert outcomes.count(Disposition.RAN) == 1
    assert set(outcomes) <= {
        Disposition.RAN,
        Disposition.RESENT,
        Disposition.REPORTED,
        Disposition.REPLAYED,
    }
    assert len(recorder.executions) == 1


# --- failures become typed results -------------------------------------------------------


class FailsAfterProbe(SandboxBackend):
    """Passes its probe, then cannot start the command (RUN-5)."""

    name = "flaky"

    def __init__(self) -> None:
        self.runs: list[ExecSpec] = []

    def probe(self, workspace: Path) -> ProbeResult:
        return ProbeResult(self.name, True, False, "ok")

    def run(self, spec: ExecSpec) -> ExecResult:
        self.runs.append(spec)
        raise SandboxStartFailed("flaky: cannot start")


class Records(SandboxBackend):
    """Passes its probe and records what it was asked to run."""

    name = "recording"

    def __init__(self) -> None:
        self.runs: list[ExecSpec] = []

    def probe(self, workspace: Path) -> ProbeResult:
        return ProbeResult(self.name, True, False, "ok")

    def run(self, spec: ExecSpec) -> ExecResult:
        self.runs.append(spec)
        return ExecResult(0, "out", "", False, 1, False, False, self.name)


def _finished(recorder: Recorder, runner_key: bytes):
    final = reports(recorder, runner_key)[-1]
    assert final.event == "finished"
    return final


def test_no_sandbox_fails_the_call_closed(runner, recorder, runner_key):
    runner.handle(command(tool="shell.exec", args={"script": "echo hi"}))
    final = _finished(recorder, runner_key)
    assert final.outcome == "failed"
    assert final.error["code"] == "sandbox_unavailable"
    assert final.sandbox == "none"


def test_backend_that_fails_after_its_probe_is_not_retried(runner, recorder, runner_key):
    recorder.backend = FailsAfterProbe()
    runner.handle(command(tool="shell.exec", args={"script": "echo hi"}))
    final = _finished(recorder, runner_key)
    assert final.error["code"] == "sandbox_start_failed"
    assert final.sandbox == "flaky"
    assert len(recorder.backend.runs) == 1


def test_workspace_errors_are_reported_with_their_code(runner, recorder, runner_key):
    runner.handle(command(tool="fs.read", args={"path": "missing.txt"}))
    assert _finished(recorder, runner_key).error["code"] == "path_not_found"


def test_symlink_escape_is_reported_as_refused(runner, recorder, runner_key, workspace_root):
    (workspace_root / PROJECT).mkdir(exist_ok=True)
    os.symlink("/etc/hostname", workspace_root / PROJECT / "escape")
    runner.handle(command(tool="fs.read", args={"path": "escape"}))
    assert _finished(recorder, runner_key).error["code"] == "path_refused"


def test_unexpected_crash_becomes_internal_error(runner, recorder, runner_key, monkeypatch):
    def explode(*args: Any, **kwargs: Any) -> dict[str, Any]:
        raise RuntimeError("boom")

    monkeypatch.setattr(dispatch, "run_verified", explode)
    runner.handle(command())
    final = _finished(recorder, runner_key)
    assert final.error == {"code": "internal_error", "message": "the runner failed unexpectedly"}


def test_command_limits_are_capped_by_the_runner_and_calls_are_labelled(
    runner, recorder, runner_key
):
    recorder.backend = Records()
    limits = {"timeout_s": 3600, "memory_mb": 300, "cpus": 0.5, "pids": 40, "output_kb": 16}
    runner.handle(command(tool="shell.exec", args={"script": "true"}, limits=limits))

    assert _finished(recorder, runner_key).outcome == "succeeded"
    (spec,) = recorder.backend.runs
    assert spec.limits.timeout_s == 20  # KESTREL_MAX_CALL_SECONDS
    assert (spec.limits.memory_mb, spec.limits.cpus, spec.limits.pids) == (300, 0.5, 40)
    assert dict(spec.labels) == {
        "call": "act_01JTESTCALL",
        "project": PROJECT,
        "thread": "thr_01JTHR",
        "runner": RUNNER_ID,
    }


def test_process_tools_are_exactly_the_sandboxed_implementations():
    sandboxed = {
        name for name, spec in TOOLS.items() if spec.implementation.__module__ == processes.__name__
    }
    # mcp.call's process is its server's container (runners.mcp), hardened like a sandbox's
    # and started only on the Docker backend; it runs no command in the call's sandbox.
    runs_process = {name for name, spec in TOOLS.items() if spec.runs_process}
    assert sandboxed == runs_process - {"mcp.call"}


class NoControlPlane:
    """An adapter transport no request reaches: these calls make none."""

    def send(self, token: str) -> None:
        raise AssertionError("no adapter request was made")

    def wait(self, key: str, timeout_s: float) -> str | None:
        raise AssertionError("no adapter request was made")


def mcp_call_args() -> dict[str, Any]:
    tool = {"name": "get_current_time", "inputSchema": {"type": "object"}}
    profile = make_profile("sha256:" + "0" * 64)
    return {"server": SERVER, "tool": tool["name"], "arguments": {}, "pinned": pin(profile, tool)}


@pytest.mark.spec("CRED-3")
def test_only_a_process_of_the_calls_own_gets_an_adapter_broker(
    runner, recorder, runner_key, monkeypatch
):
    """shell.exec and code.python run in the call's sandbox and get its broker's directory;
    mcp.call's process is its server's container, started for the thread, which never sees a
    call's socket: no broker is opened for it."""
    recorder.backend = Records()
    runner.adapter_transport = NoControlPlane()
    adapter_dirs: dict[str, Path | None] = {}
    spied = dispatch.run_verified

    def spy(tool_name: str, args: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        adapter_dirs[tool_name] = kwargs["adapter_dir"]
        return spied(tool_name, args, **kwargs)

    monkeypatch.setattr(dispatch, "run_verified", spy)
    runner.handle(command(tool="shell.exec", args={"script": "true"}))
    runner.handle(command(jti="act_01JTESTCALLPY", tool="code.python", args={"code": "1"}))
    runner.handle(command(jti="act_01JTESTCALLMCP", tool="mcp.call", args=mcp_call_args()))

    assert set(adapter_dirs) == {"shell.exec", "code.python", "mcp.call"}
    assert adapter_dirs["shell.exec"] is not None
    assert adapter_dirs["code.python"] is not None
    assert adapter_dirs["mcp.call"] is None
    # This runner has no Docker sandbox, so the call itself fails as it always did.
    assert _finished(recorder, runner_key).error["code"] == "mcp_unavailable"
    assert {name for name, spec in TOOLS.items() if spec.adapter_broker} == {
        "shell.exec",
        "code.python",
    }


def test_a_deleted_projects_workspace_goes_even_when_its_containers_cannot_be_stopped(
    runner, workspace_root, caplog
):
    """The project's warm containers go first; an engine that fails then does not keep its
    workspace on the host."""
    workspace = workspace_root / PROJECT
    workspace.mkdir()
    (workspace / "notes.txt").write_text("deleted with the project")

    def engine_gone(project: str) -> int:
        raise RuntimeError("the engine does not answer")

    runner.end_project = engine_gone
    notice = sign_control_message(
        {
            "aud": f"runner.{POOL}",
            "type": "project.delete",
            "org": "org_01JORG",
            "env": "env_01JENV",
            "prj": PROJECT,
            "thr": None,
            "rsk": None,
        },
        CONTROL_KEY,
    )
    with caplog.at_level(logging.INFO, logger="kestrel.runner"):
        assert runner.handle_control(notice) is Disposition.APPLIED
    assert not workspace.exists()
    assert "project_containers_remove_failed" in caplog.text
    assert "workspace_removed" in caplog.text
