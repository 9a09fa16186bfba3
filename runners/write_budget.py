"""Each call's write budget inside its workspace's quota filesystem (RUN-3).

A workspace with a quota is an ext4 filesystem of its own (``WorkspaceQuota``). ext4 keeps
an in-memory count of clusters that no allocation may take except the few it must never
fail (splitting an extent on a hole punch): ``s_resv_clusters``, which root may write at
``/sys/fs/ext4/<device>/reserved_clusters``. It is checked by the allocator on every
``write``, ``fallocate`` and ``mkdir``, for root and for everyone else alike (unlike the
superblock's reserved blocks of ``tune2fs -r``, which root and CAP_SYS_RESOURCE bypass and
which outlive a crash on disk), and the mounted filesystem applies a change at once.

So a call gets its budget by raising that reservation until only ``budget`` bytes are left
to allocate, and the kernel refuses the next write with ENOSPC, in the sandbox or in a file
tool, whatever uid writes. The budget bounds how much the call grows the workspace:
deleting files gives the room back. When the call ends, even by an exception, the
reservation goes back to the kernel's own default (or to what the calls still running
need). It is never written to disk: a fresh mount starts from the kernel's default.

Calls of one project can run at the same time (one per worker process). They share one
filesystem, so they share their budgets: each call adds its budget to the room left when
it starts, and when one ends the room left shrinks to at most the budgets of the calls still
running. Calls that overlap therefore grow the workspace by at most the sum of their
budgets. A running call is a file under ``<root>/.kestrel-quota/<prj>.calls/`` holding its
budget, flock'ed by its process; the file of a process that died has no lock, and the next
call of the project removes it and forgets its budget. All of it happens under the
project's lock file (``WorkspaceQuota.locked``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from runners.contract.errors import RunnerError
from runners.workspace import QuotaUnavailable, WorkspaceQuota

__all__ = ["CallWriteBudget", "WriteBudgetExceeded", "room_after_end", "room_after_start"]

MIB = 1024 * 1024
# The allocator leaves nothing over when it refuses a write for want of room (checked with
# head, dd, O_DIRECT, Python, fallocate and many small files); a call that ends with less
# room than this used its budget up.
SPENT_BELOW_BYTES = 64 * 1024

log = logging.getLogger("kestrel.runner")


class WriteBudgetExceeded(RunnerError):
    """The call wrote all its workspace write budget; a write past it was refused."""

    code = "write_budget_exceeded"

    def __init__(self, budget_bytes: int) -> None:
        super().__init__(
            f"the call used up its write budget of {budget_bytes // MIB} MiB "
            "(KESTREL_CALL_WRITE_BUDGET_MB: how much one call may grow its workspace) and a "
            "write past it failed with 'No space left on device'; what it wrote up to the "
            "budget stays in the workspace. Split the work over several calls, delete files "
            "as it goes, or ask the operator for a larger budget"
        )
        self.budget_bytes = budget_bytes


def room_after_start(room: int, others_running: bool, budget: int) -> int:
    """The room (clusters) a starting call leaves: its budget added to what the calls
    still running have left, or its budget alone."""
    return (room if others_running else 0) + budget


def room_after_end(room: int, budgets_running: Sequence[int]) -> int:
    """The room (clusters) left when a call ends: never more than the calls still running
    were given, so an ended call's unused budget goes with it."""
    return min(room, sum(budgets_running))


