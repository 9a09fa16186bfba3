"""Confinement inside the Docker backend, observed from inside and from the engine.

Every test runs real containers from the locally built tool image (RUN-3, RUN-4).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from runners.contract.errors import InvalidArguments
from runners.dispatch import execute
from runners.sandbox import ExecLimits, ExecSpec
from runners.sandbox.docker import MANAGED_LABEL
from runners.workspace import SANDBOX_UID, PathRefused

pytestmark = [pytest.mark.docker, pytest.mark.spec("RUN-3", "RUN-4")]

FAST = ExecLimits(timeout_s=30, memory_mb=128, cpus=0.5, pids=64, output_kb=64, tmp_mb=8)


@pytest.fixture
def run(docker_backend, docker_client, workspace, call_labels):
    """Run a tool through the Docker backend, probed first, exactly as the runner will."""

    def run_tool(tool: str, limits: ExecLimits = FAST, **args) -> dict:
        return execute(
            tool,
            args,
            workspace=workspace,
            backend=docker_backend,
            limits=limits,
            labels=call_labels,
        )

    return run_tool


def _python(run, code: str, limits: ExecLimits = FAST) -> dict:
    result = run("code.python", limits, code=code)
    assert result["sandbox"] == "docker"
    return result


def _processes_matching(needle: str) -> list[int]:
    """Host PIDs whose command line contains ``needle`` (containers' processes included)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_stdout_stderr_and_exit_code_come_back_separately(run):
    result = run("shell.exec", script="echo out; echo err >&2; exit 7")
    assert result["exit_code"] == 7
    assert result["stdout"] == "out\n"
    assert result["stderr"] == "err\n"
    assert result["truncated"] is False
    assert result["timed_out"] is False
    assert isinstance(result["duration_ms"], int)


def test_argv_is_passed_without_a_shell(run):
    result = run("shell.exec", argv=["printf", "%s|", "a b", "$HOME", ";rm -rf /"])
    assert result["stdout"] == "a b|$HOME|;rm -rf /|"


def test_only_the_loopback_interface_exists(run):
    result = _python(run, "import os; print(sorted(os.listdir('/sys/class/net')))")
    assert result["stdout"].strip() == "['lo']"
    devices = run("shell.exec", argv=["cat", "/proc/net/dev"])["stdout"].splitlines()[2:]
    assert [line.split(":")[0].strip() for line in devices] == ["lo"]


def test_connecting_out_fails(run):
    code = """
import socket
for address in [("1.1.1.1", 53), ("8.8.8.8", 443), ("172.17.0.1", 2375)]:
    try:
        socket.create_connection(address, timeout=3)
        print("CONNECTED", address)
    except OSError as error:
        print("refused", address, error.errno)
"""
    result = _python(run, code)
    assert "CONNECTED" not in result["stdout"]
    assert result["stdout"].count("refused") == 3


def test_the_root_filesystem_is_read_only(run):
    result = run(
        "shell.exec", script="for d in / /etc /usr/bin /var; do touch $d/x || echo ro $d; done"
    )
    assert result["stdout"].split("\n")[:-1] == ["ro /", "ro /etc", "ro /usr/bin", "ro /var"]
    assert "Read-only file system" in result["stderr"]


def test_no_capabilities_no_new_privileges_and_a_non_root_user(run):
    result = run(
        "shell.exec", script="id -u; grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status"
    )
    lines = result["stdout"].split()
    assert lines[0] == str(SANDBOX_UID)
    assert lines[1:] == [
        "CapEff:",
        "0000000000000000",
        "CapBnd:",
        "0000000000000000",
        "NoNewPrivs:",
        "1",
    ]


def test_mount_and_unshare_fail(run):
    code = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
mounted = libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)
print("mount", mounted, os.strerror(ctypes.get_errno()))
for name, flag in [("user", CLONE_NEWUSER), ("mount", CLONE_NEWNS), ("net", CLONE_NEWNET),
                   ("user+mount", CLONE_NEWUSER | CLONE_NEWNS)]:
    print("unshare", name, libc.unshare(flag), os.strerror(ctypes.get_errno()))
