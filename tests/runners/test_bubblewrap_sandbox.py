"""Confinement inside the bubblewrap backend (single-host mode without Docker).

Bubblewrap has no cgroups, so the memory and process limits are rlimits (best effort, see
runners/sandbox/bubblewrap.py); these tests hold it to the rest of RUN-3 and RUN-4.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from runners.dispatch import execute
from runners.sandbox import (
    BubblewrapBackend,
    ExecLimits,
    ExecResult,
    ExecSpec,
    SandboxUnavailable,
    bubblewrap,
)
from runners.workspace import SANDBOX_UID, workspace_for

pytestmark = pytest.mark.spec("RUN-3", "RUN-4")

FAST = ExecLimits(timeout_s=30, memory_mb=256, cpus=1, pids=64, output_kb=64, tmp_mb=8)


@pytest.fixture
def run(bwrap_backend: BubblewrapBackend, workspace, call_labels):
    def run_tool(tool: str, limits: ExecLimits = FAST, **args) -> dict:
        result = execute(
            tool,
            args,
            workspace=workspace,
            backend=bwrap_backend,
            limits=limits,
            labels=call_labels,
        )
        if "sandbox" in result:
            assert result["sandbox"] == "bubblewrap"
        return result

    return run_tool


def test_stdout_stderr_and_exit_code_come_back_separately(run):
    result = run("shell.exec", script="echo out; echo err >&2; exit 7")
    assert (result["exit_code"], result["stdout"], result["stderr"]) == (7, "out\n", "err\n")


def test_runs_as_the_sandbox_user_without_capabilities(run):
    result = run("shell.exec", script="id -u; grep -E '^(CapEff|NoNewPrivs)' /proc/self/status")
    expected_uid = SANDBOX_UID if os.geteuid() == 0 else os.getuid()
    assert result["stdout"].split() == [
        str(expected_uid),
        "CapEff:",
        "0000000000000000",
        "NoNewPrivs:",
        "1",
    ]


def test_only_the_loopback_interface_exists_and_connecting_out_fails(run):
    devices = run("shell.exec", argv=["cat", "/proc/net/dev"])["stdout"].splitlines()[2:]
    assert [line.split(":")[0].strip() for line in devices] == ["lo"]
    code = """
import socket
try:
    socket.create_connection(("1.1.1.1", 53), timeout=3)
    print("CONNECTED")
except OSError as error:
    print("refused", error.errno)
"""
    assert run("code.python", code=code)["stdout"].startswith("refused")


def test_only_the_workspace_and_tmp_are_writable(run):
    result = run(
        "shell.exec",
        script="for d in / /etc /usr/bin /proc/sys/kernel; do touch $d/x 2>&- || echo no $d; done",
    )
    assert result["stdout"].split("\n")[:-1] == [
        "no /",
        "no /etc",
        "no /usr/bin",
        "no /proc/sys/kernel",
    ]
    assert (
        run("shell.exec", script='touch "$TMPDIR/x" && touch /workspace/y && echo ok')["stdout"]
        == "ok\n"
    )


def test_other_host_paths_are_not_visible(run, workspace_root):
    (workspace_root / "prj_other").mkdir()
    (workspace_root / "prj_other" / "secret").write_text("other tenant")
    listing = run(
        "shell.exec", script=f"ls / ; ls {workspace_root} 2>&1; ls /var/run/docker.sock 2>&1"
    )
    assert "No such file or directory" in listing["stdout"]
    assert "prj_other" not in listing["stdout"]
    top_level = set(listing["stdout"].split("\n")[0:20])
    assert {"home", "root", "var", "work", "srv"}.isdisjoint(top_level)


def test_of_the_hosts_etc_only_what_programs_read_is_visible(run):
    """The host's /etc holds what the host keeps for itself: a runner's key under
    /etc/kestrel (readable by the uid a non-root runner shares with its sandboxes), registry
    tokens in /etc/npmrc or /etc/pip.conf, the host's accounts. The sandbox sees only the
    entries programs read, and those programs still work."""
    visible = set(run("shell.exec", argv=["ls", "-A", "/etc"])["stdout"].split())
    top_level = {path.split("/")[2] for path in bubblewrap.system_etc_entries()}
    assert visible == top_level and "ld.so.cache" in visible
    host_only = {"passwd", "shadow", "hostname", "machine-id"} & set(os.listdir("/etc"))
    assert host_only and host_only.isdisjoint(visible)
    read = run("shell.exec", argv=["cat", "/etc/passwd"])
    assert read["exit_code"] != 0 and "No such file or directory" in read["stderr"]

    # What programs read is there: the linker's cache, Debian's alternatives (awk is one),
    # the CA bundle and the time zone database.
    works = run(
        "shell.exec",
        script="awk 'BEGIN { print 6 * 7 }'; python3 -c 'import ssl, os; "
        "print(os.path.exists(ssl.get_default_verify_paths().openssl_capath))'",
    )
    assert works["stdout"].split() == ["42", "True"], works


def test_mount_and_unshare_fail(run):
    code = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
print("mount", libc.mount(b"none", b"/tmp", b"tmpfs", 0, None), os.strerror(ctypes.get_errno()))
print("unshare", libc.unshare(0x10000000), os.strerror(ctypes.get_errno()))
"""
    for line in run("code.python", code=code)["stdout"].splitlines():
        assert " -1 " in line, line


