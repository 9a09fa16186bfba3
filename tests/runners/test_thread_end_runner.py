"""A runner told that a thread ended, against the real engine and Redis.

Two ``WarmBackendChooser`` objects stand for two worker processes of one runner host: each
keeps its own warm pool, and only one of them receives the control message. The last test
starts real ``python -m runners worker`` processes (two runner hosts of one pool) and
publishes the message on the pool's fanout exchange, as the control plane does.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest
import redis
from celery import Celery
from kombu import Exchange

from runners.callstate import CallState
from runners.config import RunnerConfig
from runners.contract.names import control_exchange
from runners.contract.tokens import (
    generate_private_key_pem,
    public_key_pem,
    sign_command,
    sign_control_message,
)
from runners.dispatch import execute
from runners.runner import Disposition, Runner
from runners.sandbox import ExecLimits
from runners.sandbox.docker import LABEL_PREFIX
from runners.sandbox.warm_host import WARM_LABEL, warm_container_busy
from runners.warm_chooser import WarmBackendChooser
from runners.workspace import workspace_for
from tests.runners.support import RUNNER_REDIS_URL, runner_config, worker_environment
from tests.runners.test_protocol import command_claims
from tests.support import stop

pytestmark = [pytest.mark.docker, pytest.mark.spec("RUN-1", "RUN-2")]

# Not the DB the other runner tests use (14): these tests flush theirs.
POOL = "endpool"
LIMITS = ExecLimits(timeout_s=30, memory_mb=96, cpus=0.5, pids=40, output_kb=64, tmp_mb=8)
CONTROL_KEY = generate_private_key_pem()
CONTROL_PUBLIC = public_key_pem(CONTROL_KEY)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def state_client(runner_redis: redis.Redis) -> redis.Redis:
    return runner_redis


@pytest.fixture
def workspace(workspace_root, project):
    return workspace_for(workspace_root, project)


@pytest.fixture
def config(tmp_path, workspace_root, runner_id) -> RunnerConfig:
    return runner_config(
        tmp_path,
        runner_id=runner_id,
        pool=POOL,
        runner_key=generate_private_key_pem(),
        control_public_key=CONTROL_PUBLIC,
        workspace_root=workspace_root,
    )


def process(state_client: redis.Redis, name: str) -> WarmBackendChooser:
    """One worker process's warm pool, told about ended threads through shared state."""
    state = CallState(state_client, worker=name)
    return WarmBackendChooser(
        idle_seconds=300, max_containers=8, enabled=True, thread_ended=state.thread_ended
    )


@pytest.fixture
def processes(state_client, engine) -> Iterator[tuple[WarmBackendChooser, WarmBackendChooser]]:
    first, second = process(state_client, "first"), process(state_client, "second")
    yield first, second
    first.close()
    second.close()


@pytest.fixture
def runner(config, state_client, processes) -> Runner:
    """The runner in the first process; the message reaches only this one."""
    first, _ = processes
    return Runner(
        config=config,
        private_key=config.private_key(),
        control_public_key=config.control_public_key(),
        state=CallState(state_client, worker="first"),
        report=lambda token: None,
        choose_backend=first,
        end_thread=lambda prj, thr: first.end_thread(prj, thr, runner_id=config.runner_id),
    )


def shell(chooser, workspace, project, thread, runner_id, script) -> dict:
    return execute(
        "shell.exec",
        {"script": script},
        workspace=workspace,
        backend=chooser("docker"),
        limits=LIMITS,
        labels={
            "call": f"act_{uuid.uuid4().hex}",
            "project": project,
            "thread": thread,
            "runner": runner_id,
        },
    )


def warm_of(engine, project, thread) -> set[str]:
    # Sparse: the ids only, so a container removed while it is listed is not an error.
    found = engine.containers.list(
        all=True,
        sparse=True,
        filters={
            "label": [
                f"{WARM_LABEL}=true",
                f"{LABEL_PREFIX}project={project}",
                f"{LABEL_PREFIX}thread={thread}",
            ]
        },
    )
    return {container.id for container in found}


