"""Warm containers' shared state on the runner host: directories, locks and removal.

Each warm container has a host-side directory (its socket, a ``lock`` file, a ``call``
file); a process holds the lock while it uses the container. Everything here works across
the worker processes of one host: finding, locking and removing idle containers, and the
ones a dead worker left serving a call. docs/runners.md ("Warm sandboxes") has the design.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import secrets
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker.errors
import docker.types
import requests.exceptions

from runners.sandbox.base import (
    SandboxUnavailable,
)
from runners.sandbox.docker import LABEL_PREFIX
from runners.workspace import workspace_owner

__all__ = [
    "AGENT_DIR_LABEL",
    "AGENT_ROOT_VARIABLE",
    "WARM_LABEL",
    "agent_root_directory",
    "containers_running_call",
    "remove_idle_thread_containers",
    "remove_idle_warm_containers",
    "warm_container_busy",
]

WARM_LABEL = f"{LABEL_PREFIX}warm"
AGENT_DIR_LABEL = f"{LABEL_PREFIX}agent-dir"
# Where each warm container's host-side directory is made (docs/runners.md).
AGENT_ROOT_VARIABLE = "KESTREL_WARM_AGENT_DIR"
ENGINE_ERRORS = (docker.errors.DockerException, requests.exceptions.RequestException)
_AGENT_DIR_NAME = re.compile(r"warm-[0-9a-f]{24}")
# Host-side directories younger than this may belong to a container being created.
_ORPHAN_AGE_SECONDS = 600

log = logging.getLogger("kestrel.runner")


def agent_root_directory() -> Path:
    """Where warm containers' host-side directories go: ``KESTREL_WARM_AGENT_DIR``, else
    ``kestrel-warm-<uid>`` in the system's temporary directory. Made mode 0700; refused if
    it is not a directory of this user's that only this user can enter."""
    configured = os.environ.get(AGENT_ROOT_VARIABLE, "").strip()
    root = Path(configured or Path(tempfile.gettempdir()) / f"kestrel-warm-{os.geteuid()}")
    try:
        root.mkdir(mode=0o700, parents=bool(configured), exist_ok=True)
        info = os.lstat(root)
    except OSError as error:
        raise SandboxUnavailable(f"warm sandboxes: cannot make {root}: {error}") from None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise SandboxUnavailable(
            f"warm sandboxes: {root} must be a directory owned by this user with mode 0700 "
            f"(set {AGENT_ROOT_VARIABLE} to use another)"
        )
    return root


