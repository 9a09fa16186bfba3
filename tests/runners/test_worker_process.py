"""A real runner process, a real broker, real Docker: round trips, replays and SIGKILL.

The runner is started the way an operator starts it (``python -m runners worker``) with
only its ``KESTREL_*`` variables: no database URL, no secret but its own key file. The
test plays the control plane: it signs commands with a test control key, sends them by
task name to ``runner.<pool>``, and reads the signed reports from queue ``control``
with a plain kombu consumer, verifying each with the runner's public key. Every wait is
bounded; nothing asserts on timing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker
import pytest
import redis
from celery import Celery
from django.conf import settings
from kombu import Connection

from runners.contract.canonical import token_digest
from runners.contract.inventory import WorkspaceInventory, verify_workspace_inventory
from runners.contract.tokens import (
    Heartbeat,
    RunnerReport,
    generate_private_key_pem,
    public_key_pem,
    sign_command,
    unverified_call_id,
    verify_heartbeat,
    verify_result,
)
from runners.sandbox.docker import LABEL_PREFIX
from runners.sandbox.warm_host import containers_running_call
from tests.runners.support import RUNNER_REDIS_URL, runner_config, worker_environment

pytestmark = [pytest.mark.docker, pytest.mark.spec("RUN-1", "RUN-2", "RUN-7")]

REPO = Path(__file__).resolve().parents[2]
MAX_CALL_SECONDS = 20  # visibility timeout 80 s: a killed worker's calls come back quickly
PROJECT = "prj_01JPROCESS"
# Names a process may add to the environment it was started with (Celery marks its pool).
PROCESS_ADDED_NAMES = frozenset()
LIMITS = {"timeout_s": 15, "memory_mb": 128, "cpus": 1, "pids": 64, "output_kb": 64}


class RunnerProcess:
    """``python -m runners worker`` in its own process group, so SIGKILL takes it whole."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.env = env
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    def start(self, *, concurrency: int = 2) -> None:
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "runners", "worker", "--concurrency", str(concurrency)],
                cwd=REPO,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_for(
            lambda: b" ready." in self.log_path.read_bytes()[offset:],
            timeout=60,
            what="the runner worker to be ready",
            detail=self.log_tail,
        )

    def environments(self) -> dict[int, dict[str, str]]:
        """The environment of every live process in the worker's session, from /proc."""
        assert self.process is not None
        found: dict[int, dict[str, str]] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if os.getsid(int(entry.name)) != self.process.pid:
                    continue
                raw = (entry / "environ").read_bytes()
            except (ProcessLookupError, FileNotFoundError, PermissionError):
                continue
            pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
            found[int(entry.name)] = {k.decode(): v.decode(errors="replace") for k, v in pairs}
        return found

    def kill(self) -> None:
        """SIGKILL the worker and its pool children at once, like a lost host."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        self.process = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self) -> str:
        return self.log()[-3000:]


class FakeControl:
    """The control plane's side of the wire, reduced to signing, sending and collecting."""

    def __init__(self, control_key: bytes, runner_public: bytes, runner_id: str, pool: str):
        self.control_key = control_key
        self.runner_public = runner_public
        self.runner_id = runner_id
        self.pool = pool
        self.app = Celery("fake-control", broker=RUNNER_REDIS_URL, set_as_current=False)
        self.app.conf.update(task_serializer="json", accept_content=["json"])
        self.connection = Connection(RUNNER_REDIS_URL)
        self.inbox = self.connection.SimpleQueue("reports")
        self.reports: list[RunnerReport] = []
        self.heartbeats: list[Heartbeat] = []
        self.inventories: list[WorkspaceInventory] = []

    def close(self) -> None:
        self.inbox.close()
        self.connection.release()

    def command(
        self,
        tool: str,
        args: dict[str, Any],
        *,
        call_id: str | None = None,
        now: int | None = None,
    ) -> str:
        return sign_command(
            {
                "iss": "kestrel-control",
                "aud": f"runner.{self.pool}",
                "jti": call_id or f"act_{uuid.uuid4().hex}",
                "org": "org_01JORG",
                "env": "env_01JENV",
                "prj": PROJECT,
                "thr": "thr_01JTHR",
                "tool": tool,
                "args": args,
                "policy_version": "pol_1",
                "limits": LIMITS,
                "attempt": 1,
            },
            self.control_key,
            now=now,
        )

    def send(self, token: str) -> None:
        self.app.send_task("runner.execute", args=[token], queue=f"runner.{self.pool}")

    def drain(self) -> None:
        """Read every report waiting on queue ``control``; each must verify."""
        while True:
            try:
                message = self.inbox.get(block=True, timeout=0.2)
            except self.inbox.Empty:
                return
            message.ack()
            (token,), _kwargs, _embed = message.payload
            if message.headers["task"] == "control.runner_heartbeat":
                self.heartbeats.append(
                    verify_heartbeat(
                        token, runner_public_key=self.runner_public, runner_id=self.runner_id
                    )
                )
                continue
            if message.headers["task"] == "control.runner_workspaces":
                self.inventories.append(
                    verify_workspace_inventory(
                        token, runner_public_key=self.runner_public, runner_id=self.runner_id
                    )
                )
                continue
            assert message.headers["task"] == "control.ingest_result"
            self.reports.append(
                verify_result(token, runner_public_key=self.runner_public, runner_id=self.runner_id)
            )

    def reports_for(self, call_id: str, event: str | None = None) -> list[RunnerReport]:
        return [
            report
            for report in self.reports
            if report.call_id == call_id and (event is None or report.event == event)
        ]

    def wait(self, condition: Callable[[], bool], *, timeout: float, what: str) -> None:
        def ready() -> bool:
            self.drain()
            return condition()

        wait_for(ready, timeout=timeout, what=what, detail=self.summary)

    def finished(self, call_id: str, *, timeout: float = 60) -> RunnerReport:
        self.wait(
            lambda: bool(self.reports_for(call_id, "finished")),
            timeout=timeout,
            what=f"call {call_id} to finish",
        )
        return self.reports_for(call_id, "finished")[0]

    def summary(self) -> str:
        return "\n".join(f"{r.call_id} {r.event} {r.outcome} {r.error}" for r in self.reports[-40:])


