"""Warm sandboxes against the real engine: one container per thread, reused by exec, with
the hardening, the per-call TMPDIR, the tree kill, the probe and the bounds of a fresh one."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import stat
import struct
import subprocess
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from runners.contract.errors import RunnerError
from runners.dispatch import execute
from runners.sandbox import (
    ExecLimits,
    ExecSpec,
    SandboxStartFailed,
    SandboxUnavailable,
    WarmDockerBackend,
    run_confined,
    warm_host,
)
from runners.sandbox.warm import AGENT_MOUNT
from runners.sandbox.warm_host import (
    AGENT_DIR_LABEL,
    WARM_LABEL,
    containers_running_call,
    remove_idle_project_containers,
    remove_idle_warm_containers,
)
from runners.workspace import SANDBOX_UID, workspace_for

pytestmark = [pytest.mark.docker, pytest.mark.spec("RUN-3", "RUN-4", "RUN-5")]

LIMITS = ExecLimits(timeout_s=30, memory_mb=96, cpus=0.5, pids=40, output_kb=64, tmp_mb=8)


class Clock:
    """A clock the test moves by hand, so idle expiry needs no waiting."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def warm(docker_backend, engine, clock):
    backend = WarmDockerBackend(docker_backend, idle_seconds=60, max_containers=8, clock=clock)
    yield backend
    backend.close()


@pytest.fixture
def workspace(workspace_root, project):
    return workspace_for(workspace_root, project)


def labels(project: str, thread: str | None, runner_id: str) -> dict[str, str]:
    found = {"call": f"act_{uuid.uuid4().hex}", "project": project, "runner": runner_id}
    if thread is not None:
        found["thread"] = thread
    return found


def shell(backend, workspace, project, thread, runner_id, script, limits=LIMITS) -> dict:
    return execute(
        "shell.exec",
        {"script": script},
        workspace=workspace,
        backend=backend,
        limits=limits,
        labels=labels(project, thread, runner_id),
    )


def warm_ids(engine, project) -> set[str]:
    found = engine.containers.list(
        all=True, filters={"label": [f"io.kestrel.project={project}", f"{WARM_LABEL}=true"]}
    )
    return {container.id for container in found}


def test_a_thread_reuses_its_container_and_another_thread_gets_its_own(
    warm, engine, workspace, project, runner_id
):
    first = shell(warm, workspace, project, "thr_a", runner_id, "echo one")
    container_a = warm.warm_containers()[(project, "thr_a")]
    second = shell(warm, workspace, project, "thr_a", runner_id, "echo two")
    assert (first["stdout"], second["stdout"]) == ("one\n", "two\n")
    assert warm.warm_containers()[(project, "thr_a")] == container_a

    shell(warm, workspace, project, "thr_b", runner_id, "echo other")
    container_b = warm.warm_containers()[(project, "thr_b")]
    assert container_b != container_a
    assert warm_ids(engine, project) == {container_a, container_b}
    labels_b = engine.api.inspect_container(container_b)["Config"]["Labels"]
    assert labels_b["io.kestrel.thread"] == "thr_b"


def test_a_call_without_a_thread_runs_in_a_fresh_container(
    warm, engine, workspace, project, runner_id
):
    result = shell(warm, workspace, project, None, runner_id, "echo fresh")
    assert result["stdout"] == "fresh\n"
    assert warm.warm_containers() == {}
    assert warm_ids(engine, project) == set()


