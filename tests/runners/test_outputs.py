"""Declared outputs: files a process tool reads back, link-free and bounded, after it ran."""

from __future__ import annotations

import base64
import hashlib
import os

import pytest

from runners.contract.arguments import MAX_OUTPUT_FILE_BYTES, MAX_OUTPUTS_TOTAL_BYTES
from runners.dispatch import execute
from runners.sandbox import ExecLimits
from runners.tools.processes import collect_outputs

pytestmark = pytest.mark.spec("RUN-6")

FAST = ExecLimits(timeout_s=30, memory_mb=128, cpus=0.5, pids=64, output_kb=64, tmp_mb=8)


def _write(root, path: str, data: bytes) -> None:
    target = root / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)


def test_outputs_come_back_whole_with_size_and_sha256(tmp_path):
    binary = bytes(range(256)) * 8
    _write(tmp_path, "out/report.txt", b"all green\n")
    _write(tmp_path, "out/blob.bin", binary)
    collected = collect_outputs(tmp_path, ["out/report.txt", "out/blob.bin"])
    assert [item["path"] for item in collected] == ["out/report.txt", "out/blob.bin"]
    for item, data in zip(collected, (b"all green\n", binary), strict=True):
        assert base64.b64decode(item["content_b64"]) == data
        assert item["size"] == len(data)
        assert item["sha256"] == hashlib.sha256(data).hexdigest()


def test_missing_links_and_directories_are_reported_not_followed(tmp_path):
    _write(tmp_path, "secret.txt", b"outside the declared file\n")
    os.symlink(tmp_path / "secret.txt", tmp_path / "link.txt")
    os.symlink("/etc", tmp_path / "etc")
    (tmp_path / "dir").mkdir()
    collected = collect_outputs(tmp_path, ["gone.txt", "link.txt", "etc/passwd", "dir"])
    assert collected == [
        {"path": "gone.txt", "error": "not_found"},
        {"path": "link.txt", "error": "path_refused"},
        {"path": "etc/passwd", "error": "path_refused"},
        {"path": "dir", "error": "wrong_file_type"},
    ]


def test_a_file_past_the_per_file_cap_is_too_large_never_cut(tmp_path):
    _write(tmp_path, "exact.bin", b"x" * MAX_OUTPUT_FILE_BYTES)
    _write(tmp_path, "over.bin", b"x" * (MAX_OUTPUT_FILE_BYTES + 1))
    exact, over = collect_outputs(tmp_path, ["exact.bin", "over.bin"])
    assert exact["size"] == MAX_OUTPUT_FILE_BYTES
    assert over == {"path": "over.bin", "error": "too_large"}


def test_files_past_the_total_cap_are_too_large(tmp_path):
    count = MAX_OUTPUTS_TOTAL_BYTES // MAX_OUTPUT_FILE_BYTES
    paths = [f"part{n}.bin" for n in range(count + 2)]
    for path in paths[:-1]:
        _write(tmp_path, path, b"y" * MAX_OUTPUT_FILE_BYTES)
    _write(tmp_path, paths[-1], b"")
    collected = collect_outputs(tmp_path, paths)
    assert all("content_b64" in item for item in collected[:count])
    assert sum(item["size"] for item in collected[:count]) == MAX_OUTPUTS_TOTAL_BYTES
    assert collected[count] == {"path": paths[count], "error": "too_large"}
    # Nothing left of the budget, but an empty file still fits.
    assert collected[-1]["size"] == 0


@pytest.mark.docker
def test_shell_exec_returns_the_file_it_declared(
    docker_backend, docker_client, workspace, call_labels
):
    result = execute(
        "shell.exec",
        {
            "script": "mkdir -p out && printf 'report %s\\n' ok > out/report.txt && exit 3",
            "outputs": ["out/report.txt", "out/missing.txt"],
        },
        workspace=workspace,
        backend=docker_backend,
        limits=FAST,
        labels=call_labels,
    )
    assert result["sandbox"] == "docker"
    # Outputs are read whatever the exit code.
    assert result["exit_code"] == 3
    report, missing = result["outputs"]
    assert base64.b64decode(report["content_b64"]) == b"report ok\n"
    assert report["path"] == "out/report.txt"
    assert report["size"] == 10
    assert report["sha256"] == hashlib.sha256(b"report ok\n").hexdigest()
    assert missing == {"path": "out/missing.txt", "error": "not_found"}


@pytest.mark.docker
def test_without_declared_outputs_the_result_has_no_outputs(
    docker_backend, docker_client, workspace, call_labels
):
    result = execute(
        "code.python",
        {"code": "print(1)"},
        workspace=workspace,
        backend=docker_backend,
        limits=FAST,
        labels=call_labels,
    )
    assert "outputs" not in result