def thread_end(project: str, thread: str, *, key: bytes = CONTROL_KEY, **overrides) -> str:
    now = overrides.pop("now", None)
    claims = {
        "aud": f"runner.{POOL}",
        "type": "thread.end",
        "org": "org_01JORG",
        "env": "env_01JENV",
        "prj": project,
        "thr": thread,
        "rsk": None,
        **overrides,
    }
    return sign_control_message(claims, key, now=now)


def test_refused_control_messages_remove_nothing(
    runner, processes, engine, workspace, project, runner_id, state_client, caplog
):
    first, second = processes
    shell(first, workspace, project, "thr_a", runner_id, "true")
    shell(second, workspace, project, "thr_b", runner_id, "true")
    before = warm_of(engine, project, "thr_a")
    assert len(before) == 1

    header, payload, signature = thread_end(project, "thr_a").split(".")
    command = sign_command(
        command_claims(aud=f"runner.{POOL}", prj=project, thr="thr_a"), CONTROL_KEY
    )
    refused = {
        "forged": thread_end(project, "thr_a", key=generate_private_key_pem()),
        "unsigned": f"{header}.{payload}.",
        "tampered": f"{header}.{payload}.{signature[:-4]}AAAA",
        "expired": thread_end(project, "thr_a", now=int(time.time()) - 900),
        "wrong audience": thread_end(project, "thr_a", aud="runner.elsewhere"),
        "unknown type": thread_end(project, "thr_a", type="runner.drain"),
        "a command": command,
    }
    for name, token in refused.items():
        assert runner.handle_control(token) == Disposition.REFUSED, name

    assert warm_of(engine, project, "thr_a") == before
    assert not CallState(state_client, worker="x").thread_ended(project, "thr_a")
    assert caplog.text.count('"event": "control_refused"') == len(refused)
    for code in ("bad_signature", "expired", "wrong_audience", "unknown_type", "malformed"):
        assert f'"code": "{code}"' in caplog.text
    assert '"event": "thread_ended"' not in caplog.text


def test_thread_end_removes_the_threads_idle_containers_of_every_process_only(
    runner, processes, engine, workspace, project, runner_id, caplog
):
    first, second = processes
    # The second process starts the thread's container; the first, which gets the notice,
    # only ever used it.
    shell(second, workspace, project, "thr_a", runner_id, "true")
    shell(first, workspace, project, "thr_a", runner_id, "true")
    shell(second, workspace, project, "thr_b", runner_id, "true")
    other_thread = warm_of(engine, project, "thr_b")
    assert len(warm_of(engine, project, "thr_a")) == 1 and len(other_thread) == 1

    assert runner.handle_control(thread_end(project, "thr_a")) == Disposition.APPLIED

    assert warm_of(engine, project, "thr_a") == set()
    assert warm_of(engine, project, "thr_b") == other_thread
    assert (project, "thr_a") not in first.backend.warm_containers()
    assert '"event": "thread_ended"' in caplog.text and '"removed_containers": 1' in caplog.text

    # A call of the thread that was already queued still runs, in a fresh container (the
    # second process's pool entry points at a removed container and is not used).
    late = shell(second, workspace, project, "thr_a", runner_id, "echo late")
    assert (late["exit_code"], late["stdout"]) == (0, "late\n")
    assert warm_of(engine, project, "thr_a") == set()
    assert (project, "thr_a") not in second.backend.warm_containers()
    # The other thread's container is still warm and in use.
    shell(second, workspace, project, "thr_b", runner_id, "true")
    assert warm_of(engine, project, "thr_b") == other_thread


# The busy call sleeps; ``release`` ends the sleep with a signal from outside (the project's
# workspace, where a file could say so, may be gone by then), and the script goes on.
BUSY_SCRIPT = "sleep 25; echo finished"
END_THE_SLEEP = (
    "import os, signal\n"
    "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
    "    with open(f'/proc/{pid}/comm') as comm:\n"
    "        if comm.read().strip() == 'sleep':\n"
    "            os.kill(int(pid), signal.SIGTERM)\n"
)


