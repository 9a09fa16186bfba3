"""What a dead worker process left behind, removed before its call is recovered.

A killed worker leaves its fresh container running and may leave warm containers idle;
recovery and runner start remove them so a lost call has no late effect.
"""

from __future__ import annotations

import logging

import docker
import docker.errors
import requests.exceptions

from runners.sandbox.docker import LABEL_PREFIX
from runners.sandbox.warm_host import (
    containers_running_call,
    remove_idle_warm_containers,
)

log = logging.getLogger("kestrel.runner")


def reap_orphan_containers(call_id: str) -> int:
    """Remove every container running ``call_id``; how many there were.

    When a worker is killed a fresh container keeps running, unattended. Recovery removes it
    before it reports the call lost or runs it again, so a lost call has no late effect.
    A fresh container carries the call's label. A warm one is found by the call its host-side
    directory names; its agent already killed the call when the worker's connection dropped,
    and it is usually gone by now, removed as idle when the next worker started.
    """
    try:
        client = docker.from_env()
    except docker.errors.DockerException:
        return 0
    try:
        containers = {
            container.id: container
            for container in client.containers.list(
                all=True, filters={"label": f"{LABEL_PREFIX}call={call_id}"}
            )
        }
        for container in containers_running_call(client, call_id):
            containers.setdefault(container.id, container)
        for container in containers.values():
            try:
                container.remove(force=True)
            except docker.errors.NotFound:
                pass
        return len(containers)
    except (docker.errors.DockerException, requests.exceptions.RequestException) as error:
        log.warning("could not reap containers of call %s: %s", call_id, error)
        return 0
    finally:
        client.close()


def remove_stale_warm_containers(runner_id: str) -> int:
    """Remove idle warm containers a previous process of this runner left (runner start)."""
    try:
        client = docker.from_env()
    except docker.errors.DockerException:
        return 0
    try:
        return remove_idle_warm_containers(client, runner_id=runner_id)
    except (docker.errors.DockerException, requests.exceptions.RequestException) as error:
        log.warning("could not remove stale warm containers: %s", error)
        return 0
    finally:
        client.close()
