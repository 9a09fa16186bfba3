"""The single-host embedded broker: a real Redis (Debian's ``redis-server``) as a child of
``serve``, private to the data folder.

It listens on a Unix socket in the data folder's ``run/`` directory (mode 0700, socket mode
0700) and on no TCP port at all (``port 0``), so nothing outside this user can reach it and
two data folders never share one. It persists to an append-only file under ``broker/``
(fsync every second, no snapshots), so queued commands, reports and the runners' call state
survive a restart as they do on a hosted Redis. It gets SIGTERM when ``serve`` stops, and
also when ``serve`` dies without stopping it (``PR_SET_PDEATHSIG``); a pid file lets the next
``serve`` end one that somehow outlived its parent. Why this dependency, and not a Python
package or an in-process stand-in: docs/operations.md#the-embedded-broker.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import redis

from kestrel_one.local.runtime import RuntimePaths, die_with_parent, ensure_private_directory

__all__ = ["REDIS_SERVER", "BrokerNotStarted", "EmbeddedBroker"]

REDIS_SERVER = "redis-server"
# How long a starting redis-server may take to answer (it replays its append-only file first).
START_TIMEOUT_SECONDS = 60
STOP_TIMEOUT_SECONDS = 15


class BrokerNotStarted(Exception):
    """The embedded broker could not be started; the message says why and what to do."""


class EmbeddedBroker:
    """One ``redis-server`` on the data folder's socket; ``start()``, then ``stop()``."""

    def __init__(self, paths: RuntimePaths, *, binary: str | None = None) -> None:
        self.paths = paths
        self.binary = binary or shutil.which(REDIS_SERVER)
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return self.paths.broker_url

    @property
    def label(self) -> str:
        try:
            shown = self.paths.broker_socket.relative_to(self.paths.data_dir.parent)
        except ValueError:
            shown = self.paths.broker_socket
        return f"embedded redis-server on {shown}"

    def argv(self) -> list[str]:
        broker_dir = self.paths.broker_dir
        return [
            str(self.binary),
            "--port", "0",  # no TCP listener at all
            "--unixsocket", str(self.paths.broker_socket),
            "--unixsocketperm", "700",
            "--dir", str(broker_dir),
            "--appendonly", "yes",
            "--appendfsync", "everysec",
            "--save", "",
            "--logfile", "",  # to standard output, which goes to broker/redis.log
            "--loglevel", "warning",
            "--daemonize", "no",
            "--supervised", "no",
        ]  # fmt: skip

    def start(self) -> None:
        if not self.binary:
            raise BrokerNotStarted(
                "redis-server is not installed: `make run` installs it when run as root "
                "(deploy/scripts/ensure-redis.sh), or `apt-get install redis-server`, or set "
                "REDIS_URL to a Redis of your own"
            )
        ensure_private_directory(self.paths.run_dir)
        ensure_private_directory(self.paths.broker_dir)
        self._end_leftover()
        with contextlib.suppress(FileNotFoundError):
            self.paths.broker_socket.unlink()
        log = open(self.paths.broker_dir / "redis.log", "ab")
        try:
            self.process = subprocess.Popen(
                self.argv(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                close_fds=True,
                # Before any thread of serve's is started: preexec_fn is safe then.
                preexec_fn=die_with_parent,
            )
        finally:
            log.close()
        self.paths.broker_pid_file.write_text(f"{self.process.pid}\n")
        self._wait_until_answering()

    def _wait_until_answering(self) -> None:
        client = redis.Redis(
            unix_socket_path=str(self.paths.broker_socket),
            socket_timeout=2,
            socket_connect_timeout=2,
        )
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        try:
            while True:
                if self.process.poll() is not None:
                    raise BrokerNotStarted(
                        f"redis-server exited with status {self.process.returncode}; see "
                        f"{self.paths.broker_dir / 'redis.log'}"
                    )
                try:
                    if client.ping():
                        return
                except redis.RedisError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise BrokerNotStarted(
                        f"redis-server did not answer within {START_TIMEOUT_SECONDS}s; see "
                        f"{self.paths.broker_dir / 'redis.log'}"
                    )
                time.sleep(0.05)
        finally:
            client.close()

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.terminate()  # redis flushes its append-only file and removes the socket
            try:
                process.wait(timeout=STOP_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        with contextlib.suppress(FileNotFoundError):
            self.paths.broker_pid_file.unlink()

    def _end_leftover(self) -> None:
        """End a redis-server a previous ``serve`` of this folder left running.

        Only called while holding the folder's serve lock, so no live ``serve`` owns it; and
        only a process whose command line names this folder's socket is touched.
        """
        try:
            pid = int(self.paths.broker_pid_file.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            return
        if os.fsencode(self.paths.broker_socket) not in cmdline.split(b"\0"):
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
            for _ in range(STOP_TIMEOUT_SECONDS * 10):
                os.kill(pid, 0)
                time.sleep(0.1)
            os.kill(pid, signal.SIGKILL)