def release(engine, container_id: str) -> None:
    """End the busy call in ``container_id`` now (a no-op once the container is gone)."""
    try:
        engine.containers.get(container_id).exec_run(["python3", "-c", END_THE_SLEEP])
    except docker.errors.NotFound:
        pass


@pytest.fixture
def busy_call(processes, engine, workspace, project, runner_id):
    """``busy_call(chooser, thread)`` warms ``thread``'s container in ``chooser``, then keeps
    it busy, in a thread of this test, with a call that runs until ``release``: (that thread,
    the call's outcome once joined, the container). The test, not a clock, says when the
    call ends; a test that fails first still ends it here."""
    started: list[tuple[threading.Thread, str]] = []

    def start(chooser, thread):
        shell(chooser, workspace, project, thread, runner_id, "true")
        (container_id,) = warm_of(engine, project, thread)
        outcome: dict = {}
        call = threading.Thread(
            target=lambda: outcome.update(
                shell(chooser, workspace, project, thread, runner_id, BUSY_SCRIPT)
            )
        )
        call.start()
        started.append((call, container_id))
        deadline = time.monotonic() + 20
        container = engine.containers.get(container_id)
        while not warm_container_busy(container):
            assert time.monotonic() < deadline, "the call never started"
            time.sleep(0.05)
        return call, outcome, container_id

    yield start
    for call, container_id in started:
        release(engine, container_id)
        call.join(60)


def test_a_busy_container_finishes_its_call_and_goes_at_check_in(
    runner, processes, busy_call, engine, workspace, project
):
    _, second = processes
    call, outcome, container_id = busy_call(second, "thr_a")

    runner.handle_control(thread_end(project, "thr_a"))
    assert warm_of(engine, project, "thr_a") == {container_id}  # never killed mid-call

    release(engine, container_id)
    call.join(30)
    assert (outcome["exit_code"], outcome["stdout"]) == (0, "finished\n")
    assert warm_of(engine, project, "thr_a") == set()


def project_delete(project: str) -> str:
    return thread_end(project, None, type="project.delete")


def test_a_deleted_projects_busy_container_in_another_process_goes_at_check_in(
    runner, processes, busy_call, engine, workspace, project, runner_id, state_client
):
    """The notice reaches one process; a container of the project busy in another finishes
    its call, then goes (the shared mark), and an idle one of another thread goes at once."""
    first, second = processes
    runner.end_project = lambda prj: first.end_project(prj, runner_id=runner_id)
    shell(second, workspace, project, "thr_b", runner_id, "true")  # warm and idle
    call, outcome, busy_id = busy_call(second, "thr_a")

    runner.handle_control(project_delete(project))
    assert warm_of(engine, project, "thr_b") == set()
    assert warm_of(engine, project, "thr_a") == {busy_id}  # never killed mid-call
    assert CallState(state_client, worker="x").thread_ended(project, "thr_new")

    release(engine, busy_id)
    call.join(30)
    assert (outcome["exit_code"], outcome["stdout"]) == (0, "finished\n")
    assert warm_of(engine, project, "thr_a") == set()


# --- real worker processes ------------------------------------------------------------