@dataclass(frozen=True)
class _Filesystem:
    """One mounted quota filesystem, seen through statvfs and its ext4 sysfs knob."""

    workspace: Path
    reserved_clusters: Path
    cluster_bytes: int
    clusters: int

    @property
    def default_reserve(self) -> int:
        # ext4_calculate_resv_clusters: 2% of the clusters, at most 4096 (what a mount sets).
        return min(self.clusters // 50, 4096)

    def room(self) -> int:
        """Clusters a write may still take: free ones less the reserve (statfs f_bavail)."""
        size = os.statvfs(self.workspace)
        return size.f_bavail * size.f_frsize // self.cluster_bytes

    def free(self) -> int:
        size = os.statvfs(self.workspace)
        return size.f_bfree * size.f_frsize // self.cluster_bytes

    def reserve(self) -> int:
        return int(self.reserved_clusters.read_text().strip())

    def set_reserve(self, clusters: int) -> None:
        # The kernel takes any count below the filesystem's size.
        value = max(self.default_reserve, min(clusters, self.clusters - 1))
        self.reserved_clusters.write_text(f"{value}\n")

    def leave_room(self, room: int) -> None:
        """Reserve all but ``room`` clusters of what is free now (never below the default).

        A concurrent write between the statvfs and the sysfs write only takes from the
        room, so it cannot widen it."""
        self.set_reserve(self.free() - room)

    @classmethod
    def of(cls, workspace: Path, image: Path) -> _Filesystem:
        info = os.stat(workspace)
        device = Path(f"/sys/dev/block/{os.major(info.st_dev)}:{os.minor(info.st_dev)}")
        knob = Path("/sys/fs/ext4") / device.resolve().name / "reserved_clusters"
        if not os.path.ismount(workspace) or not knob.is_file():
            raise QuotaUnavailable(
                str(workspace),
                "the call's write budget needs the workspace's quota filesystem mounted "
                f"(no {knob}); nothing ran",
            )
        cluster_bytes, clusters = _superblock_size(image)
        return cls(workspace, knob, cluster_bytes, clusters)


def _superblock_size(image: Path) -> tuple[int, int]:
    """(bytes per cluster, clusters) from the ext4 superblock at offset 1024 of ``image``."""
    with open(image, "rb") as file:
        file.seek(1024)
        block = file.read(1024)
    blocks_lo, log_block, log_cluster, incompat, blocks_hi = (
        struct.unpack_from("<I", block, 0x04)[0],
        struct.unpack_from("<I", block, 0x18)[0],
        struct.unpack_from("<I", block, 0x1C)[0],
        struct.unpack_from("<I", block, 0x60)[0],
        struct.unpack_from("<I", block, 0x150)[0],
    )
    blocks = blocks_lo | ((blocks_hi << 32) if incompat & 0x80 else 0)  # INCOMPAT_64BIT
    block_bytes = 1024 << log_block
    cluster_bytes = 1024 << log_cluster
    return cluster_bytes, blocks // (cluster_bytes // block_bytes)


class CallWriteBudget:
    """One call's write budget on its project's quota filesystem (context manager).

    Entering registers the call and sets the reservation; leaving, however the call ended,
    unregisters it and sets the reservation back, and says in ``exceeded`` whether the call
    used its budget up while the quota still had room (a full quota is ``workspace_full``,
    not this), and in ``bounded`` whether the budget was the tighter bound (a file tool
    whose write did not fit removes what it wrote, so it never looks spent). A budget of 0
    does nothing.
    """

    def __init__(self, workspace: Path, budget_bytes: int) -> None:
        self.workspace = Path(workspace)
        self.budget_bytes = budget_bytes
        self.quota = WorkspaceQuota(self.workspace.parent)
        self.project_id = self.workspace.name
        # Whether the budget, not the quota, was what bounded the call when it ended, and
        # whether it used it up then.
        self.bounded = False
        self.exceeded = False
        self._filesystem: _Filesystem | None = None
        self._entry: Path | None = None
        self._entry_fd: int | None = None

    @property
    def calls_folder(self) -> Path:
        return self.quota.calls_folder(self.project_id)

    def __enter__(self) -> CallWriteBudget:
        if self.budget_bytes <= 0:
            return self
        filesystem = _Filesystem.of(self.workspace, self.quota.image(self.project_id))
        budget = -(-self.budget_bytes // filesystem.cluster_bytes)
        with self.quota.locked(self.project_id):
            running = self._running_budgets()
            self._register(budget)
            try:
                filesystem.leave_room(room_after_start(filesystem.room(), bool(running), budget))
            except OSError as failure:
                self._unregister()
                self._close_entry()
                raise QuotaUnavailable(
                    str(self.workspace), f"the call's write budget could not be set ({failure})"
                ) from None
        self._filesystem = filesystem
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        filesystem = self._filesystem
        if filesystem is None:
            return
        self._filesystem = None
        try:
            with self.quota.locked(self.project_id):
                self._unregister()
                spent = filesystem.room() * filesystem.cluster_bytes < SPENT_BELOW_BYTES
                self.bounded = filesystem.reserve() > filesystem.default_reserve
                self.exceeded = spent and self.bounded
                running = self._running_budgets()
                if running:
                    filesystem.leave_room(room_after_end(filesystem.room(), running))
                else:
                    filesystem.set_reserve(filesystem.default_reserve)
        except OSError as failure:
            # The call has run; its result is kept. The next call of the project sets the
            # reservation again from the calls then running, and a mount resets it.
            log.error(
                "could not restore the write budget reservation of %s: %s",
                self.project_id,
                failure,
            )
        finally:
            self._close_entry()

    # --- the running calls of the project (under its lock) ----------------------------

    def _register(self, budget: int) -> None:
        self.calls_folder.mkdir(mode=0o700, exist_ok=True)
        entry = self.calls_folder / f"{os.getpid()}-{secrets.token_hex(8)}"
        fd = os.open(entry, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, str(budget).encode())
        self._entry, self._entry_fd = entry, fd

    def _close_entry(self) -> None:
        if self._entry_fd is not None:
            os.close(self._entry_fd)
            self._entry_fd = None

    def _unregister(self) -> None:
        if self._entry is not None:
            with contextlib.suppress(FileNotFoundError):
                self._entry.unlink()
            self._entry = None

    def _running_budgets(self) -> list[int]:
        """The budgets (clusters) of the project's other calls still running; the entries of
        calls whose process died (nobody holds their lock) are removed."""
        budgets = []
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.calls_folder):
                try:
                    fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    continue
                try:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except OSError as held:
                        if held.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
                            raise
                        budgets.append(int(os.read(fd, 32) or b"0"))
                    else:
                        os.unlink(entry.path)
                finally:
                    os.close(fd)
        return budgets