"""
    lines = _python(run, code)["stdout"].splitlines()
    assert len(lines) == 5
    for line in lines:
        assert " -1 " in line, line
        assert "Operation not permitted" in line, line


def test_tmpdir_is_a_private_per_command_tmpfs(run):
    first = run("shell.exec", script='echo $TMPDIR; echo data > "$TMPDIR/left-over"; ls $TMPDIR')
    assert first["stdout"] == "/tmp\nleft-over\n"
    second = run("shell.exec", script='ls -A "$TMPDIR"; grep " /tmp " /proc/mounts')
    assert second["stdout"].startswith("tmpfs /tmp tmpfs")  # empty listing, then the mount


def test_the_workspace_is_mounted_writable_and_shared_with_file_tools(run, workspace):
    run("fs.write", path="notes/a.txt", content="from fs.write\n")
    result = run(
        "shell.exec",
        cwd="notes",
        script="pwd; cat a.txt; echo from shell >> a.txt; echo new > b.txt",
    )
    assert result["stdout"] == "/workspace/notes\nfrom fs.write\n"
    assert run("fs.read", path="notes/a.txt")["content"] == "from fs.write\nfrom shell\n"
    assert (workspace / "notes" / "b.txt").stat().st_uid == SANDBOX_UID


def test_the_environment_is_overlaid_but_the_sandbox_names_hold(run):
    result = run("shell.exec", script="echo $GREETING $HOME $TMPDIR $PATH", env={"GREETING": "hi"})
    assert result["stdout"] == "hi /workspace /tmp /usr/local/bin:/usr/bin:/bin\n"
    with pytest.raises(InvalidArguments):
        run("shell.exec", script="true", env={"PATH": "/workspace"})


def test_the_working_directory_is_confined_to_the_workspace(run, workspace):
    with pytest.raises(InvalidArguments):
        run("shell.exec", argv=["pwd"], cwd="..")
    with pytest.raises(InvalidArguments):
        run("shell.exec", argv=["pwd"], cwd="/etc")
    os.symlink("/etc", workspace / "etc-link")
    with pytest.raises(PathRefused):
        run("shell.exec", argv=["pwd"], cwd="etc-link")


def test_output_is_capped_with_a_truncated_flag(run):
    limits = ExecLimits(timeout_s=30, memory_mb=128, cpus=0.5, pids=64, output_kb=4, tmp_mb=8)
    result = run(
        "shell.exec", limits, script="head -c 100000 /dev/zero | tr '\\0' a; echo done >&2"
    )
    assert result["truncated"] is True
    assert result["stdout"] == "a" * 4096
    assert result["stderr"] == "done\n"
    assert result["exit_code"] == 0


def test_a_fork_bomb_is_held_by_the_pids_limit(run):
    code = """
import os, time
children = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        children += 1
except OSError as error:
    print("stopped", children, error.errno)
