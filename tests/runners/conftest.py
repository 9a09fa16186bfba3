"""Fixtures for the runner tests: real Docker and bubblewrap backends, real workspaces.

Tests marked ``docker`` need a real engine and the tool image. They are never skipped: the
fixture makes sure both exist (the scripts are idempotent and quick once done) and fails
the test with the reason when it can't.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest
import redis

from runners.sandbox import BubblewrapBackend, DockerBackend, SandboxUnavailable
from runners.sandbox.docker import LABEL_PREFIX
from runners.workspace import workspace_for
from tests.runners.mcp_fixture import build_server_image
from tests.runners.support import RUNNER_REDIS_URL
from tests.support import kestrel_containers, unmount_workspace_quotas


@pytest.fixture
def runner_redis() -> Iterator[redis.Redis]:
    """The runner tests' Redis database, empty before and after the test."""
    client = redis.Redis.from_url(RUNNER_REDIS_URL)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


@pytest.fixture
def docker_client(docker_backend: DockerBackend) -> Iterator[docker.DockerClient]:
    """The engine's client; after the test, no Kestrel container it started may be left
    behind. One that was there before is another test's leak, reported at the end of the
    session (tests/conftest.py), not blamed on every test after it."""
    before = kestrel_containers(docker_backend.client)
    yield docker_backend.client
    after = kestrel_containers(docker_backend.client)
    leftovers = [what for container_id, what in after.items() if container_id not in before]
    assert leftovers == [], f"containers left behind: {leftovers}"


@pytest.fixture(scope="session")
def bwrap_backend() -> BubblewrapBackend:
    try:
        return BubblewrapBackend.from_environment()
    except SandboxUnavailable as error:
        pytest.fail(f"bubblewrap is required for this test: {error}", pytrace=False)


@pytest.fixture
def workspace_root() -> Iterator[Path]:
    """A directory of workspaces that the sandbox user can traverse (tmp_path is 0700)."""
    root = Path(tempfile.mkdtemp(prefix="kestrel-workspaces-"))
    os.chmod(root, 0o755)  # noqa: S103 - the sandbox user must be able to traverse it
    yield root
    unmount_workspace_quotas(root)  # runners of the test mount a quota filesystem per project
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def workspace(workspace_root: Path) -> Path:
    return workspace_for(workspace_root, "prj_test")


@pytest.fixture
def call_labels() -> dict[str, str]:
    return {"call": f"call_{uuid.uuid4().hex}", "project": "prj_test", "thread": "thr_test"}


@pytest.fixture
def project() -> str:
    """A project of this test's own, so its containers can be told from other suites'."""
    return f"prj_t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def runner_id() -> str:
    return f"run_t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def engine(docker_backend: DockerBackend, project: str) -> Iterator[docker.DockerClient]:
    """The engine's client; afterwards no container of this test's project may remain.

    Scoped to the test's own project label: other suites share the engine.
    """
    yield docker_backend.client
    leftovers = docker_backend.client.containers.list(
        all=True, filters={"label": f"{LABEL_PREFIX}project={project}"}
    )
    for container in leftovers:
        container.remove(force=True, v=True)  # and any anonymous volume it had
    assert leftovers == [], f"containers left behind: {[c.name for c in leftovers]}"


@pytest.fixture(scope="module")
def server_image() -> str:
    """The runner tests' MCP server image (tests/runners/mcp_fixture), built when missing."""
    client = docker.from_env()
    try:
        return build_server_image(client)
    finally:
        client.close()