def test_docker_inspect_shows_the_same_hardening_as_a_fresh_container(
    warm, docker_backend, engine, workspace, project, runner_id
):
    shell(warm, workspace, project, "thr_a", runner_id, "true")
    attrs = engine.api.inspect_container(warm.warm_containers()[(project, "thr_a")])
    host, config = attrs["HostConfig"], attrs["Config"]
    assert host["NetworkMode"] == "none"
    assert host["ReadonlyRootfs"] is True
    assert host["CapDrop"] == ["ALL"]
    assert not host["CapAdd"]
    assert "no-new-privileges" in host["SecurityOpt"]
    assert host["Privileged"] is False
    assert host["PidsLimit"] == LIMITS.pids
    assert host["Memory"] == LIMITS.memory_mb * 1024 * 1024
    assert host["MemorySwap"] == LIMITS.memory_mb * 1024 * 1024
    assert host["NanoCpus"] == int(LIMITS.cpus * 1e9)
    assert host["PidMode"] == "" and host["UTSMode"] == "" and host["UsernsMode"] == ""
    assert host["IpcMode"] == "private"
    assert not host["Devices"]
    assert "noexec" in host["Tmpfs"]["/tmp"] and "size=8m" in host["Tmpfs"]["/tmp"]
    assert config["User"] == f"{SANDBOX_UID}:{SANDBOX_UID}"
    assert config["Image"] == docker_backend.image_id
    assert config["Labels"][WARM_LABEL] == "true"
    mounts = {m["Destination"]: m for m in attrs["Mounts"]}
    assert {(d, m["Type"], m["RW"]) for d, m in mounts.items()} == {
        ("/workspace", "bind", True),
        (AGENT_MOUNT, "bind", True),
        ("/run/kestrel-adapter", "bind", False),
    }
    assert mounts["/workspace"]["Source"] == str(workspace)
    # The additions: the agent's socket directory, which the runner (root here) took back
    # once the socket was up, so commands cannot enter it; and, read-only, where each call's
    # adapter broker socket is linked for the call (runners.adapter_broker).
    agent_dir = Path(config["Labels"][AGENT_DIR_LABEL])
    assert mounts[AGENT_MOUNT]["Source"] == str(agent_dir / "socket")
    assert mounts["/run/kestrel-adapter"]["Source"] == str(agent_dir / "adapter")
    socket_dir = (agent_dir / "socket").stat()
    assert (socket_dir.st_uid, stat.S_IMODE(socket_dir.st_mode)) == (0, 0o700)
    # PID 1's environment holds the agent's key and nothing of any call (the image's own
    # HOME and PATH are merged in by the engine).
    names = {name.split("=")[0] for name in config["Env"]}
    assert "KESTREL_AGENT_KEY" in names
    assert names <= {"KESTREL_AGENT_KEY", "LANG", "PATH", "HOME"}


def test_confinement_holds_inside_an_exec(warm, workspace, project, runner_id):
    script = (
        "id -u; grep CapEff /proc/self/status; grep NoNewPrivs /proc/self/status; "
        "ls /sys/class/net; touch /etc/x 2>/dev/null || echo ro-root; "
        "touch /tmp/x.sh && chmod +x /tmp/x.sh && (/tmp/x.sh 2>/dev/null || echo noexec-tmp)"
    )
    for _ in range(2):  # the first call starts the container, the second only execs
        out = shell(warm, workspace, project, "thr_a", runner_id, script)["stdout"].split("\n")
        assert out[0] == str(SANDBOX_UID)
        assert out[1].split() == ["CapEff:", "0000000000000000"]
        assert out[2].split() == ["NoNewPrivs:", "1"]
        assert out[3] == "lo"
        assert "ro-root" in out and "noexec-tmp" in out


def test_tmpdir_is_fresh_and_empty_for_every_call_and_removed_after(
    warm, workspace, project, runner_id
):
    script = 'echo "$TMPDIR"; ls -A "$TMPDIR" | wc -l; touch "$TMPDIR/left" /tmp/stray; ls -A /tmp'
    first = shell(warm, workspace, project, "thr_a", runner_id, script)["stdout"].split("\n")
    second = shell(warm, workspace, project, "thr_a", runner_id, script)["stdout"].split("\n")
    assert first[0] != second[0]
    assert first[0].startswith("/tmp/kestrel-") and second[0].startswith("/tmp/kestrel-")
    assert first[1] == second[1] == "0"
    # Only this call's directory and its own stray file: the previous call's are gone.
    assert sorted(second[2:-1]) == sorted([second[0].removeprefix("/tmp/"), "stray"])


@pytest.mark.spec("RUN-8", "RUN-4")
def test_background_children_do_not_outlive_their_call(warm, workspace, project, runner_id):
    shell(
        warm,
        workspace,
        project,
        "thr_a",
        runner_id,
        "(sleep 1; echo late > late.txt) & sleep 2107 & echo done",
    )
    ps = "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done"
    listed = shell(warm, workspace, project, "thr_a", runner_id, ps)["stdout"]
    assert "sleep 2107" not in listed
    time.sleep(2)  # long enough for the killed subshell to have written, had it lived
    assert not (workspace / "late.txt").exists()


def test_a_timeout_kills_the_tree_and_drops_the_container(
    warm, engine, workspace, project, runner_id
):
    shell(warm, workspace, project, "thr_a", runner_id, "true")
    container = warm.warm_containers()[(project, "thr_a")]
    limits = ExecLimits(timeout_s=2, memory_mb=96, cpus=0.5, pids=40, output_kb=64, tmp_mb=8)
    result = shell(
        warm,
        workspace,
        project,
        "thr_a",
        runner_id,
        "(sleep 3; echo late > late.txt) & sleep 3108 & echo started; sleep 3109",
        limits=limits,
    )
    assert result["timed_out"] is True
    assert result["exit_code"] == 137
    assert result["stdout"] == "started\n"
    assert (project, "thr_a") not in warm.warm_containers()
    assert warm_ids(engine, project) == set()
    assert container not in {c.id for c in engine.containers.list(all=True)}
    time.sleep(2)
    assert not (workspace / "late.txt").exists()
    # The thread's next call gets a new container.
    shell(warm, workspace, project, "thr_a", runner_id, "true")
    assert warm.warm_containers()[(project, "thr_a")] != container


