"""The runner MCP tests' server image: ``kestrel-test/h1-mcp:latest``, FROM the tool image.

Built once per source (a label carries the digest of this directory's Dockerfile and
server.py): the MCP Python SDK is installed on the host into the build context with
``pip install --target`` (the tool image has no pip) and put on the image's PYTHONPATH.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import docker.errors

IMAGE = "kestrel-test/h1-mcp:latest"
SOURCE_LABEL = "io.kestrel-test.h1-mcp-source"
HERE = Path(__file__).parent
SDK = "mcp==2.3.0"


def _source_digest() -> str:
    hashed = hashlib.sha256(SDK.encode())
    for name in ("Dockerfile", "server.py"):
        hashed.update((HERE / name).read_bytes())
    return hashed.hexdigest()


def build_server_image(client: Any) -> str:
    """The image's id, built if missing or out of date."""
    source = _source_digest()
    try:
        image = client.images.get(IMAGE)
        if (image.labels or {}).get(SOURCE_LABEL) == source:
            return str(image.id)
    except docker.errors.ImageNotFound:
        pass
    context = Path(tempfile.mkdtemp(prefix="kestrel-h1-mcp-"))
    try:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--target",
                str(context / "site"),
                "--only-binary=:all:",
                "--python-version",
                "3.11",
                "--implementation",
                "cp",
                "--platform",
                "manylinux2014_x86_64",
                SDK,
            ],
            check=True,
            capture_output=True,
        )
        for name in ("Dockerfile", "server.py"):
            shutil.copy(HERE / name, context / name)
        image, _logs = client.images.build(
            path=str(context),
            tag=IMAGE,
            labels={SOURCE_LABEL: source, "io.kestrel-test": "h1"},
            rm=True,
        )
        return str(image.id)
    finally:
        shutil.rmtree(context, ignore_errors=True)
