"""Each call's write budget on its workspace's quota filesystem (RUN-3): the kernel refuses
the write past it, the call fails ``write_budget_exceeded``, and the next call has its own
budget again. Real ext4 loop mounts, real Docker and bubblewrap."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import redis

from runners.contract.tokens import generate_private_key_pem
from runners.dispatch import execute
from runners.runner import Disposition
from runners.sandbox import BubblewrapBackend, DockerBackend, ExecLimits, SandboxBackend
from runners.workspace import WorkspaceFull, WorkspaceQuota, workspace_for
from runners.write_budget import (
    CallWriteBudget,
    WriteBudgetExceeded,
    room_after_end,
    room_after_start,
)
from tests.runners.support import runner_config
from tests.runners.test_protocol import CONTROL_PUBLIC, POOL
from tests.runners.test_worker_calls import RUNNER_ID, Recorder, command, make_runner, reports

pytestmark = pytest.mark.spec("RUN-3")

MIB = 1024 * 1024
QUOTA_MB = 64
BUDGET = 8 * MIB
PROJECT = "prj_budget"
FAST = ExecLimits(timeout_s=30, memory_mb=256, cpus=1, pids=64, output_kb=64, tmp_mb=8)


@pytest.fixture
def quota_workspace(workspace_root: Path):
    """A project's workspace on its own 64 MiB filesystem, unmounted afterwards."""
    workspace = workspace_for(workspace_root, PROJECT, quota_mb=QUOTA_MB)
    yield workspace
    WorkspaceQuota(workspace_root).unmount_all()


def reserve_knob(workspace: Path) -> Path:
    device = os.stat(workspace).st_dev
    name = Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}").resolve().name
    return Path("/sys/fs/ext4") / name / "reserved_clusters"


def reserved(workspace: Path) -> int:
    return int(reserve_knob(workspace).read_text())


def room_bytes(workspace: Path) -> int:
    size = os.statvfs(workspace)
    return size.f_bavail * size.f_frsize


def shell(workspace: Path, backend: SandboxBackend, labels: dict[str, str], script: str):
    return execute(
        "shell.exec",
        {"script": script},
        workspace=workspace,
        backend=backend,
        limits=FAST,
        labels={**labels, "project": PROJECT},
        write_budget_bytes=BUDGET,
    )


def assert_budget_is_per_call(
    workspace: Path, backend: SandboxBackend, labels: dict[str, str]
) -> None:
    default = reserved(workspace)
    with pytest.raises(WriteBudgetExceeded) as exceeded:
        shell(workspace, backend, labels, "head -c 12M /dev/zero > first.bin")
    assert exceeded.value.code == "write_budget_exceeded"
    assert "8 MiB" in str(exceeded.value) and "KESTREL_CALL_WRITE_BUDGET_MB" in str(exceeded.value)
    # The kernel stopped the write at the budget while the quota still had room for more.
    assert os.path.getsize(workspace / "first.bin") == BUDGET
    assert room_bytes(workspace) > 40 * MIB
    assert reserved(workspace) == default  # restored once the call ended

    # The budget is per call, not for the workspace's life: the next call writes again.
    result = shell(workspace, backend, labels, "head -c 6M /dev/zero > second.bin; echo ok")
    assert result["exit_code"] == 0 and result["stdout"] == "ok\n", result["stderr"]
    assert os.path.getsize(workspace / "second.bin") == 6 * MIB
    # Deleting gives the room back to the call: the budget bounds how much it grows.
    result = shell(
        workspace, backend, labels, "rm first.bin second.bin; head -c 20M /dev/zero > third.bin"
    )
    assert result["exit_code"] == 0, result["stderr"]
    assert reserved(workspace) == default


@pytest.mark.docker
def test_a_docker_call_that_writes_past_its_budget_fails_and_the_next_call_can_write(
    quota_workspace, docker_backend: DockerBackend, call_labels
):
    assert_budget_is_per_call(quota_workspace, docker_backend, call_labels)


def test_a_bubblewrap_call_that_writes_past_its_budget_fails_and_the_next_call_can_write(
    quota_workspace, bwrap_backend: BubblewrapBackend, call_labels
):
    assert_budget_is_per_call(quota_workspace, bwrap_backend, call_labels)