def start_worker(tmp_path: Path, workspace_root: Path, name: str) -> tuple[subprocess.Popen, Path]:
    folder = tmp_path / name
    folder.mkdir()
    config = runner_config(
        folder,
        runner_id=f"run_end{name}{uuid.uuid4().hex[:8]}",
        pool=POOL,
        runner_key=generate_private_key_pem(),
        control_public_key=CONTROL_PUBLIC,
        workspace_root=workspace_root,
    )
    log = tmp_path / f"{name}.log"
    worker = subprocess.Popen(
        [sys.executable, "-m", "runners", "worker", "--concurrency", "1"],
        cwd=REPO,
        env=worker_environment(config),
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    return worker, log


def wait_for(condition, *, timeout: float, what: str, logs: list[Path]) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            tails = "\n".join(log.read_text(errors="replace")[-2000:] for log in logs)
            pytest.fail(f"gave up waiting for {what} after {timeout} s\n{tails}")
        time.sleep(0.1)


def test_every_runner_host_of_the_pool_removes_the_thread_on_one_broadcast(
    tmp_path, workspace_root, docker_backend, state_client, engine, project
):
    workers = [start_worker(tmp_path, workspace_root, name) for name in ("hosta", "hostb")]
    logs = [log for _, log in workers]
    app = Celery("fake-control", broker=RUNNER_REDIS_URL, set_as_current=False)
    app.conf.update(task_serializer="json", accept_content=["json"])
    exchange = Exchange(control_exchange(POOL), type="fanout")

    def publish(token: str) -> None:
        app.send_task(
            "runner.control",
            args=[token],
            exchange=exchange,
            routing_key=control_exchange(POOL),
            declare=[exchange],
        )

    try:
        wait_for(
            lambda: all(b" ready." in log.read_bytes() for log in logs),
            timeout=60,
            what="both workers to be ready",
            logs=logs,
        )
        # Two calls of one thread at once: each worker (one slot, prefetch 1) takes one, so
        # each host keeps a warm container of the thread. A third thread's call for contrast.
        for script in ("sleep 2", "sleep 2", "true"):
            thread = "thr_other" if script == "true" else "thr_a"
            app.send_task(
                "runner.execute",
                args=[
                    sign_command(
                        {
                            "iss": "kestrel-control",
                            "aud": f"runner.{POOL}",
                            "jti": f"act_{uuid.uuid4().hex}",
                            "org": "org_01JORG",
                            "env": "env_01JENV",
                            "prj": project,
                            "thr": thread,
                            "tool": "shell.exec",
                            "args": {"script": script},
                            "policy_version": "pol_1",
                            "limits": {
                                "timeout_s": 15,
                                "memory_mb": 128,
                                "cpus": 1,
                                "pids": 64,
                                "output_kb": 64,
                            },
                            "attempt": 1,
                        },
                        CONTROL_KEY,
                    )
                ],
                queue=f"runner.{POOL}",
            )
        wait_for(
            lambda: sum(log.read_text().count('"event": "call_finished"') for log in logs) == 3,
            timeout=90,
            what="the three calls to finish",
            logs=logs,
        )
        assert all('"event": "call_finished"' in log.read_text() for log in logs)
        hosts = {
            engine.api.inspect_container(cid)["Config"]["Labels"][f"{LABEL_PREFIX}runner"]
            for cid in warm_of(engine, project, "thr_a")
        }
        assert len(hosts) == 2, "each host keeps a warm container of the thread"
        other = warm_of(engine, project, "thr_other")
        assert len(other) == 1

        publish(thread_end(project, "thr_a", key=generate_private_key_pem()))  # forged
        wait_for(
            lambda: all('"event": "control_refused"' in log.read_text() for log in logs),
            timeout=30,
            what="both hosts to refuse the forged message",
            logs=logs,
        )
        assert len(warm_of(engine, project, "thr_a")) == 2

        publish(thread_end(project, "thr_a"))
        wait_for(
            lambda: not warm_of(engine, project, "thr_a"),
            timeout=30,
            what="both hosts to remove the thread's containers",
            logs=logs,
        )
        wait_for(
            lambda: all('"event": "thread_ended"' in log.read_text() for log in logs),
            timeout=30,
            what="both hosts to log the end",
            logs=logs,
        )
        assert warm_of(engine, project, "thr_other") == other
    finally:
        for worker, _ in workers:
            stop(worker)
        client = docker.from_env()
        for container in client.containers.list(
            all=True, filters={"label": f"{LABEL_PREFIX}project={project}"}
        ):
            container.remove(force=True)
        client.close()
