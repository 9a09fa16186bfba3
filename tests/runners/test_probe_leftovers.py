"""A worker killed during a sandbox probe leaves the probe's container, exited; the next
runner start removes it, and never a probe that is still running or has only just ended."""

from __future__ import annotations

from datetime import timedelta

import docker.errors
import pytest

from runners.orphans import remove_exited_probe_containers
from runners.sandbox.docker import LABEL_PREFIX, MANAGED_LABEL

pytestmark = pytest.mark.docker

PROBE_LABELS = {MANAGED_LABEL: "true", f"{LABEL_PREFIX}purpose": "probe"}


def test_exited_probe_containers_go_and_live_ones_stay(docker_client, docker_backend):
    image = docker_backend.image_id
    left = docker_client.containers.run(
        image, ["true"], labels=PROBE_LABELS, detach=True, network_mode="none"
    )
    running = docker_client.containers.run(
        image, ["sleep", "60"], labels=PROBE_LABELS, detach=True, network_mode="none"
    )
    try:
        assert left.wait(timeout=60)["StatusCode"] == 0
        # Just exited: the process that ran it may still be reading its exit code.
        assert remove_exited_probe_containers(docker_client) == 0
        left.reload()
        # Past the age, an exited probe is nobody's; a running one is someone's probe.
        assert remove_exited_probe_containers(docker_client, older_than=timedelta(0)) == 1
        with pytest.raises(docker.errors.NotFound):
            left.reload()
        running.reload()
        assert running.status == "running"
    finally:
        for container in (left, running):
            try:
                container.remove(force=True)
            except docker.errors.NotFound:
                pass