def test_a_file_tool_write_past_its_budget_is_refused_and_leaves_nothing(quota_workspace):
    def write(content: str) -> None:
        execute(
            "fs.write",
            {"path": "notes.txt", "content": content},
            workspace=quota_workspace,
            backend=None,
            limits=FAST,
            labels={},
            write_budget_bytes=MIB,
        )

    with pytest.raises(WriteBudgetExceeded):
        write("\u00e9" * MIB)  # 2 MiB of UTF-8: the runner writes as root, and is bound too
    assert os.listdir(quota_workspace) == []
    write("\u00e9" * (MIB // 4))
    assert (quota_workspace / "notes.txt").stat().st_size == MIB // 2


def test_a_full_quota_is_still_workspace_full_not_the_budget(workspace_root: Path):
    """Where the quota is the tighter bound, the call fails as it did without a budget."""
    workspace = workspace_for(workspace_root, PROJECT, quota_mb=16)
    # Leave half a MiB of room: less than the budget.
    (workspace / "fill.bin").write_bytes(b"\0" * (room_bytes(workspace) - MIB // 2))
    with pytest.raises(WorkspaceFull) as full:
        execute(
            "fs.write",
            {"path": "big.txt", "content": "x" * MIB},
            workspace=workspace,
            backend=None,
            limits=FAST,
            labels={},
            write_budget_bytes=64 * MIB,
        )
    assert "KESTREL_WORKSPACE_QUOTA_MB" in str(full.value)


# --- calls of one project running at once ----------------------------------------------


def test_calls_that_overlap_share_the_sum_of_their_budgets():
    # Alone, a call has its budget; a second call adds its own to what is left.
    assert room_after_start(room=500, others_running=False, budget=100) == 100
    assert room_after_start(room=60, others_running=True, budget=100) == 160
    # An ended call's unused budget goes with it; what the others used is not given back.
    assert room_after_end(room=160, budgets_running=[100]) == 100
    assert room_after_end(room=30, budgets_running=[100]) == 30
    assert room_after_end(room=30, budgets_running=[100, 100]) == 30


def test_two_running_calls_of_a_project_get_both_budgets_and_no_more(quota_workspace):
    default = reserved(quota_workspace)
    first = CallWriteBudget(quota_workspace, BUDGET)
    second = CallWriteBudget(quota_workspace, BUDGET)
    with first:
        assert room_bytes(quota_workspace) == BUDGET
        with second:
            assert room_bytes(quota_workspace) == 2 * BUDGET
            (quota_workspace / "a.bin").write_bytes(b"\0" * (12 * MIB))
            os.sync()
        # The second call's unused budget went with it; the first keeps what is left.
        assert room_bytes(quota_workspace) == 4 * MIB
        assert not second.exceeded
        with pytest.raises(OSError, match="No space left"):
            (quota_workspace / "b.bin").write_bytes(b"\0" * (5 * MIB))
    assert first.exceeded
    assert reserved(quota_workspace) == default
    assert os.listdir(WorkspaceQuota(quota_workspace.parent).calls_folder(PROJECT)) == []


def test_a_call_whose_process_died_leaves_no_reservation_behind(quota_workspace):
    """A worker killed mid-call cannot restore the reservation; the next call of the
    project finds its entry unlocked, forgets its budget, and leaves the default after it."""
    default = reserved(quota_workspace)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import sys, time
                from runners.write_budget import CallWriteBudget
                with CallWriteBudget({str(quota_workspace)!r}, {BUDGET}):
                    print("in", flush=True)
                    time.sleep(600)
                """
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "in\n"
        assert room_bytes(quota_workspace) == BUDGET
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert reserved(quota_workspace) > default  # what the dead call left
    calls = WorkspaceQuota(quota_workspace.parent).calls_folder(PROJECT)
    with CallWriteBudget(quota_workspace, BUDGET):
        assert room_bytes(quota_workspace) == BUDGET  # its own budget, not both
        assert os.listdir(calls) != []
    assert reserved(quota_workspace) == default
    assert os.listdir(calls) == []


def test_a_remount_starts_from_the_default_reservation(workspace_root: Path):
    workspace = workspace_for(workspace_root, PROJECT, quota_mb=QUOTA_MB)
    default = reserved(workspace)
    reserve_knob(workspace).write_text(f"{default * 10}\n")
    quota = WorkspaceQuota(workspace_root)
    quota.unmount_all()
    workspace_for(workspace_root, PROJECT, quota_mb=QUOTA_MB)
    assert reserved(workspace) == default
    quota.unmount_all()


# --- through the runner: the signed report ---------------------------------------------


@pytest.mark.docker
def test_the_runner_reports_a_call_past_its_budget_as_failed_with_the_setting(
    tmp_path: Path, workspace_root: Path, runner_redis: redis.Redis, docker_backend: DockerBackend
):
    runner_key = generate_private_key_pem()
    config = dataclasses.replace(
        runner_config(
            tmp_path,
            runner_id=RUNNER_ID,
            pool=POOL,
            runner_key=runner_key,
            control_public_key=CONTROL_PUBLIC,
            workspace_root=workspace_root,
        ),
        workspace_quota_mb=QUOTA_MB,
        call_write_budget_mb=4,
    )
    recorder = Recorder()
    recorder.backend = docker_backend
    runner = make_runner(config, runner_redis, recorder)
    over = command(
        jti="act_01JOVERBUDGET",
        tool="shell.exec",
        args={"script": "head -c 6M /dev/zero > big.bin"},
        prj=PROJECT,
    )
    within = command(
        jti="act_01JWITHINBUDGET",
        tool="shell.exec",
        args={"script": "head -c 3M /dev/zero > small.bin"},
        prj=PROJECT,
    )
    assert runner.handle(over) is Disposition.RAN
    assert runner.handle(within) is Disposition.RAN
    failed, succeeded = reports(recorder, runner_key)
    assert failed.outcome == "failed" and failed.result is None
    assert failed.error["code"] == "write_budget_exceeded"
    assert "4 MiB" in failed.error["message"]
    assert "KESTREL_CALL_WRITE_BUDGET_MB" in failed.error["message"]
    assert succeeded.outcome == "succeeded" and succeeded.result["exit_code"] == 0
    assert (workspace_root / PROJECT / "small.bin").stat().st_size == 3 * MIB