def test_different_limits_get_a_new_container(warm, engine, workspace, project, runner_id):
    shell(warm, workspace, project, "thr_a", runner_id, "true")
    before = warm.warm_containers()[(project, "thr_a")]
    bigger = ExecLimits(timeout_s=30, memory_mb=160, cpus=0.5, pids=40, output_kb=64, tmp_mb=8)
    shell(warm, workspace, project, "thr_a", runner_id, "true", limits=bigger)
    after = warm.warm_containers()[(project, "thr_a")]
    assert after != before
    assert warm_ids(engine, project) == {after}
    assert engine.api.inspect_container(after)["HostConfig"]["Memory"] == 160 * 1024 * 1024
    # A shorter timeout alone is per exec and keeps the container.
    shorter = ExecLimits(timeout_s=5, memory_mb=160, cpus=0.5, pids=40, output_kb=8, tmp_mb=8)
    shell(warm, workspace, project, "thr_a", runner_id, "true", limits=shorter)
    assert warm.warm_containers()[(project, "thr_a")] == after


def test_idle_containers_are_removed_after_the_idle_time(
    warm, engine, clock, workspace, project, runner_id
):
    shell(warm, workspace, project, "thr_a", runner_id, "true")
    clock.now += 30
    shell(warm, workspace, project, "thr_b", runner_id, "true")
    clock.now += 31  # thr_a idle for 61 s, thr_b for 31 s
    assert warm.remove_idle() == 1
    assert set(warm.warm_containers()) == {(project, "thr_b")}
    assert warm_ids(engine, project) == {warm.warm_containers()[(project, "thr_b")]}


def test_the_cap_evicts_the_least_recently_used_idle_container(
    docker_backend, engine, clock, workspace, project, runner_id
):
    backend = WarmDockerBackend(docker_backend, idle_seconds=600, max_containers=2, clock=clock)
    try:
        for thread in ("thr_a", "thr_b", "thr_c"):
            shell(backend, workspace, project, thread, runner_id, "true")
            clock.now += 1
        assert set(backend.warm_containers()) == {(project, "thr_b"), (project, "thr_c")}
        assert len(warm_ids(engine, project)) == 2
    finally:
        backend.close()


def test_past_the_cap_with_nothing_to_evict_a_call_runs_fresh(
    docker_backend, engine, workspace, project, runner_id
):
    """Another worker process of the runner holds the only slot, busy: this one runs cold."""
    other_process = WarmDockerBackend(docker_backend, max_containers=1)
    this_process = WarmDockerBackend(docker_backend, max_containers=1)
    try:
        shell(other_process, workspace, project, "thr_a", runner_id, "true")
        busy_dir = sandbox_of(other_process, project, "thr_a").agent_dir
        with open(busy_dir / "lock") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # mid-call
            result = shell(this_process, workspace, project, "thr_b", runner_id, "echo cold")
        assert result["stdout"] == "cold\n"
        assert this_process.warm_containers() == {}
        assert len(warm_ids(engine, project)) == 1
    finally:
        other_process.close()
        this_process.close()


def test_past_the_cap_another_processs_idle_container_makes_room(
    docker_backend, engine, workspace, project, runner_id
):
    """A thread that moved on to another process must not keep a live one cold. The process
    whose idle container went finds out at its next call, which gets a new container."""
    other_process = WarmDockerBackend(docker_backend, max_containers=1)
    this_process = WarmDockerBackend(docker_backend, max_containers=1)
    try:
        shell(other_process, workspace, project, "thr_a", runner_id, "true")
        old = other_process.warm_containers()[(project, "thr_a")]
        shell(this_process, workspace, project, "thr_b", runner_id, "true")
        assert set(this_process.warm_containers()) == {(project, "thr_b")}
        assert old not in warm_ids(engine, project)
        # The other process still lists it; its next call of the thread runs warm anyway.
        assert other_process.warm_containers()[(project, "thr_a")] == old
        again = shell(other_process, workspace, project, "thr_a", runner_id, "echo again")
        assert again["stdout"] == "again\n"
        assert other_process.warm_containers()[(project, "thr_a")] != old
    finally:
        other_process.close()
        this_process.close()


def test_ending_a_thread_removes_its_container(warm, engine, workspace, project, runner_id):
    shell(warm, workspace, project, "thr_a", runner_id, "true")
    assert warm.end_thread(project, "thr_a") is True
    assert warm_ids(engine, project) == set()
    assert warm.end_thread(project, "thr_a") is False