def wait_for(
    condition: Callable[[], bool],
    *,
    timeout: float,
    what: str,
    detail: Callable[[], str] = lambda: "",
) -> None:
    """Poll until ``condition`` holds; fail naming ``what`` once ``timeout`` has passed."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what} after {timeout} s\n{detail()}")
        time.sleep(0.1)


@pytest.fixture
def broker(runner_redis: redis.Redis) -> redis.Redis:
    return runner_redis


@pytest.fixture
def runner_setup(tmp_path: Path, workspace_root: Path, docker_backend, broker):
    """Keys, an environment with nothing but the runner's variables, and a fake control."""
    pool = f"t{uuid.uuid4().hex[:10]}"
    runner_id = f"run_{uuid.uuid4().hex[:12]}"
    control_key = generate_private_key_pem()
    config = runner_config(
        tmp_path,
        runner_id=runner_id,
        pool=pool,
        runner_key=generate_private_key_pem(),
        control_public_key=public_key_pem(control_key),
        workspace_root=workspace_root,
        max_call_seconds=MAX_CALL_SECONDS,
    )
    process = RunnerProcess(worker_environment(config), tmp_path / "runner.log")
    control = FakeControl(
        control_key, public_key_pem(config.key_file.read_bytes()), runner_id, pool
    )
    yield process, control
    process.kill()
    control.close()
    client = docker.from_env()
    for container in client.containers.list(
        all=True, filters={"label": f"{LABEL_PREFIX}runner={runner_id}"}
    ):
        container.remove(force=True)
    client.close()


