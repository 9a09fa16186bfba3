"""Probe before each command, fail closed, never retry unsandboxed (RUN-5)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from runners.dispatch import execute
from runners.sandbox import (
    BubblewrapBackend,
    DockerBackend,
    ExecLimits,
    ExecResult,
    ExecSpec,
    SandboxBackend,
    SandboxStartFailed,
    SandboxUnavailable,
    select_backend,
)

pytestmark = pytest.mark.spec("RUN-5")

MISSING_IMAGE = "sha256:" + "0" * 64


class HostProcessBackend(SandboxBackend):
    """A "backend" that confines nothing: what the probe exists to catch."""

    name = "host-process"

    def __init__(self) -> None:
        self.runs: list[tuple[str, ...]] = []

    def run(self, spec: ExecSpec) -> ExecResult:
        self.runs.append(spec.argv)
        started = time.monotonic()
        completed = subprocess.run(
            spec.argv, cwd=spec.workspace, capture_output=True, text=True, check=False
        )
        return ExecResult(
            exit_code=completed.returncode,
            stdout=completed.stdout,
            stderr=completed.stderr,
            truncated=False,
            duration_ms=int((time.monotonic() - started) * 1000),
            timed_out=False,
            oom_killed=False,
            sandbox=self.name,
        )


class ImageRemovedAfterProbe(DockerBackend):
    """Docker whose image disappears between the probe and the command."""

    def probe(self, workspace: Path):
        result = super().probe(workspace)
        self.image_id = MISSING_IMAGE
        return result


class BrokenAfterProbe(BubblewrapBackend):
    """bubblewrap whose binary disappears between the probe and the command."""

    def probe(self, workspace: Path):
        result = super().probe(workspace)
        self.bwrap = "/nonexistent/bwrap"
        return result


def _shell(backend, workspace, script, labels=None):
    return execute(
        "shell.exec",
        {"script": script},
        workspace=workspace,
        backend=backend,
        limits=ExecLimits(timeout_s=30, memory_mb=64, cpus=0.5, pids=32),
        labels=labels or {},
    )


@pytest.mark.docker
def test_docker_passes_the_probe(docker_backend, docker_client, workspace):
    probe = docker_backend.probe(workspace)
    assert probe.ok, probe.detail
    assert (probe.workspace_writable, probe.sibling_writable) == (True, False)
    assert sorted(p.name for p in workspace.parent.iterdir()) == ["prj_test"]  # cleaned up
    assert list(workspace.iterdir()) == []


def test_bubblewrap_passes_the_probe(bwrap_backend, workspace):
    probe = bwrap_backend.probe(workspace)
    assert probe.ok, probe.detail
    assert sorted(p.name for p in workspace.parent.iterdir()) == ["prj_test"]
    assert list(workspace.iterdir()) == []


def test_an_unconfined_backend_fails_the_probe_and_the_command_never_runs(workspace):
    backend = HostProcessBackend()
    probe = backend.probe(workspace)
    assert probe.sibling_writable is True
    assert not probe.ok
    backend.runs.clear()
    with pytest.raises(SandboxUnavailable, match="failed its probe"):
        _shell(backend, workspace, "touch ran")
    assert not (workspace / "ran").exists()
    assert [argv[3] for argv in backend.runs] == ["probe"]  # and nothing after it


@pytest.mark.docker
def test_docker_failing_to_start_after_the_probe_is_not_retried(
    docker_backend, docker_client, workspace
):
    backend = ImageRemovedAfterProbe(docker_backend.image_id, client=docker_backend.client)
    with pytest.raises(SandboxStartFailed, match="docker"):
        _shell(backend, workspace, "touch ran")
    assert not (workspace / "ran").exists()


def test_bubblewrap_failing_to_start_after_the_probe_is_not_retried(bwrap_backend, workspace):
    backend = BrokenAfterProbe(bwrap=bwrap_backend.bwrap, prlimit=bwrap_backend.prlimit)
    with pytest.raises(SandboxStartFailed, match="bubblewrap"):
        _shell(backend, workspace, "touch ran")
    assert not (workspace / "ran").exists()


def test_commands_without_a_backend_fail_closed(workspace):
    with pytest.raises(SandboxUnavailable, match="never run without one"):
        _shell(None, workspace, "touch ran")
    assert not (workspace / "ran").exists()


def _unavailable(reason):
    def factory():
        raise SandboxUnavailable(reason)

    return factory


def test_with_no_working_backend_selection_fails_closed_and_says_why():
    factories = {
        "docker": _unavailable("docker: no engine"),
        "bubblewrap": _unavailable("bubblewrap: no bwrap"),
    }
    with pytest.raises(SandboxUnavailable) as raised:
        select_backend("auto", factories=factories)
    assert "no sandbox backend works" in str(raised.value)
    assert "docker: no engine" in str(raised.value)
    assert "bubblewrap: no bwrap" in str(raised.value)


def test_auto_prefers_docker_then_falls_back_to_bubblewrap(bwrap_backend):
    fallback = {"docker": _unavailable("docker: no engine"), "bubblewrap": lambda: bwrap_backend}
    assert select_backend("auto", factories=fallback) is bwrap_backend
    marker = HostProcessBackend()
    both = {"docker": lambda: marker, "bubblewrap": lambda: bwrap_backend}
    assert select_backend("auto", factories=both) is marker


def test_a_named_backend_never_falls_back(bwrap_backend):
    factories = {"docker": _unavailable("docker: no engine"), "bubblewrap": lambda: bwrap_backend}
    with pytest.raises(SandboxUnavailable, match="docker: no engine"):
        select_backend("docker", factories=factories)
    with pytest.raises(SandboxUnavailable, match="unknown sandbox backend"):
        select_backend("none", factories=factories)


def test_missing_tools_make_backends_unavailable(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxUnavailable, match="bwrap is not installed"):
        BubblewrapBackend.from_environment()
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    with pytest.raises(SandboxUnavailable, match="no engine answers"):
        DockerBackend.from_environment()


@pytest.mark.docker
def test_tool_images_must_be_pinned_by_id(docker_backend):
    with pytest.raises(ValueError, match="pinned by id"):
        DockerBackend("kestrel/tool-runtime:latest", client=docker_backend.client)
