"""What a workspace may cost the runner host: a quota filesystem per project, reads bounded,
and removal of a deleted project's workspace (RUN-3)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from runners.dispatch import execute
from runners.sandbox import BubblewrapBackend, DockerBackend, ExecLimits
from runners.workspace import (
    FileTooLarge,
    Workspace,
    WorkspaceFull,
    WorkspaceQuota,
    workspace_for,
    workspace_remove,
)

pytestmark = pytest.mark.spec("RUN-3")

QUOTA_MB = 16
FAST = ExecLimits(timeout_s=30, memory_mb=256, cpus=1, pids=64, output_kb=64, tmp_mb=8)


@pytest.fixture
def quota_workspace(workspace_root: Path):
    """A project's workspace on its own 16 MiB filesystem, unmounted afterwards."""
    workspace = workspace_for(workspace_root, "prj_quota", quota_mb=QUOTA_MB)
    yield workspace
    WorkspaceQuota(workspace_root).unmount_all()


def allocated_bytes(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def test_a_workspace_with_a_quota_is_its_own_filesystem_of_that_size(quota_workspace):
    assert os.path.ismount(quota_workspace)
    size = os.statvfs(quota_workspace)
    assert size.f_blocks * size.f_frsize <= QUOTA_MB * 1024 * 1024
    assert os.listdir(quota_workspace) == []  # no lost+found of mkfs's
    # The second call finds it mounted, and a fresh process mounts it again.
    assert workspace_for(quota_workspace.parent, "prj_quota", quota_mb=QUOTA_MB) == quota_workspace


def test_fallocate_in_a_workspace_stops_at_the_quota_not_at_the_host_disk(quota_workspace):
    """``fallocate -l 5G`` grew the host's disk by 5 GB; in a quota workspace it fails, and
    the image on the host holds no more than the quota."""
    done = subprocess.run(
        ["fallocate", "-l", "5G", str(quota_workspace / "big")], capture_output=True, text=True
    )
    assert done.returncode != 0 and "No space left" in done.stderr
    image = WorkspaceQuota(quota_workspace.parent).image("prj_quota")
    assert allocated_bytes(image) <= QUOTA_MB * 1024 * 1024


@pytest.mark.docker
def test_a_command_in_docker_cannot_write_past_the_quota(
    quota_workspace, docker_backend: DockerBackend, call_labels
):
    result = execute(
        "shell.exec",
        {"script": "fallocate -l 5G big || echo refused; head -c 32M /dev/zero > zeros; df -k ."},
        workspace=quota_workspace,
        backend=docker_backend,
        limits=FAST,
        labels={**call_labels, "project": "prj_quota"},
    )
    assert "refused" in result["stdout"]
    assert "No space left" in result["stderr"]
    image = WorkspaceQuota(quota_workspace.parent).image("prj_quota")
    assert allocated_bytes(image) <= QUOTA_MB * 1024 * 1024


def test_a_command_in_bubblewrap_cannot_write_past_the_quota(
    quota_workspace, bwrap_backend: BubblewrapBackend, call_labels
):
    result = execute(
        "shell.exec",
        {"script": "fallocate -l 5G big || echo refused; head -c 32M /dev/zero > zeros"},
        workspace=quota_workspace,
        backend=bwrap_backend,
        limits=FAST,
        labels=call_labels,
    )
    assert "refused" in result["stdout"]
    assert "No space left" in result["stderr"]
    image = WorkspaceQuota(quota_workspace.parent).image("prj_quota")
    assert allocated_bytes(image) <= QUOTA_MB * 1024 * 1024


def test_a_file_tool_write_past_the_quota_is_a_clear_error_and_leaves_nothing(quota_workspace):
    with pytest.raises(WorkspaceFull) as full:
        Workspace(quota_workspace).write("big.bin", b"x" * (QUOTA_MB * 1024 * 1024))
    assert full.value.code == "workspace_full"
    assert "KESTREL_WORKSPACE_QUOTA_MB" in str(full.value)
    assert os.listdir(quota_workspace) == []  # the temporary file is gone too


def test_files_of_a_workspace_that_had_no_quota_move_into_it(workspace_root: Path):
    before = workspace_for(workspace_root, "prj_moving")
    (before / "src").mkdir()
    (before / "src" / "main.py").write_text("print(1)\n")
    try:
        after = workspace_for(workspace_root, "prj_moving", quota_mb=QUOTA_MB)
        assert os.path.ismount(after)
        assert (after / "src" / "main.py").read_text() == "print(1)\n"
    finally:
        WorkspaceQuota(workspace_root).unmount_all()
    assert os.listdir(before) == []  # nothing is left hidden under the mount


def test_a_read_of_a_file_too_large_to_hash_is_refused_from_its_size(workspace: Path):
    """An 8 GB sparse file took 32 s to hash; it is refused before a byte is read, with the
    limit and the way to read part of it in the message."""
    with open(workspace / "sparse.bin", "wb") as sparse:
        sparse.truncate(8 * 1024**3)
    with pytest.raises(FileTooLarge) as refused:
        execute(
            "fs.read",
            {"path": "sparse.bin"},
            workspace=workspace,
            backend=None,
            limits=FAST,
            labels={},
        )
    assert refused.value.code == "too_large"
    message = str(refused.value)
    assert str(8 * 1024**3) in message and "KESTREL_READ_MAX_FILE_BYTES" in message
    # Below the limit, a read still returns the size and hash of the whole file.
    (workspace / "small.bin").write_bytes(b"abc" * 1000)
    read = Workspace(workspace).read("small.bin", max_bytes=10, max_file_bytes=3000)
    assert (read.size, read.truncated) == (3000, True)


def test_removing_a_workspace_removes_its_files_mount_and_image(workspace_root: Path):
    workspace = workspace_for(workspace_root, "prj_gone", quota_mb=QUOTA_MB)
    (workspace / "file.txt").write_text("data")
    os.symlink("/etc", workspace / "etc-link")
    image = WorkspaceQuota(workspace_root).image("prj_gone")
    assert image.exists()
    assert workspace_remove(workspace_root, "prj_gone") is True
    assert not os.path.lexists(workspace) and not image.exists()
    assert os.path.exists("/etc/passwd")  # the link was removed, not followed
    assert workspace_remove(workspace_root, "prj_gone") is False