def test_round_trip_write_read_exec_through_docker(runner_setup, workspace_root):
    runner, control = runner_setup
    # Longer than any of these calls can take: each sends its finished report only.
    runner.env["KESTREL_STARTED_REPORT_DELAY_SECONDS"] = "600"
    runner.start()
    # What the running worker and its pool children really hold, read from /proc: no
    # database, no control-plane secret, nothing of the test process beyond what it was given.
    environments = runner.environments()
    assert len(environments) >= 2, "expected the worker and its pool children"
    for environ in environments.values():
        assert not {name for name in environ if "DATABASE" in name or "SECRET" in name}
        assert "DJANGO_SETTINGS_MODULE" not in environ
        assert set(environ) - set(runner.env) <= PROCESS_ADDED_NAMES, set(environ) - set(runner.env)
        assert settings.SECRET_KEY not in "\0".join(environ.values())

    write = control.command("fs.write", {"path": "notes/hello.txt", "content": "hello, kestrel"})
    control.send(write)
    written = control.finished(_call_id(write))
    assert written.outcome == "succeeded", written.error
    assert written.result["size"] == len("hello, kestrel")

    read = control.command("fs.read", {"path": "notes/hello.txt"})
    control.send(read)
    assert control.finished(_call_id(read)).result["content"] == "hello, kestrel"

    shell = control.command(
        "shell.exec",
        {"script": 'cat notes/hello.txt; echo " $GREETING" >&2; exit 3', "env": {"GREETING": "hi"}},
    )
    control.send(shell)
    executed = control.finished(_call_id(shell))
    assert executed.outcome == "succeeded", executed.error
    assert executed.sandbox == "docker"
    assert (executed.result["stdout"], executed.result["stderr"]) == ("hello, kestrel", " hi\n")
    assert executed.result["exit_code"] == 3

    control.drain()
    for token in (write, read, shell):
        (report,) = control.reports_for(_call_id(token))
        assert report.event == "finished" and report.started_at is not None
        assert report.command_digest == token_digest(token)
        assert report.runner_id == runner.env["KESTREL_RUNNER_ID"]
        assert report.attempt == 1
    assert written.sandbox == "workspace"  # a file tool's boundary is the workspace walk
    assert (workspace_root / PROJECT / "notes" / "hello.txt").read_text() == "hello, kestrel"
    # The worker said it was up, signed, with the backend its probe passed.
    assert control.heartbeats, "no heartbeat arrived"
    assert {beat.sandbox for beat in control.heartbeats} == {"docker"}
    assert {beat.pool for beat in control.heartbeats} == {control.pool}
    # And which workspaces its host keeps, signed, as soon as it was ready.
    assert control.inventories, "no workspace inventory arrived"
    assert {part.pool for part in control.inventories} == {control.pool}


def test_tampered_commands_sent_to_the_worker_do_nothing(runner_setup, workspace_root):
    runner, control = runner_setup
    runner.start()
    marker = {"path": "tampered.txt", "content": "ran"}
    header, payload, signature = control.command("fs.write", marker).split(".")
    other_pool = FakeControl(control.control_key, control.runner_public, "run_x", "elsewhere")
    stranger = FakeControl(generate_private_key_pem(), control.runner_public, "run_x", control.pool)
    tampered = [
        f"{header}.{payload}.{signature[:-4]}AAAA",
        stranger.command("fs.write", marker),
        other_pool.command("fs.write", marker),
        control.command("fs.write", marker, now=int(time.time()) - 600),
        control.command("net.fetch", marker),
        control.command("fs.write", {"path": "../tampered.txt", "content": "ran"}),
    ]
    other_pool.close()
    stranger.close()
    for token in tampered:
        control.send(token)

    wait_for(
        lambda: runner.log().count('"event": "command_refused"') >= len(tampered),
        timeout=60,
        what="every tampered command to be refused",
        detail=runner.log_tail,
    )
    control.drain()
    assert control.reports == []
    assert not (workspace_root / PROJECT / "tampered.txt").exists()
    log = runner.log()
    for code in ("bad_signature", "wrong_audience", "expired", "unknown_tool", "invalid_arguments"):
        assert f'"code": "{code}"' in log
    assert ": 'refused'" in log and ": 'ran'" not in log


@pytest.mark.spec("RUN-1", "RUN-9")
def test_replayed_command_runs_once(runner_setup, workspace_root):
    runner, control = runner_setup
    runner.env["KESTREL_STARTED_REPORT_DELAY_SECONDS"] = "0"  # every run sends "started"
    runner.start(concurrency=2)
    token = control.command("shell.exec", {"script": "echo ran >> effects.log; sleep 1"})
    call_id = _call_id(token)

    for _ in range(3):  # two run side by side: one claims, the other sees a live lease
        control.send(token)
    control.wait(
        lambda: runner.log().count("runner.execute[") >= 6,  # received + finished, x3
        timeout=90,
        what="all three deliveries to be handled",
    )
    # After the call ended and its report went out, a copy runs nothing and sends nothing:
    # the call state keeps only that the report went out, not the report (its output).
    control.send(token)
    control.wait(
        lambda: "result_already_reported" in runner.log(),
        timeout=60,
        what="the copy to be dropped as already reported",
    )

    assert (workspace_root / PROJECT / "effects.log").read_text() == "ran\n"
    finished = control.reports_for(call_id, "finished")
    assert len(finished) == 1, "a call has exactly one result"
    assert len(control.reports_for(call_id, "started")) == 1
    assert runner.log().count("succeeded in") == 4
    assert runner.log().count(": 'ran'") == 1