def test_a_deleted_projects_containers_go_in_every_process_of_the_runner(
    docker_backend, engine, workspace, project, runner_id
):
    """Every thread's container of the project, whichever process keeps it, and nothing of
    another project (``WarmBackendChooser.end_project``: the engine pass, then the pool)."""
    other_process = WarmDockerBackend(docker_backend)
    this_process = WarmDockerBackend(docker_backend)
    other = f"prj_t{uuid.uuid4().hex[:12]}"
    other_workspace = workspace_for(workspace.parent, other)
    try:
        shell(other_process, workspace, project, "thr_a", runner_id, "true")
        shell(this_process, workspace, project, "thr_b", runner_id, "true")
        shell(this_process, other_workspace, other, "thr_a", runner_id, "true")
        assert len(warm_ids(engine, project)) == 2
        assert remove_idle_project_containers(engine, project=project, runner_id=runner_id) == 2
        assert this_process.end_project(project) == 1
        assert warm_ids(engine, project) == set()
        assert set(this_process.warm_containers()) == {(other, "thr_a")}
        assert len(warm_ids(engine, other)) == 1
    finally:
        other_process.close()
        this_process.close()


def test_a_failed_probe_removes_the_container_and_fails_closed(
    warm, engine, workspace, project, runner_id
):
    workspace.chmod(0o555)  # not even its owner, the sandbox user, may write in it
    try:
        with pytest.raises(SandboxUnavailable, match="workspace NOT writable"):
            shell(warm, workspace, project, "thr_a", runner_id, "echo never > /tmp/never")
    finally:
        workspace.chmod(0o755)
    assert warm.warm_containers() == {}
    assert warm_ids(engine, project) == set()


def test_a_container_whose_workspace_was_replaced_is_refused_before_its_next_command(
    warm, engine, workspace, workspace_root, project, runner_id
):
    """RUN-5 before each command, not only at start: the probe's token must land in the
    workspace as the runner sees it now. Replaced on the host (a restore that swaps in a
    staged copy, a project's workspace removed and made again), the workspace a running
    container has mounted is no longer the project's."""
    shell(warm, workspace, project, "thr_a", runner_id, "true")
    stale = warm.warm_containers()[(project, "thr_a")]
    replaced = workspace.rename(workspace_root / "replaced")
    assert workspace_for(workspace_root, project) == workspace

    result = shell(warm, workspace, project, "thr_a", runner_id, "echo ran > ran.txt; hostname")
    assert not (replaced / "ran.txt").exists()  # never in the container that saw the old one
    assert (workspace / "ran.txt").read_text() == "ran\n"
    assert stale not in warm_ids(engine, project)
    assert warm.warm_containers()[(project, "thr_a")] != stale
    assert result["stdout"].strip() != stale[:12]  # a container's hostname is its short id


def test_a_container_whose_root_was_made_writable_is_refused_before_its_next_command(
    warm, engine, workspace, project, runner_id
):
    """RUN-5 "cannot write beside it": the read-only root is what keeps a command from
    writing beside its workspace. Remounted writable from the host after the container
    started (mounts can change under a running container), it is refused before the next
    command, which runs in a new container whose root is read-only again."""
    shell(warm, workspace, project, "thr_a", runner_id, "true")
    sandbox = sandbox_of(warm, project, "thr_a")
    remount = ["mount", "-o", "remount,rw", "/"]
    subprocess.run(
        ["nsenter", "--target", str(sandbox.agent_pid), "--mount", *remount],
        check=True,
        capture_output=True,
    )
    script = "awk '$5 == \"/\" {print $6}' /proc/self/mountinfo; echo ran >> ran.txt"
    result = shell(warm, workspace, project, "thr_a", runner_id, script)
    assert result["stdout"].startswith("ro,")  # the root it ran under is read-only
    assert (workspace / "ran.txt").read_text() == "ran\n"  # once, in the new container
    assert sandbox.container_id not in warm_ids(engine, project)
    assert warm.warm_containers()[(project, "thr_a")] != sandbox.container_id


def test_a_container_that_fails_its_probe_again_fails_the_call_closed(
    warm, engine, workspace, project, runner_id
):
    shell(warm, workspace, project, "thr_a", runner_id, "true")
    workspace.chmod(0o555)  # for the old container and for any new one
    try:
        with pytest.raises(SandboxUnavailable, match="failed its probe"):
            shell(warm, workspace, project, "thr_a", runner_id, "echo never > /tmp/never")
    finally:
        workspace.chmod(0o755)
    assert warm.warm_containers() == {}
    assert warm_ids(engine, project) == set()