def test_a_timeout_kills_the_whole_process_tree(run, workspace):
    limits = ExecLimits(timeout_s=2, memory_mb=64, cpus=1, pids=64, output_kb=8, tmp_mb=8)
    result = run(
        "shell.exec",
        limits,
        script="(sleep 4107; touch late) & sleep 4108 & echo started; sleep 4109",
    )
    assert result["timed_out"] is True
    assert result["exit_code"] == 137
    assert result["stdout"] == "started\n"
    leftovers = [
        p for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline_has(p, b"sleep 410")
    ]
    assert leftovers == []
    assert not (workspace / "late").exists()


def test_process_and_memory_rlimits_hold(run):
    code = """
import os
children = 0
try:
    while True:
        if os.fork() == 0:
            import time; time.sleep(30); os._exit(0)
        children += 1
except OSError as error:
    print("stopped", error.errno)
try:
    hog = b"x" * (1024 * 1024 * 1024)
    print("allocated")
except MemoryError:
    print("memory refused")
"""
    limits = ExecLimits(timeout_s=20, memory_mb=128, cpus=1, pids=16, output_kb=8, tmp_mb=8)
    assert run("code.python", limits, code=code)["stdout"] == "stopped 11\nmemory refused\n"


# Forks until the process limit stops it, says so in a file, and holds its children until
# the test lets go: a tenant whose sandbox sits at its process limit.
_HOLD_AT_LIMIT = """
import os, time
children = 0
try:
    while True:
        if os.fork() == 0:
            while not os.path.exists("release"):
                time.sleep(0.05)
            os._exit(0)
        children += 1
except OSError:
    pass
with open("full.new", "w") as full:
    full.write(str(children))
os.rename("full.new", "full")
while not os.path.exists("release"):
    time.sleep(0.05)
print(children)
"""
_START_FOUR = """
import os
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
print("four started")
"""


def test_a_sandbox_at_its_process_limit_leaves_another_sandbox_its_own(
    bwrap_backend: BubblewrapBackend, workspace_root: Path
):
    """Process limits are per call: each sandbox's processes are counted in its own user
    namespace, not for the sandbox uid that every sandbox on the host shares."""
    limits = ExecLimits(timeout_s=60, memory_mb=128, cpus=1, pids=16, output_kb=8, tmp_mb=8)
    holder = workspace_for(workspace_root, "prj_holder")
    other = workspace_for(workspace_root, "prj_other")
    held: list[ExecResult | BaseException] = []

    def hold() -> None:
        try:
            spec = ExecSpec(argv=("python3", "-c", _HOLD_AT_LIMIT), workspace=holder, limits=limits)
            held.append(bwrap_backend.run(spec))
        except BaseException as error:  # reported by the assertions below
            held.append(error)

    holding = threading.Thread(target=hold, daemon=True)
    holding.start()
    try:
        deadline = time.monotonic() + 30
        while not (holder / "full").exists():
            assert holding.is_alive(), f"the holding sandbox ended early: {held}"
            assert time.monotonic() < deadline, "the holding sandbox never reached its limit"
            time.sleep(0.05)
        # The first sandbox is at its limit now, and stays there until released.
        spec = ExecSpec(argv=("python3", "-c", _START_FOUR), workspace=other, limits=limits)
        result = bwrap_backend.run(spec)
        assert (result.exit_code, result.stdout) == (0, "four started\n"), result.stderr
    finally:
        (holder / "release").touch()
        holding.join(60)
    # The limit itself held, for the sandbox's own processes only: the command and as many
    # children as make up ``pids``.
    assert isinstance(held[0], ExecResult), held
    assert (held[0].exit_code, held[0].stdout) == (0, f"{limits.pids - 1}\n")


def test_a_kernel_that_counts_processes_per_uid_only_is_refused(monkeypatch):
    """Before Linux 5.14 every sandbox of the host would share one process count."""
    monkeypatch.setattr(bubblewrap, "kernel_release", lambda: (5, 10))
    with pytest.raises(SandboxUnavailable, match=r"needs Linux 5\.14"):
        BubblewrapBackend.from_environment()
    monkeypatch.undo()
    assert isinstance(BubblewrapBackend.from_environment(), BubblewrapBackend)


def _cmdline_has(process: Path, needle: bytes) -> bool:
    try:
        return int(process.name) != os.getpid() and needle in (process / "cmdline").read_bytes()
    except OSError:
        return False