@pytest.mark.spec("RUN-1", "RUN-2", "RUN-7", "RUN-9")
def test_worker_killed_mid_call_loses_nothing_and_runs_nothing_twice(runner_setup, workspace_root):
    """SIGKILL the whole worker mid-call ten times, then let one worker recover everything.

    Each round starts a worker, sends a non-idempotent shell call (which appends a line to
    its own effect file, then sleeps) and an idempotent fs.write, waits until the shell
    call has had its effect, and kills the worker. The broker hands the unacknowledged
    messages out again after the visibility timeout; the recovering worker must end every
    shell call ``runner_lost`` (and remove its orphaned container) and complete every
    write, each call with exactly one finished result.
    """
    runner, control = runner_setup
    shells: list[str] = []
    writes: dict[str, int] = {}  # call id -> round
    rounds = 10
    for round_number in range(rounds):
        runner.start(concurrency=2)
        shell_id = f"act_{uuid.uuid4().hex}"
        shell = control.command(
            "shell.exec",
            {"script": f"echo once >> {shell_id}.log; sleep 300; echo late >> {shell_id}.log"},
            call_id=shell_id,
        )
        write = control.command(
            "fs.write", {"path": f"written/{round_number}.txt", "content": f"round {round_number}"}
        )
        control.send(shell)
        control.send(write)
        effect = workspace_root / PROJECT / f"{shell_id}.log"
        control.wait(
            lambda shell_id=shell_id, effect=effect: (
                bool(control.reports_for(shell_id, "started")) and effect.exists()
            ),
            timeout=60,
            what=f"round {round_number}: the shell call to start and have its effect",
        )
        runner.kill()
        shells.append(shell_id)
        writes[_call_id(write)] = round_number

    runner.start(concurrency=2)
    every_call = [*shells, *writes]
    control.wait(
        lambda: all(control.reports_for(call_id, "finished") for call_id in every_call),
        # Redelivery needs the visibility timeout (MAX_CALL_SECONDS + 60) plus one sweep.
        timeout=MAX_CALL_SECONDS + 60 + 120,
        what="every interrupted call to reach a final state",
    )

    for call_id in shells:
        (finished,) = {r.raw: r for r in control.reports_for(call_id, "finished")}.values()
        assert finished.outcome == "failed"
        assert finished.error["code"] == "runner_lost"
        assert (workspace_root / PROJECT / f"{call_id}.log").read_text() == "once\n"
    for call_id, round_number in writes.items():
        (finished,) = {r.raw: r for r in control.reports_for(call_id, "finished")}.values()
        assert finished.outcome == "succeeded", finished.error
        assert finished.result["path"] == f"written/{round_number}.txt"
    for round_number in range(rounds):
        written = workspace_root / PROJECT / "written" / f"{round_number}.txt"
        assert written.read_text() == f"round {round_number}"
    lost = [
        json.loads(line.split("] ", 1)[1])
        for line in runner.log().splitlines()
        if '"event": "call_lost"' in line
    ]
    assert sorted(entry["call_id"] for entry in lost) == sorted(shells)
    # The shell calls ran in the thread's warm container. Its agent killed each call when
    # the killed worker's connection dropped, and the next worker's start removed the idle
    # container, so recovery found nothing left to reap.
    assert all(entry["reaped_containers"] == 0 for entry in lost)
    client = docker.from_env()
    try:
        for call_id in shells:
            leftovers = client.containers.list(
                all=True, filters={"label": f"{LABEL_PREFIX}call={call_id}"}
            )
            assert leftovers == [], f"container of lost call {call_id} still exists"
            assert containers_running_call(client, call_id) == []
    finally:
        client.close()


def _call_id(token: str) -> str:
    call_id = unverified_call_id(token)
    assert call_id is not None
    return call_id
