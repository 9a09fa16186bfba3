"""Helpers for tests that start real processes: ports, servers, and stopping what they
started."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests

ROOT = Path(__file__).resolve().parents[1]


def kestrel_containers(client: Any) -> dict[str, str]:
    """Every Kestrel container on the engine: id -> what it is (name, status, labels), so a
    leak names the call, thread or purpose that left it."""
    from runners.sandbox.docker import MANAGED_LABEL

    found = client.containers.list(all=True, filters={"label": f"{MANAGED_LABEL}=true"})
    return {
        container.id: f"{container.name} ({container.status}) {container.labels}"
        for container in found
    }


def at_once(count: int, work: Callable[[int], Any], *, timeout: float = 120) -> list[Any]:
    """Run ``work(0)`` .. ``work(count - 1)`` in ``count`` threads that start together at a
    barrier, each with its own database connection (closed when its work ends): what they
    returned, in the order they finished. An exception in any of them, or one still running
    after ``timeout``, fails the test."""
    from django.db import connection

    start = threading.Barrier(count)
    outcomes: list[Any] = []
    errors: list[BaseException] = []

    def run(number: int) -> None:
        try:
            start.wait(timeout=30)
            outcomes.append(work(number))
        except BaseException as error:  # reported to the main thread below
            errors.append(error)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(n,)) for n in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)
    assert not errors, errors
    assert not any(thread.is_alive() for thread in threads)
    return outcomes


def free_port() -> int:
    """A loopback port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def unmount_workspace_quotas(under: Path) -> int:
    """Unmount every workspace quota filesystem mounted below ``under``; how many.

    A runner unmounts its own when it stops; this is for the ones a test's in-process
    runner, or a runner that was killed, left on a temporary directory about to be removed
    (a mount left there would keep its loop device until the machine restarts).
    """
    prefix = str(Path(under).resolve()) + "/"
    mountpoints = []
    with open("/proc/self/mountinfo") as mounts:
        for line in mounts:
            # The fifth field, with spaces and the like octal-escaped.
            point = line.split()[4].encode().decode("unicode_escape")
            if point.startswith(prefix) and os.path.isdir(Path(point).parent / ".kestrel-quota"):
                mountpoints.append(point)
    for point in sorted(mountpoints, reverse=True):
        subprocess.run(["umount", point], check=False, capture_output=True)
    return len(mountpoints)


def stop(process: subprocess.Popen, *, timeout: float = 30) -> None:
    """Ask a process to stop (SIGTERM), and kill it if it does not within ``timeout``."""
    if process.poll() is None:
        process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def single_host_env(data_dir: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("KESTREL_", "DJANGO_", "DATABASE_URL", "REDIS_URL"))
    }
    env.update(KESTREL_MODE="single-host", KESTREL_DATA_DIR=str(data_dir), **extra)
    env["DJANGO_SETTINGS_MODULE"] = "kestrel_one.settings"
    return env


def manage(env, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


class Server:
    def __init__(self, env, argv: list[str], port: int):
        self.port = port
        # A session of its own, so that stop() can end every process serve started, even one
        # that outlived serve (it would hold the output pipe open and stop() would never end).
        self.process = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    def wait_ready(self, host: str = "127.0.0.1") -> None:
        # Bounded by attempts, not by a clock: a loaded machine may answer the first
        # request slowly, which is not a failure of what these tests check.
        for _ in range(300):
            if self.process.poll() is not None:
                raise AssertionError(f"server exited: {self.process.stdout.read()}")
            try:
                requests.get(f"http://{host}:{self.port}/api/v1/health", timeout=10)
                return
            except requests.RequestException:
                time.sleep(0.2)
        raise AssertionError("server did not become ready")

    def stop(self) -> str:
        """Stop serve as an operator would (SIGTERM); past a minute, kill what is left of it.
        Either way nothing it started is left running."""
        self.process.terminate()
        try:
            output, _ = self.process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self._kill_session()
            output, _ = self.process.communicate()
        self._kill_session()
        return output

    def _kill_session(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