@pytest.mark.spec("RUN-3")
def test_sysv_ipc_objects_do_not_survive_into_the_threads_next_call(
    warm, workspace, project, runner_id
):
    """A call's SysV shared memory, message queues and semaphores, and its POSIX message
    queues, are removed with it: the thread's next call in the same container sees none."""
    code = (
        "import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
        "print(libc.shmget(0, 4096, 0o1600) >= 0, libc.msgget(0, 0o1600) >= 0, "
        "libc.semget(0, 2, 0o1600) >= 0, "
        "libc.mq_open(b'/left', os.O_CREAT | os.O_RDWR, 0o600, None) >= 0)"
    )
    listing = "cat /proc/sysvipc/* | grep -vc key; ls /dev/mqueue"
    made = shell(warm, workspace, project, "thr_a", runner_id, f'python3 -c "{code}"; {listing}')
    assert made["stdout"] == "True True True True\n3\nleft\n"
    container = warm.warm_containers()[(project, "thr_a")]
    after = shell(warm, workspace, project, "thr_a", runner_id, listing)
    assert after["stdout"] == "0\n"
    assert warm.warm_containers()[(project, "thr_a")] == container


@pytest.mark.spec("RUN-3")
def test_a_container_left_with_ipc_objects_it_cannot_remove_is_dropped(
    warm, engine, workspace, project, runner_id
):
    """What the agent cannot remove (here a segment the host's root made in the container's
    IPC namespace) does not stay for the thread's next call: that call runs in a new
    container, and the old one goes."""
    shell(warm, workspace, project, "thr_a", runner_id, "true")
    sandbox = sandbox_of(warm, project, "thr_a")
    made = "import ctypes; print(ctypes.CDLL(None).shmget(0, 4096, 0o1600))"
    subprocess.run(
        ["nsenter", "--target", str(sandbox.agent_pid), "--ipc", "python3", "-c", made],
        check=True,
        capture_output=True,
    )
    assert shell(warm, workspace, project, "thr_a", runner_id, "echo ok")["stdout"] == "ok\n"
    # The segment outlived that call: the container runs no further command.
    assert (
        shell(warm, workspace, project, "thr_a", runner_id, "hostname")["stdout"].strip()
        != (sandbox.container_id[:12])
    )
    assert sandbox.container_id not in warm_ids(engine, project)
    assert warm.warm_containers()[(project, "thr_a")] != sandbox.container_id


def test_a_dead_warm_container_is_discarded_never_bypassed(
    warm, engine, workspace, project, runner_id
):
    shell(warm, workspace, project, "thr_a", runner_id, "true")
    container = warm.warm_containers()[(project, "thr_a")]
    engine.api.kill(container)
    with pytest.raises(SandboxStartFailed):
        shell(warm, workspace, project, "thr_a", runner_id, "echo never > never.txt")
    assert not (workspace / "never.txt").exists()
    assert warm.warm_containers() == {}
    # The next call starts (and probes) a new one.
    assert shell(warm, workspace, project, "thr_a", runner_id, "echo ok")["stdout"] == "ok\n"
    assert warm.warm_containers()[(project, "thr_a")] != container


