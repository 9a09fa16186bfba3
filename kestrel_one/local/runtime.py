"""Where a running single-host service keeps its runtime files, and the lock that makes a
data folder one service's.

Everything ``serve`` writes while it runs lives under ``KESTREL_DATA_DIR``, so two services
with different data folders (and ports) on one host never share a file, a socket or a broker:

- ``serve.lock``: held (``flock``) by the running ``serve``; a second ``serve`` on the same
  folder refuses to start and says which process holds it.
- ``run/`` (mode 0700): the embedded broker's socket ``redis.sock`` and its pid file, the web
  server's control socket ``gunicorn.ctl`` and worker heartbeat files, and the warm
  sandboxes' host-side directories ``warm/``.
- ``broker/`` (mode 0700): the embedded broker's append-only file and log.
- ``celerybeat-schedule``: the scheduler's state.

The folder is this user's alone (``data_folder_make_private``): the folder and every
directory in it 0700 (each project's workspace under ``workspaces/`` too; for a root runner
the folder and ``workspaces/`` are 0711, so that the sandbox user reaches its workspace),
every file in it 0600 (``kestrel.sqlite3`` and its ``-wal``/``-shm`` among them). ``serve``
runs with umask 077, so what it and its workers create is private from the start, and at
each start it corrects what is not (a database ``migrate`` made under umask 022, a folder
made 0755) and says what it changed; a folder or file owned by another user is refused.

A Unix socket's path may be at most 107 bytes. When the data folder's path is too long for
the longest socket under ``run/``, ``run/`` moves to ``kestrel-<uid>-<hash of the data
folder>`` in the system's temporary directory (mode 0700, owned by this user, refused
otherwise): still one per data folder, only shorter.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import os
import signal
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DataFolderInUse",
    "RuntimeDirectoryError",
    "RuntimePaths",
    "ServeLock",
    "data_folder_make_private",
    "die_with_parent",
    "ensure_private_directory",
    "runtime_paths",
]

# sun_path holds 108 bytes with the terminating NUL.
SOCKET_PATH_MAX = 107
# The longest socket path below run/: a warm sandbox's agent socket
# (run/warm/warm-<24 hex>/socket/agent.sock, see runners.sandbox.warm).
_LONGEST_SOCKET_TAIL = len("/warm/warm-" + "0" * 24 + "/socket/agent.sock")


class RuntimeDirectoryError(Exception):
    """A runtime directory exists but is not private to this user; the message says why."""


class DataFolderInUse(Exception):
    """Another ``serve`` holds this data folder."""


@dataclass(frozen=True)
class RuntimePaths:
    """The runtime files of the service whose data folder is ``data_dir``."""

    data_dir: Path
    run_dir: Path

    @property
    def lock_file(self) -> Path:
        return self.data_dir / "serve.lock"

    @property
    def broker_dir(self) -> Path:
        return self.data_dir / "broker"

    @property
    def broker_socket(self) -> Path:
        return self.run_dir / "redis.sock"

    @property
    def broker_pid_file(self) -> Path:
        return self.run_dir / "redis.pid"

    @property
    def broker_url(self) -> str:
        """The embedded broker's address as redis-py reads it (runners.contract.broker)."""
        return f"unix://{self.broker_socket}?db=0"

    @property
    def web_control_socket(self) -> Path:
        return self.run_dir / "gunicorn.ctl"

    @property
    def web_worker_tmp_dir(self) -> Path:
        return self.run_dir / "web"

    @property
    def warm_agent_dir(self) -> Path:
        return self.run_dir / "warm"

    @property
    def beat_schedule(self) -> Path:
        return self.data_dir / "celerybeat-schedule"


def runtime_paths(data_dir: Path) -> RuntimePaths:
    """The runtime paths for ``data_dir`` (nothing is created)."""
    data_dir = Path(data_dir)
    run_dir = data_dir / "run"
    if len(os.fsencode(run_dir)) + _LONGEST_SOCKET_TAIL > SOCKET_PATH_MAX:
        tag = hashlib.sha256(os.fsencode(data_dir.resolve())).hexdigest()[:16]
        run_dir = Path(tempfile.gettempdir()) / f"kestrel-{os.geteuid()}-{tag}"
    return RuntimePaths(data_dir=data_dir, run_dir=run_dir)


def ensure_private_directory(path: Path) -> Path:
    """Make ``path`` (mode 0700) or check that it is a directory only this user can enter."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise RuntimeDirectoryError(
            f"{path} must be a directory owned by this user; remove it or set KESTREL_DATA_DIR "
            "to another folder"
        )
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def data_folder_make_private(data_dir: Path) -> list[str]:
    """Make ``data_dir`` readable by this user only; return what was changed, one line each.

    The folder, each directory directly in it and each workspace under ``workspaces/``
    become 0700, each file directly in it 0600 (the database among them); deeper entries are
    behind those. Symbolic links and sockets are left alone (``run/`` is checked apart).

    A root runner runs sandboxed commands as ``SANDBOX_UID``, which opens its own workspace
    (bubblewrap starts as that user): the folder and ``workspaces/`` are then 0711, which
    lets others pass through to a name they know but list or read nothing. Raises
    ``RuntimeDirectoryError`` for an entry this user cannot change (another user's).
    """
    data_dir = Path(data_dir)
    workspaces = data_dir / "workspaces"
    workspaces.mkdir(exist_ok=True)
    passage = 0o711 if os.geteuid() == 0 else 0o700
    entries = [data_dir, *sorted(data_dir.iterdir())]
    if not workspaces.is_symlink():
        entries += sorted(workspaces.iterdir())
    changed = []
    for path in entries:
        info = os.lstat(path)
        if stat.S_ISDIR(info.st_mode):
            private = passage if path in (data_dir, workspaces) else 0o700
        elif stat.S_ISREG(info.st_mode):
            private = 0o600
        else:
            continue
        mode = stat.S_IMODE(info.st_mode)
        if mode & 0o077 == private & 0o077:
            continue
        try:
            os.chmod(path, private, follow_symlinks=False)
        except PermissionError:
            raise RuntimeDirectoryError(
                f"{path} (mode {mode:04o}) belongs to another user, who can read it, and this "
                "user cannot make it private; give the data folder to this user or set "
                "KESTREL_DATA_DIR to another folder"
            ) from None
        changed.append(f"{path} was {mode:04o}, now {private:04o}")
    return changed


class ServeLock:
    """An exclusive ``flock`` on the data folder's ``serve.lock``, held while ``serve`` runs.

    The kernel drops it when the process ends however it ends, so a crashed ``serve`` never
    leaves a folder locked.
    """

    def __init__(self, paths: RuntimePaths) -> None:
        self.path = paths.lock_file
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            if error.errno in (errno.EAGAIN, errno.EACCES):
                raise DataFolderInUse(
                    f"Another `serve` (pid {holder}) is running on the data folder "
                    f"{self.path.parent}. Stop it first, or give this one its own folder "
                    "with KESTREL_DATA_DIR (and its own --port)."
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)
            self._fd = None


_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """For ``Popen(preexec_fn=...)``: the child gets SIGTERM when ``serve`` dies, however it
    dies (Linux ``PR_SET_PDEATHSIG``), so no broker or worker outlives a crashed ``serve``."""
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the line above took effect
        os.kill(os.getpid(), signal.SIGTERM)
