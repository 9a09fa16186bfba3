"""Fixtures for the MCP tests: the managed server images and the tests' custom server image.

The managed images (kestrel/mcp-{filesystem,git,time,python}) are built by
``make images`` (deploy/images/mcp-servers/build.sh), which ``make test`` runs first; the
fixtures only check that they are there, and fail with that instruction when they are not
(a build takes minutes, too long to hide inside a test). The custom image is the tests'
own: built here, FROM kestrel/mcp-python, once per session.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import docker.errors
import pytest

from runners.contract.mcp import MANAGED_SERVERS

SERVERS_DIR = Path(__file__).resolve().parent / "servers"
# The base of custom servers: not a managed server itself (nothing installs it by name).
PYTHON_IMAGE = "kestrel/mcp-python:latest"
CUSTOM_REPOSITORY = "kestrel-test/mcp-custom"
TEST_LABEL = "io.kestrel-test"


def _docker() -> docker.DockerClient:
    try:
        client = docker.from_env()
        client.ping()
    except docker.errors.DockerException as error:
        pytest.fail(
            f"Docker is required for the MCP tests ({error}): run deploy/scripts/ensure-docker.sh",
            pytrace=False,
        )
    return client


def _image_id(client: docker.DockerClient, tag: str) -> str:
    try:
        image = client.images.get(tag)
    except docker.errors.ImageNotFound:
        pytest.fail(
            f"the MCP server image {tag} is missing: run `make images` "
            "(deploy/images/mcp-servers/build.sh builds it locally)",
            pytrace=False,
        )
    return str(image.id)


@pytest.fixture(scope="session")
def managed_mcp_images() -> dict[str, str]:
    """The managed servers' image ids, by MANAGED_SERVERS name (``filesystem``, ``git``,
    ``time``), plus ``python`` (kestrel/mcp-python, the custom servers' base). Fails naming
    ``make images`` when one is missing."""
    client = _docker()
    try:
        ids = {name: _image_id(client, entry["image"]) for name, entry in MANAGED_SERVERS.items()}
        ids["python"] = _image_id(client, PYTHON_IMAGE)
    finally:
        client.close()
    return ids


@pytest.fixture(scope="session")
def custom_mcp_image(
    managed_mcp_images: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """The tests' custom MCP server (tests/mcp/servers/custom_server.py) as a local image.

    Returns ``{"reference": "kestrel-test/mcp-custom@sha256:<id hex>", "image_id":
    "sha256:...", "tag": "kestrel-test/mcp-custom:<session tag>"}``: the reference an admin
    installs (a local image has no registry digest, so its digest is its id), verified by the
    engine through the tag's repository. The tag is this session's own, so a parallel session
    building the same image never moves it away; it is removed at the end (the image stays
    while another tag or a container holds it)."""
    client = _docker()
    context = tmp_path_factory.mktemp("mcp-custom-context")
    for name in ("Dockerfile", "custom_server.py"):
        shutil.copy2(SERVERS_DIR / name, context / name)
    tag = f"{CUSTOM_REPOSITORY}:session-{uuid.uuid4().hex[:12]}"
    try:
        image, _logs = client.images.build(
            path=str(context),
            tag=tag,
            labels={TEST_LABEL: "mcp-custom"},
            pull=False,
            rm=True,
            forcerm=True,
        )
    except (docker.errors.BuildError, docker.errors.APIError) as error:
        client.close()
        pytest.fail(f"building the custom MCP server image failed: {error}", pytrace=False)
    image_id = str(image.id)
    assert image_id.startswith("sha256:")
    yield {
        "reference": f"{CUSTOM_REPOSITORY}@{image_id}",
        "image_id": image_id,
        "tag": tag,
    }
    try:
        client.images.remove(tag, noprune=False)
    except docker.errors.APIError:
        pass  # a server container of a test still holds it; the tag is harmless
    finally:
        client.close()
