"""What a dead worker process left behind, removed before its call is recovered.

A killed worker leaves its fresh container running and may leave warm containers idle;
recovery and runner start remove them so a lost call has no late effect. A worker killed
during a sandbox probe leaves that probe's container, exited: runner start removes those.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

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
                # v: a throwaway MCP server carries the call's label; no anonymous volume of
                # its image may stay on the host (runners/mcp/session.py covers them anyway).
                container.remove(force=True, v=True)
            except docker.errors.NotFound:
                pass
        return len(containers)
    except (docker.errors.DockerException, requests.exceptions.RequestException) as error:
        log.warning("could not reap containers of call %s: %s", call_id, error)
        return 0
    finally:
        client.close()


# An exited probe container this old is nobody's: its probe ended long ago, and a live
# process removes its own as soon as it has read the exit code.
PROBE_LEFTOVER_AGE = timedelta(minutes=1)


def remove_exited_probe_containers(client, *, older_than: timedelta = PROBE_LEFTOVER_AGE) -> int:
    """Remove probe containers that exited at least ``older_than`` ago; how many.

    The Docker backend removes a probe's container when the probe ends, unless its process
    was killed first: such a container stays, exited, until something removes it.
    """
    removed = 0
    cutoff = datetime.now(UTC) - older_than
    for container in client.containers.list(
        all=True, filters={"label": f"{LABEL_PREFIX}purpose=probe", "status": "exited"}
    ):
        if _finished_at(container) > cutoff:
            continue
        try:
            container.remove(force=True)
            removed += 1
        except docker.errors.NotFound:
            pass
    return removed


def _finished_at(container) -> datetime:
    """When the container exited (the engine gives nanoseconds; microseconds are enough)."""
    stamp = container.attrs["State"]["FinishedAt"].rstrip("Z")
    whole, _, fraction = stamp.partition(".")
    return datetime.fromisoformat(f"{whole}.{(fraction + '000000')[:6]}+00:00")


def remove_stale_warm_containers(runner_id: str) -> int:
    """Remove idle warm containers a previous process of this runner left, and probe
    containers a killed process left (runner start)."""
    try:
        client = docker.from_env()
    except docker.errors.DockerException:
        return 0
    try:
        probes = remove_exited_probe_containers(client)
        if probes:
            log.info("removed %d probe container(s) a killed process left", probes)
        return remove_idle_warm_containers(client, runner_id=runner_id)
    except (docker.errors.DockerException, requests.exceptions.RequestException) as error:
        log.warning("could not remove stale warm containers: %s", error)
        return 0
    finally:
        client.close()