def make_agent_dir(root: Path) -> Path:
    """A new container's host-side directory: ``lock``, ``call`` and the socket directory
    (handed to the sandbox's user, who runs the agent)."""
    path = root / f"warm-{secrets.token_hex(12)}"
    path.mkdir(mode=0o700)
    for name in ("lock", "call"):
        os.close(os.open(path / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    socket_dir = path / "socket"
    socket_dir.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(socket_dir, *workspace_owner())
    # Mounted read-only at /run/kestrel-adapter: each call's adapter broker socket is linked
    # in for the call's duration (runners.sandbox.warm, runners.adapter_broker).
    (path / "adapter").mkdir(mode=0o755)
    os.chmod(path / "adapter", 0o755)  # noqa: S103 - the sandbox's uid reaches the socket
    return path


def agent_dir_of(container: Any) -> Path | None:
    """The host-side directory a warm container's label names, if it is one of ours: a
    directory (not a link) of this user's, directly in ``agent_root_directory()``.

    A label is only a claim (an image's own labels reach its containers, and the runner
    writes, links and removes inside this directory), so the path is checked on the host."""
    attrs = container.attrs  # a listed (sparse) container has its labels at the top
    labels = attrs.get("Labels") or (attrs.get("Config") or {}).get("Labels") or {}
    label = labels.get(AGENT_DIR_LABEL, "")
    path = Path(label)
    if not path.is_absolute() or not _AGENT_DIR_NAME.fullmatch(path.name):
        return None
    try:
        if path.parent != agent_root_directory():
            return None
        info = os.lstat(path)
    except (OSError, SandboxUnavailable):
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        return None
    return path


def lock_container(agent_dir: Path) -> int | None:
    """Take a warm container's lock without waiting: the open descriptor that holds it, -1
    if the container has no directory (nothing to hold), or None if another holds it."""
    try:
        fd = os.open(agent_dir / "lock", os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return -1
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".new")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(partial, path)


@contextlib.contextmanager
def container_lock(agent_dir: Path | None) -> Iterator[bool]:
    """Hold a warm container's lock while the block runs; yields False if another process
    holds it. A container without its directory has no user: its lock counts as held."""
    fd = lock_container(agent_dir) if agent_dir else -1
    if fd is None:
        yield False
        return
    try:
        yield True
    finally:
        if fd >= 0:
            os.close(fd)  # and with it the lock


def remove_least_recently_used(client: Any, containers: list[Any], *, keep: set[str]) -> str | None:
    """Remove the least recently used idle container among ``containers`` (by when its last
    call ended), none of ``keep``; its id, or None if every one is busy."""

    def last_used(container: Any) -> float:
        agent_dir = agent_dir_of(container)
        try:
            return (agent_dir / "call").stat().st_mtime if agent_dir else 0.0
        except OSError:
            return 0.0

    for container in sorted(containers, key=last_used):
        if container.id in keep:
            continue
        agent_dir = agent_dir_of(container)
        with container_lock(agent_dir) as idle:
            if idle:
                remove_container(client, container.id, agent_dir)
                return container.id
    return None


def warm_container_busy(container: Any) -> bool:
    """Whether a worker process is using this warm container for a call right now."""
    with container_lock(agent_dir_of(container)) as held:
        return not held


def remove_container(client: Any, container_id: str, agent_dir: Path | None) -> None:
    if container_id:
        try:
            client.api.remove_container(container_id, force=True)
        except docker.errors.NotFound:
            pass
        except ENGINE_ERRORS as error:
            log.warning("could not remove warm container %s: %s", container_id[:12], error)
            return  # its directory stays while it may still run; runner start clears both
    if agent_dir is not None:
        shutil.rmtree(agent_dir, ignore_errors=True)


# --- across worker processes ------------------------------------------------------------


def remove_idle_warm_containers(client: Any, *, runner_id: str | None = None) -> int:
    """Remove warm containers not serving a call (a previous runner process left them), and
    host-side directories whose container is gone; how many containers went.

    A container whose lock a live process holds is serving a call and is left alone. A
    worker that died mid-call holds nothing any more, and its agent killed the command when
    the connection dropped, so its container goes too; recovery then finds nothing to reap.
    """
    filters = [f"{WARM_LABEL}=true"]
    if runner_id is not None:
        filters.append(f"{LABEL_PREFIX}runner={runner_id}")
    removed = _remove_idle(client, filters)
    _remove_orphan_directories(client)
    return removed


def remove_idle_thread_containers(
    client: Any, *, project: str, thread: str, runner_id: str | None = None
) -> int:
    """Remove the idle warm containers of one thread, whichever worker process keeps them.

    Found by label (project, thread and, when given, runner), so only that thread's
    containers of that runner are touched. A container whose lock another process holds is
    serving a call and is left alone: the process running it removes it when the call
    checks in (it learns that the thread ended through ``WarmDockerBackend.thread_ended``).
    Call this only after marking the thread ended: a process about to use a container this
    removes then finds the thread ended, under the container's lock, before its command
    starts, and runs the call in a fresh container instead.
    """
    filters = [
        f"{WARM_LABEL}=true",
        f"{LABEL_PREFIX}project={project}",
        f"{LABEL_PREFIX}thread={thread}",
    ]
    if runner_id is not None:
        filters.append(f"{LABEL_PREFIX}runner={runner_id}")
    return _remove_idle(client, filters)


def remove_idle_project_containers(client: Any, *, project: str, runner_id: str) -> int:
    """Remove the idle warm containers of every thread of a deleted project, whichever
    worker process keeps them (as ``remove_idle_thread_containers``). No call of the project
    comes again. A container running a call now is left to finish it; the process running
    it removes it at check-in, having marked it ended (``CallState.mark_project_deleted``)."""
    filters = [
        f"{WARM_LABEL}=true",
        f"{LABEL_PREFIX}project={project}",
        f"{LABEL_PREFIX}runner={runner_id}",
    ]
    return _remove_idle(client, filters)


def _remove_idle(client: Any, filters: list[str]) -> int:
    """Remove the containers with all these labels that no process is using; how many."""
    removed = 0
    for container in client.containers.list(
        all=True, filters={"label": filters}, ignore_removed=True
    ):
        agent_dir = agent_dir_of(container)
        with container_lock(agent_dir) as idle:
            if container.status == "running" and not idle:
                continue
            remove_container(client, container.id, agent_dir)
            removed += 1
    return removed


def _remove_orphan_directories(client: Any) -> None:
    """Host-side directories of containers that no longer exist (an engine that lost them,
    a runner killed between the two removals). Young ones may belong to a container being
    created right now by another process, so they stay."""
    try:
        root = agent_root_directory()
    except SandboxUnavailable:
        return
    in_use = {
        str(path)
        for container in client.containers.list(
            all=True, filters={"label": [f"{WARM_LABEL}=true"]}, ignore_removed=True
        )
        if (path := agent_dir_of(container)) is not None
    }
    young = time.time() - _ORPHAN_AGE_SECONDS
    for entry in root.iterdir():
        if not _AGENT_DIR_NAME.fullmatch(entry.name) or str(entry) in in_use:
            continue
        with contextlib.suppress(OSError):
            if entry.lstat().st_mtime < young:
                shutil.rmtree(entry, ignore_errors=True)


def containers_running_call(client: Any, call_id: str) -> list[Any]:
    """The warm containers serving ``call_id``, or left serving it by a worker that died
    (by the ``call`` file of their host-side directory)."""
    found = []
    for container in client.containers.list(
        filters={"label": [f"{WARM_LABEL}=true"]}, ignore_removed=True
    ):
        agent_dir = agent_dir_of(container)
        if agent_dir is None:
            continue
        try:
            serving = (agent_dir / "call").read_text()
        except OSError:
            continue
        if serving == call_id:
            found.append(container)
    return found