def test_runner_start_removes_idle_warm_containers_but_not_a_running_call(
    docker_backend, engine, workspace, project, runner_id
):
    """What a killed worker left: an idle container goes; one mid-call is the call's
    recovery's to remove, and recovery finds it by the call id."""
    left_behind = WarmDockerBackend(docker_backend)
    shell(left_behind, workspace, project, "thr_idle", runner_id, "true")
    idle = left_behind.warm_containers()[(project, "thr_idle")]
    shell(left_behind, workspace, project, "thr_busy", runner_id, "true")
    busy = left_behind.warm_containers()[(project, "thr_busy")]
    busy_dir = left_behind._sandboxes[(project, "thr_busy")].agent_dir
    call = labels(project, "thr_busy", runner_id)["call"]
    # A live worker process mid-call: it holds the container's lock and names the call.
    with open(busy_dir / "lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        (busy_dir / "call").write_text(call)
        assert remove_idle_warm_containers(engine, runner_id=runner_id) == 1
        assert warm_ids(engine, project) == {busy}
        assert idle not in warm_ids(engine, project)
        assert [c.id for c in containers_running_call(engine, call)] == [busy]
    # Its lock went with it (a worker that died): the container is idle now.
    assert [c.id for c in containers_running_call(engine, call)] == [busy]
    assert remove_idle_warm_containers(engine, runner_id=runner_id) == 1
    assert warm_ids(engine, project) == set()
    assert not busy_dir.exists()


def test_a_tool_error_does_not_leave_the_thread_without_a_sandbox(
    warm, workspace, project, runner_id
):
    with pytest.raises(RunnerError):
        execute(
            "shell.exec",
            {"argv": ["true"], "cwd": "missing"},
            workspace=workspace,
            backend=warm,
            limits=LIMITS,
            labels=labels(project, "thr_a", runner_id),
        )
    spec = ExecSpec(
        argv=("echo", "ok"),
        workspace=workspace,
        limits=LIMITS,
        labels=labels(project, "thr_a", runner_id),
    )
    assert run_confined(warm, spec).stdout == "ok\n"


# --- the agent (PID 1 of a warm container) ------------------------------------------------


def sandbox_of(warm, project, thread):
    return warm._sandboxes[(project, thread)]


def ask_agent(
    sandbox, request: dict, *, close_after_send: bool = False, plant: bool = True
) -> dict | None:
    """Talk to a container's agent as the runner does, planting the probe's token in the
    workspace first (``plant``); None when it answers nothing."""
    if plant and "probe" in request:
        marker = Path(sandbox.workspace) / request["probe"]["marker"]
        marker.write_text(request["probe"]["token"])
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(20)
        connection.connect(str(sandbox.agent_dir / "socket" / "agent.sock"))
        send_message(connection, request)
        if close_after_send:
            return None
        return read_message(connection)


def send_message(connection: socket.socket, message: dict) -> None:
    body = json.dumps(message).encode()
    connection.sendall(struct.pack(">I", len(body)) + body)


def read_message(connection: socket.socket) -> dict | None:
    header = connection.recv(4)
    if not header:
        return None
    size = struct.unpack(">I", header)[0]
    data = b""
    while len(data) < size:
        data += connection.recv(size - len(data))
    return json.loads(data)


def ignored_signals(status_line: str) -> set[int]:
    """The signal numbers a `SigIgn:` line of /proc/<pid>/status marks as ignored."""
    label, mask = status_line.split()
    assert label == "SigIgn:"
    bits = int(mask, 16)
    return {number for number in range(1, 65) if bits & (1 << (number - 1))}


def agent_request(sandbox, script: str, **overrides) -> dict:
    token = uuid.uuid4().hex
    parent = os.stat(Path(sandbox.workspace).parent)
    probe = {
        "token": token,
        "marker": f".kestrel-probe-{token}",
        "workspace": "/workspace",
        "parent": [parent.st_dev, parent.st_ino],
    }
    return {
        "key": sandbox.key,
        "probe": probe,
        "argv": ["sh", "-c", script],
        "env": {"PATH": "/usr/bin:/bin", "HOME": "/workspace"},
        "cwd": "/workspace",
        "tmpdir": f"/tmp/kestrel-test-{uuid.uuid4().hex[:8]}",
        "timeout_s": 30,
        "output_limit": 4096,
        **overrides,
    }


@pytest.mark.spec("RUN-3", "RUN-4")
def test_commands_can_neither_reach_nor_read_nor_stop_the_agent(
    warm, docker_backend, workspace, project, runner_id
):
    shell(warm, workspace, project, "thr_a", runner_id, "true")
    container = warm.warm_containers()[(project, "thr_a")]
    script = (
        f"ls {AGENT_MOUNT} 2>/dev/null || echo no-socket-dir; "
        "cat /proc/1/environ 2>/dev/null || echo no-environ; "
        "grep -c KESTREL_AGENT_KEY /proc/self/environ || true; "
        "kill -9 1 2>/dev/null; kill -INT 1 2>/dev/null; kill -TERM 1 2>/dev/null; echo sent; "
        "grep SigIgn /proc/self/status"
    )
    out = shell(warm, workspace, project, "thr_a", runner_id, script)["stdout"].split("\n")
    assert out[:4] == ["no-socket-dir", "no-environ", "0", "sent"]
    # The command ignores no signal that a fresh container's command does not: the engine
    # passes on what its own starter ignored (a CI runner had signal 32 ignored), and the
    # agent adds nothing, above all not the signals it handles itself.
    warm_ignored = ignored_signals(out[4])
    fresh = shell(
        docker_backend, workspace, project, None, runner_id, "grep SigIgn /proc/self/status"
    )
    assert warm_ignored <= ignored_signals(fresh["stdout"])
    assert warm_ignored.isdisjoint({signal.SIGHUP, signal.SIGINT, signal.SIGTERM})
    # PID 1 ignored every signal from inside: the same container serves the next call.
    assert shell(warm, workspace, project, "thr_a", runner_id, "echo alive")["stdout"] == "alive\n"
    assert warm.warm_containers()[(project, "thr_a")] == container


@pytest.mark.spec("RUN-3")
def test_the_agent_obeys_only_a_request_with_its_key(warm, workspace, project, runner_id):
    shell(warm, workspace, project, "thr_a", runner_id, "true")
    sandbox = sandbox_of(warm, project, "thr_a")
    for key in ("", "not-the-key", sandbox.key[:-1]):
        request = agent_request(sandbox, "echo ran > forged.txt", key=key)
        assert ask_agent(sandbox, request) is None
    assert not (workspace / "forged.txt").exists()
    # The right key is obeyed, so the refusals above were the key's doing.
    answer = ask_agent(sandbox, agent_request(sandbox, "echo ran > keyed.txt"))
    assert answer["exit_code"] == 0 and (workspace / "keyed.txt").exists()


@pytest.mark.spec("RUN-3")
def test_a_socket_that_is_not_the_containers_agent_is_never_used(
    warm, engine, workspace, project, runner_id, tmp_path
):
    """A socket swapped under the runner (anything but the container's PID 1 answering)
    gets no command, and the container is dropped."""
    shell(warm, workspace, project, "thr_a", runner_id, "true")
    sandbox = sandbox_of(warm, project, "thr_a")
    path = sandbox.agent_dir / "socket" / "agent.sock"
    path.rename(tmp_path / "real.sock")
    received = bytearray()
    impostor = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    impostor.bind(str(path))
    impostor.listen(1)

    def serve() -> None:
        connection, _ = impostor.accept()
        with connection:
            connection.settimeout(5)
            try:
                while chunk := connection.recv(4096):
                    received.extend(chunk)
            except OSError:
                pass

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    with pytest.raises(SandboxStartFailed, match="not the container's"):
        shell(warm, workspace, project, "thr_a", runner_id, "echo never > never.txt")
    server.join(10)
    impostor.close()
    assert bytes(received) == b""
    assert not (workspace / "never.txt").exists()
    assert warm.warm_containers() == {}
    assert warm_ids(engine, project) == set()


@pytest.mark.spec("RUN-3")
def test_a_containers_agent_dir_label_is_only_a_claim(
    warm, engine, workspace, project, runner_id, tmp_path
):
    """The runner writes, links and removes in the directory a warm container's label names,
    and an image's labels reach its containers. A label naming anything but a directory of the
    runner's own, directly in its agent root, names no directory."""
    shell(warm, workspace, project, "thr_a", runner_id, "true")
    sandbox = sandbox_of(warm, project, "thr_a")
    container = engine.containers.get(sandbox.container_id)
    assert warm_host.agent_dir_of(container) == sandbox.agent_dir  # its own: found

    def claiming(path: Path) -> Any:
        return SimpleNamespace(attrs={"Labels": {warm_host.AGENT_DIR_LABEL: str(path)}})

    elsewhere = tmp_path / f"warm-{'0' * 24}"
    elsewhere.mkdir()
    linked = sandbox.agent_dir.parent / f"warm-{'1' * 24}"
    linked.symlink_to(elsewhere)
    a_file = sandbox.agent_dir.parent / f"warm-{'2' * 24}"
    a_file.write_text("")
    try:
        for path in (elsewhere, linked, a_file, sandbox.agent_dir.parent / f"warm-{'3' * 24}"):
            assert warm_host.agent_dir_of(claiming(path)) is None, path
    finally:
        linked.unlink()
        a_file.unlink()


def test_the_agent_runs_nothing_without_a_probe_that_passes(warm, workspace, project, runner_id):
    shell(warm, workspace, project, "thr_a", runner_id, "true")
    sandbox = sandbox_of(warm, project, "thr_a")
    unprobed = agent_request(sandbox, "echo ran > unprobed.txt")
    del unprobed["probe"]
    assert "probe_failed" in ask_agent(sandbox, unprobed)
    # A token the runner did not plant: not the workspace the runner sees.
    unplanted = agent_request(sandbox, "echo ran > unplanted.txt")
    assert "probe_failed" in ask_agent(sandbox, unplanted, plant=False)
    assert not (workspace / "unprobed.txt").exists()
    assert not (workspace / "unplanted.txt").exists()
    # A probed request with the runner's go runs, so the refusals above were the probe's.
    answer = ask_agent(sandbox, agent_request(sandbox, "echo ran > probed.txt"))
    assert answer["exit_code"] == 0 and (workspace / "probed.txt").exists()


@pytest.mark.spec("RUN-8", "RUN-4")
def test_a_runner_that_leaves_mid_call_leaves_nothing_running(warm, workspace, project, runner_id):
    """A worker killed mid-call drops its connection: the agent kills the call's tree."""
    shell(warm, workspace, project, "thr_a", runner_id, "true")
    sandbox = sandbox_of(warm, project, "thr_a")
    request = agent_request(sandbox, "sleep 4107 & sleep 4108; echo late > late.txt")
    ask_agent(sandbox, request, close_after_send=True)
    ps = "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done"
    deadline = time.monotonic() + 20
    while True:
        listed = shell(warm, workspace, project, "thr_a", runner_id, ps)["stdout"]
        if "sleep 410" not in listed:
            break
        assert time.monotonic() < deadline, listed
        time.sleep(0.1)
    assert not (workspace / "late.txt").exists()


def test_output_past_the_cap_is_cut_and_flagged(warm, workspace, project, runner_id):
    small = ExecLimits(timeout_s=30, memory_mb=96, cpus=0.5, pids=40, output_kb=1, tmp_mb=8)
    script = "head -c 5000 /dev/zero | tr '\\0' x; head -c 3000 /dev/zero | tr '\\0' y >&2"
    result = shell(warm, workspace, project, "thr_a", runner_id, script, limits=small)
    assert result["stdout"] == "x" * 1024
    assert result["stderr"] == "y" * 1024
    assert result["truncated"] is True


def test_a_missing_command_fails_like_a_shell_would(warm, workspace, project, runner_id):
    shell(warm, workspace, project, "thr_a", runner_id, "true")
    spec = ExecSpec(
        argv=("no-such-command",),
        workspace=workspace,
        limits=LIMITS,
        labels=labels(project, "thr_a", runner_id),
    )
    result = run_confined(warm, spec)
    assert result.exit_code == 127
    assert "no-such-command" in result.stderr
    assert (project, "thr_a") in warm.warm_containers()


@pytest.mark.spec("RUN-4")
def test_a_command_killed_for_memory_is_reported_and_its_container_dropped(
    warm, engine, workspace, project, runner_id
):
    shell(warm, workspace, project, "thr_a", runner_id, "true")
    script = "python3 -c 'b = bytearray(400 * 1024 * 1024); print(len(b))'"
    result = shell(warm, workspace, project, "thr_a", runner_id, script)
    assert result["exit_code"] == 137
    assert result["oom_killed"] is True
    assert warm.warm_containers() == {}
    assert warm_ids(engine, project) == set()


def test_the_agent_directory_must_be_the_runners_own_and_closed(tmp_path, monkeypatch):
    open_to_others = tmp_path / "open"
    open_to_others.mkdir(mode=0o755)
    open_to_others.chmod(0o755)
    monkeypatch.setenv(warm_host.AGENT_ROOT_VARIABLE, str(open_to_others))
    with pytest.raises(SandboxUnavailable, match="mode 0700"):
        warm_host.agent_root_directory()
    made = tmp_path / "made" / "here"
    monkeypatch.setenv(warm_host.AGENT_ROOT_VARIABLE, str(made))
    assert warm_host.agent_root_directory() == made
    assert stat.S_IMODE(made.stat().st_mode) == 0o700


def test_runner_start_removes_directories_whose_container_is_gone(
    warm, engine, workspace, project, runner_id
):
    shell(warm, workspace, project, "thr_a", runner_id, "true")
    live = sandbox_of(warm, project, "thr_a").agent_dir
    root = live.parent
    old, young = root / f"warm-{uuid.uuid4().hex[:24]}", root / f"warm-{uuid.uuid4().hex[:24]}"
    for orphan in (old, young):
        (orphan / "socket").mkdir(parents=True)
    an_hour_ago = time.time() - 3600
    os.utime(old, (an_hour_ago, an_hour_ago))
    os.utime(live, (an_hour_ago, an_hour_ago))

    # Another runner's start: nothing of this runner's is idle-removed, but orphans go.
    remove_idle_warm_containers(engine, runner_id=f"run_other{uuid.uuid4().hex[:8]}")
    assert not old.exists()
    assert young.exists()  # may belong to a container being created right now
    assert live.exists()  # its container still exists
    shutil.rmtree(young)


def test_a_thread_has_one_container_per_host_whichever_process_runs_its_calls(
    docker_backend, engine, workspace, project, runner_id
):
    first_process = WarmDockerBackend(docker_backend)
    second_process = WarmDockerBackend(docker_backend)
    try:
        shell(first_process, workspace, project, "thr_a", runner_id, "echo one > one.txt")
        container = first_process.warm_containers()[(project, "thr_a")]
        result = shell(second_process, workspace, project, "thr_a", runner_id, "cat one.txt")
        assert result["stdout"] == "one\n"
        assert second_process.warm_containers()[(project, "thr_a")] == container
        assert warm_ids(engine, project) == {container}

        # Busy in one process, the other runs its call fresh: it neither waits nor shares.
        busy_dir = sandbox_of(first_process, project, "thr_a").agent_dir
        with open(busy_dir / "lock") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            fresh = shell(second_process, workspace, project, "thr_a", runner_id, "echo fresh")
        assert fresh["stdout"] == "fresh\n"
        assert warm_ids(engine, project) == {container}
        assert (
            shell(second_process, workspace, project, "thr_a", runner_id, "true")["exit_code"] == 0
        )
        assert second_process.warm_containers()[(project, "thr_a")] == container
    finally:
        first_process.close()
        second_process.close()