"""
    result = _python(run, code)
    words = result["stdout"].split()
    assert words[0] == "stopped", result
    assert 0 < int(words[1]) < FAST.pids
    assert int(words[2]) == 11  # EAGAIN: the pids cgroup said no
    assert _processes_matching("time.sleep(60)") == []  # the tree went with the container


def test_a_shell_fork_bomb_is_refused_forks_and_ends(run):
    limits = ExecLimits(timeout_s=5, memory_mb=128, cpus=0.5, pids=32, output_kb=4, tmp_mb=8)
    result = run("shell.exec", limits, script="bomb() { bomb | bomb & }; bomb; sleep 3")
    # The main shell stays up for 3 s so that the bomb meets the pids limit before the
    # container ends: with `wait` it could exit first, since its one job returns at once and
    # docker-init then takes the whole tree down, with nothing to report (seen in CI). It
    # ends one way or the other and leaves nothing running; on a loaded machine the
    # timeout can end it before a subshell has reported a failed fork (the pids limit itself
    # is proved by the EAGAIN test above).
    assert "Cannot fork" in result["stderr"] or result["timed_out"], result
    assert _processes_matching("bomb | bomb") == []  # the script itself, nothing else


def test_a_memory_hog_is_killed_and_reported(run):
    limits = ExecLimits(timeout_s=30, memory_mb=64, cpus=0.5, pids=64, output_kb=8, tmp_mb=8)
    result = _python(run, "hog = b'x' * (512 * 1024 * 1024)\nprint('survived')", limits)
    assert result["oom_killed"] is True
    assert result["exit_code"] == 137
    assert "survived" not in result["stdout"]


def test_a_timeout_kills_the_whole_process_tree(run, docker_client, call_labels):
    limits = ExecLimits(timeout_s=2, memory_mb=64, cpus=0.5, pids=64, output_kb=8, tmp_mb=8)
    result = run(
        "shell.exec",
        limits,
        script="(sleep 3107; echo late > late.txt) & sleep 3108 & echo started; sleep 3109",
    )
    assert result["timed_out"] is True
    assert result["exit_code"] == 137
    assert result["stdout"] == "started\n"
    assert _processes_matching("sleep 310") == []
    assert (
        docker_client.containers.list(
            all=True, filters={"label": f"io.kestrel.call={call_labels['call']}"}
        )
        == []
    )


def test_docker_inspect_shows_the_hardening(docker_backend, docker_client, workspace, call_labels):
    spec = ExecSpec(
        argv=("sleep", "60"),
        workspace=workspace,
        limits=ExecLimits(timeout_s=60, memory_mb=96, cpus=0.5, pids=40, output_kb=8, tmp_mb=8),
        labels=call_labels,
    )
    outcome = {}
    worker = threading.Thread(target=lambda: outcome.update(result=docker_backend.run(spec)))
    worker.start()
    label = f"io.kestrel.call={call_labels['call']}"
    containers = []
    while not containers and worker.is_alive():
        containers = docker_client.containers.list(filters={"label": label})
        time.sleep(0.1)
    assert len(containers) == 1
    attrs = docker_client.api.inspect_container(containers[0].id)
    containers[0].kill()
    worker.join(30)

    host, config = attrs["HostConfig"], attrs["Config"]
    assert host["NetworkMode"] == "none"
    assert host["ReadonlyRootfs"] is True
    assert host["CapDrop"] == ["ALL"]
    assert not host["CapAdd"]
    assert "no-new-privileges" in host["SecurityOpt"]
    assert host["Privileged"] is False
    assert host["PidsLimit"] == 40
    assert host["Memory"] == 96 * 1024 * 1024
    assert host["MemorySwap"] == 96 * 1024 * 1024
    assert host["NanoCpus"] == 500_000_000
    assert host["Init"] is True
    assert host["PidMode"] == ""
    assert host["IpcMode"] == "private"
    assert host["UTSMode"] == ""
    assert host["UsernsMode"] == ""
    assert not host["Devices"]
    assert "/tmp" in host["Tmpfs"]
    assert config["User"] == f"{SANDBOX_UID}:{SANDBOX_UID}"
    assert config["Image"] == docker_backend.image_id
    assert config["Labels"][MANAGED_LABEL] == "true"
    assert config["Labels"]["io.kestrel.project"] == "prj_test"
    mounts = attrs["Mounts"]
    assert [(m["Type"], m["Destination"], m["RW"]) for m in mounts] == [
        ("bind", "/workspace", True)
    ]
    assert mounts[0]["Source"] == str(workspace)
    assert all("docker.sock" not in m["Source"] for m in mounts)
    assert outcome["result"].timed_out is False
