"""Workspace paths that cannot leave the workspace (RUN-6).

File tools run on the runner host, outside any container, so the path handling here is the
whole boundary. Every path is walked one component at a time with ``openat`` and
``O_NOFOLLOW``, relative to a directory descriptor that is already known to be inside
the workspace: a symbolic link anywhere on the path (pointing out, pointing in, or
dangling) is refused rather than followed, and a rename that races the walk cannot redirect
it, because no step ever resolves a path string from the root again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import secrets
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator, MutableSequence, Sequence
from dataclasses import dataclass
from pathlib import Path

from runners.contract.errors import PathRefused, WorkspaceError
from runners.contract.paths import split_relative_path
from runners.contract.toolspec import DEFAULT_READ_MAX_FILE_BYTES

# The unprivileged user that owns workspaces and runs sandboxed commands. The tool image
# creates it (deploy/images/tool-runtime/build.sh); a root runner chowns what it creates to
# it so commands in the sandbox can change every file the file tools wrote.
SANDBOX_UID = 10001
SANDBOX_GID = 10001

_PROJECT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_TEMP_PREFIX = ".kestrel-tmp-"
_HASH_CHUNK = 1024 * 1024


class PathNotFound(WorkspaceError):
    """Nothing exists at the path."""

    code = "path_not_found"


class FileTooLarge(WorkspaceError):
    """The file is larger than the caller may take whole."""

    code = "too_large"


class WrongFileType(WorkspaceError):
    """The path exists but is not the kind of file the operation needs."""

    code = "wrong_file_type"


def workspace_owner() -> tuple[int, int]:
    """The uid and gid that sandboxed commands run as and that workspace files belong to.

    A runner running as root hands everything to ``SANDBOX_UID``; an unprivileged runner
    cannot chown, so its commands run as itself and the files stay its own.
    """
    if os.geteuid() == 0:
        return SANDBOX_UID, SANDBOX_GID
    return os.getuid(), os.getgid()


def workspace_for(root: Path, project_id: str, *, quota_mb: int = 0) -> Path:
    """The workspace directory of one project under ``root``, created if missing.

    The id becomes a single directory name, so it must be a plain identifier. The directory
    is owned by the sandbox user and never a symbolic link. With ``quota_mb`` it is its own
    filesystem of that size (``WorkspaceQuota``), mounted here before it is returned, so
    nothing written into it, by a file tool or by a sandboxed command, can take more.
    """
    if not isinstance(project_id, str) or not _PROJECT_ID.fullmatch(project_id):
        raise PathRefused(str(project_id), "a project id is letters, digits, '_' and '-'")
    root = Path(root).resolve(strict=True)
    workspace = root / project_id
    with contextlib.suppress(FileExistsError):
        os.mkdir(workspace, 0o700)
    if workspace.is_symlink() or not workspace.is_dir():
        raise PathRefused(str(workspace), "the workspace must be a real directory")
    if quota_mb:
        WorkspaceQuota(root).mount(project_id, quota_mb)
    if workspace.stat().st_mode & 0o077:
        os.chmod(workspace, 0o700)  # a project's files are for its sandbox only
    uid, gid = workspace_owner()
    if os.geteuid() == 0:
        os.chown(workspace, uid, gid, follow_symlinks=False)
    return workspace


def workspace_remove(root: Path, project_id: str) -> bool:
    """Remove a project's workspace: its files, its quota filesystem and image; whether
    there was one. Links inside are removed, never followed (``shutil.rmtree`` on a
    directory descriptor walk)."""
    if not isinstance(project_id, str) or not _PROJECT_ID.fullmatch(project_id):
        raise PathRefused(str(project_id), "a project id is letters, digits, '_' and '-'")
    root = Path(root).resolve(strict=True)
    workspace = root / project_id
    quota = WorkspaceQuota(root)
    with quota.locked(project_id):
        existed = os.path.lexists(workspace)
        if os.path.ismount(workspace):
            quota.unmount(workspace)
        if workspace.is_symlink():
            workspace.unlink()
        elif workspace.is_dir():
            shutil.rmtree(workspace)
        image = quota.image(project_id)
        existed = existed or image.exists()
        with contextlib.suppress(FileNotFoundError):
            image.unlink()
        # No call of a deleted project comes again (the control plane refuses them).
        shutil.rmtree(quota.calls_folder(project_id), ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            quota.lock_file(project_id).unlink()
    return existed


def workspace_projects(root: Path) -> list[str]:
    """The ids of the projects that have a workspace under ``root``, sorted: a directory
    named by the id, or a quota filesystem image left without one. Nothing is followed or
    opened; names that are no project id (the quota folder, temporary files) are skipped."""
    root = Path(root)
    projects = {
        entry.name
        for entry in os.scandir(root)
        if _PROJECT_ID.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)
    }
    quota = WorkspaceQuota(root)
    if quota.folder.is_dir():
        projects.update(
            image.stem for image in quota.folder.glob("*.img") if _PROJECT_ID.fullmatch(image.stem)
        )
    return sorted(projects)


class WorkspaceFull(WorkspaceError):
    """The workspace's filesystem has no room left (its quota)."""

    code = "workspace_full"


class QuotaUnavailable(WorkspaceError):
    """The workspace's quota filesystem could not be made or mounted; nothing ran."""

    code = "workspace_unavailable"


class WorkspaceQuota:
    """Each project's workspace as a filesystem of fixed size (RUN-3).

    A sparse ext4 image per project, ``<root>/.kestrel-quota/<prj>.img`` (mode 0600, the
    directory 0700), loop-mounted ``nosuid,nodev`` on ``<root>/<prj>``. The bound is the
    kernel's: ``fallocate -l 5G`` in a sandbox fails with ENOSPC at the quota instead of
    filling the host's disk, and the Docker and bubblewrap backends bind the mounted
    workspace as they would a directory. An image costs its journal (4 MiB) and what is
    written in it. Needs a root runner (mount); a per-project lock makes the mount safe
    between worker processes. Mounts live as long as the runner: ``unmount_all`` at its
    shutdown, mounted again on first use.
    """

    DIRECTORY = ".kestrel-quota"

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.folder = self.root / self.DIRECTORY

    def image(self, project_id: str) -> Path:
        return self.folder / f"{project_id}.img"

    def lock_file(self, project_id: str) -> Path:
        return self.folder / f"{project_id}.lock"

    def calls_folder(self, project_id: str) -> Path:
        """Where the project's running calls keep their write budgets (runners.write_budget)."""
        return self.folder / f"{project_id}.calls"

    @contextlib.contextmanager
    def locked(self, project_id: str) -> Iterator[None]:
        self.folder.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(self.lock_file(project_id), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def mount(self, project_id: str, quota_mb: int) -> None:
        """Mount the project's quota filesystem on its workspace, made first if missing.

        Files already in a workspace that had no quota are moved into the new filesystem
        first; if they do not fit, nothing changes and the call is refused.
        """
        workspace = self.root / project_id
        if os.path.ismount(workspace):
            return
        with self.locked(project_id):
            if os.path.ismount(workspace):
                return
            image = self.image(project_id)
            if not image.exists():
                self._make(image, quota_mb)
            if any(os.scandir(workspace)):
                self._move_in(workspace, image)
            self._run(["mount", "-o", "loop,nosuid,nodev", str(image), str(workspace)])
            # mkfs's own lost+found is no file of the project's.
            with contextlib.suppress(OSError):
                os.rmdir(workspace / "lost+found")

    def unmount(self, workspace: Path) -> None:
        self._run(["umount", str(workspace)])

    def unmount_all(self) -> int:
        """Unmount every quota filesystem mounted under the root; how many."""
        if not self.folder.is_dir():
            return 0
        count = 0
        for image in self.folder.glob("*.img"):
            workspace = self.root / image.stem
            if os.path.ismount(workspace):
                with contextlib.suppress(QuotaUnavailable):
                    self.unmount(workspace)
                    count += 1
        return count

    def _make(self, image: Path, quota_mb: int) -> None:
        uid, gid = workspace_owner()
        fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, quota_mb * 1024 * 1024)
        finally:
            os.close(fd)
        try:
            self._run(
                [
                    "mkfs.ext4",
                    "-q",
                    "-F",
                    "-m",
                    "0",
                    "-J",
                    "size=4",
                    "-E",
                    f"root_owner={uid}:{gid},nodiscard",
                    str(image),
                ]
            )
        except QuotaUnavailable:
            image.unlink()
            raise

    def _move_in(self, workspace: Path, image: Path) -> None:
        staging = Path(tempfile.mkdtemp(prefix="mount-", dir=self.folder))
        try:
            self._run(["mount", "-o", "loop,nosuid,nodev", str(image), str(staging)])
            try:
                self._run(["cp", "-a", "--", f"{workspace}/.", str(staging)])
            finally:
                self._run(["umount", str(staging)])
        finally:
            staging.rmdir()
        for entry in os.scandir(workspace):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)

    @staticmethod
    def _run(argv: list[str]) -> None:
        try:
            subprocess.run(argv, check=True, capture_output=True, timeout=60)
        except (OSError, subprocess.SubprocessError) as error:
            detail = getattr(error, "stderr", b"") or b""
            raise QuotaUnavailable(
                argv[-1],
                f"the workspace quota filesystem could not be set up ({argv[0]}: "
                f"{detail.decode(errors='replace').strip()[:300] or error}); a quota needs a "
                "root runner with mkfs.ext4 and loop devices, or KESTREL_WORKSPACE_QUOTA_MB=0",
            ) from None


@dataclass(frozen=True)
class FileContent:
    """The first bytes of a file, with the size and hash of the whole file."""

    data: bytes
    size: int
    sha256: str
    truncated: bool


@dataclass(frozen=True)
class FileDigest:
    """The size and hash of a file just written."""

    size: int
    sha256: str


@dataclass(frozen=True)
class DirectoryEntry:
    """One name in a directory listing, described without following links."""

    name: str
    type: str  # "file", "dir", "symlink" or "other"
    size: int


class Workspace:
    """File operations confined to one workspace directory."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        if self.root.is_symlink() or not self.root.is_dir():
            raise PathRefused(str(root), "the workspace must be a real directory")

    def read(
        self, path: str, *, max_bytes: int, max_file_bytes: int = DEFAULT_READ_MAX_FILE_BYTES
    ) -> FileContent:
        """Up to ``max_bytes`` of the regular file at ``path``, with the size and SHA-256 of
        all of it; ``FileTooLarge`` for a file over ``max_file_bytes``, refused from its size
        before anything is read (a sparse file of 8 GB took 32 s to hash), and again if it
        grows past it while being hashed."""
        *parents, name = _components_of_file(path)
        with self._directory(path, parents) as dir_fd:
            fd = self._open_leaf(path, name, dir_fd, os.O_RDONLY | os.O_NONBLOCK)
            try:
                info = os.fstat(fd)
                _require_regular(path, info)
                if info.st_size > max_file_bytes:
                    raise _read_too_large(path, info.st_size, max_file_bytes)
            except WorkspaceError:
                os.close(fd)
                raise
            with os.fdopen(fd, "rb") as file:
                digest = hashlib.sha256()
                data = file.read(max_bytes)
                digest.update(data)
                size = len(data)
                while size <= max_file_bytes and (chunk := file.read(_HASH_CHUNK)):
                    digest.update(chunk)
                    size += len(chunk)
        if size > max_file_bytes:
            raise _read_too_large(path, size, max_file_bytes)
        return FileContent(
            data=data, size=size, sha256=digest.hexdigest(), truncated=size > len(data)
        )

    def read_whole(self, path: str, *, max_bytes: int) -> bytes:
        """All of the regular file at ``path``, or ``FileTooLarge`` past ``max_bytes``.

        Unlike ``read``, nothing past the cap is read or hashed: a command may leave a file
        of any size behind, and returning its outputs must not cost the runner more than
        the cap. The size is checked before reading and again by reading one byte more, in
        case the file grows meanwhile.
        """
        *parents, name = _components_of_file(path)
        with self._directory(path, parents) as dir_fd:
            fd = self._open_leaf(path, name, dir_fd, os.O_RDONLY | os.O_NONBLOCK)
            try:
                info = os.fstat(fd)
                _require_regular(path, info)
                if info.st_size > max_bytes:
                    raise FileTooLarge(path, f"is larger than {max_bytes} bytes")
            except WorkspaceError:
                os.close(fd)
                raise
            with os.fdopen(fd, "rb") as file:
                data = file.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise FileTooLarge(path, f"is larger than {max_bytes} bytes")
        return data

    def write(self, path: str, data: bytes) -> FileDigest:
        """Create or atomically replace the regular file at ``path``; parents are created.

        The new content goes to a temporary file in the same directory and is renamed over
        the target, so a reader sees the old file or the new one, never half of it.
        """
        *parents, name = _components_of_file(path)
        with self._directory(path, parents, create=True) as dir_fd:
            _require_replaceable(path, name, dir_fd)
            temp_name = _write_temporary(path, dir_fd, data)
            try:
                os.replace(temp_name, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(temp_name, dir_fd=dir_fd)
                raise
        return FileDigest(size=len(data), sha256=hashlib.sha256(data).hexdigest())

    def write_all(self, directories: Sequence[str], files: Sequence[tuple[str, bytes]]) -> int:
        """Create ``directories`` and write ``files``, all of them or none; bytes written.

        Every file is first written to a temporary file beside its target (the directories
        it needs created on the way); only when all of them are written, which is where a
        link in the way, a file where a directory must be or a full disk shows, are they
        renamed into place. On any failure the temporary files and the directories this call
        created are removed again and the workspace is as it was.
        """
        created: list[str] = []
        staged: list[tuple[str, str]] = []  # (target path, temporary name beside it)
        try:
            for directory in directories:
                with self._directory(
                    directory, split_relative_path(directory), create=True, created=created
                ):
                    pass
            for path, data in files:
                *parents, name = _components_of_file(path)
                with self._directory(path, parents, create=True, created=created) as dir_fd:
                    _require_replaceable(path, name, dir_fd)
                    staged.append((path, _write_temporary(path, dir_fd, data)))
            for path, temp_name in staged:
                *parents, name = _components_of_file(path)
                with self._directory(path, parents) as dir_fd:
                    _require_replaceable(path, name, dir_fd)
                    os.replace(temp_name, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            staged = []
        except BaseException:
            for path, temp_name in staged:
                *parents, _ = _components_of_file(path)
                with contextlib.suppress(OSError, WorkspaceError):
                    with self._directory(path, parents) as dir_fd:
                        os.unlink(temp_name, dir_fd=dir_fd)
            for directory in reversed(created):
                *parents, name = split_relative_path(directory)
                with contextlib.suppress(OSError, WorkspaceError):
                    with self._directory(directory, parents) as dir_fd:
                        os.rmdir(name, dir_fd=dir_fd)
            raise
        return sum(len(data) for _, data in files)

    def list(self, path: str, *, max_entries: int) -> tuple[list[DirectoryEntry], bool]:
        """The entries of the directory at ``path`` sorted by name, and whether cut short."""
        parts = split_relative_path(path)
        with self._directory(path, parts) as dir_fd:
            names = sorted(os.listdir(dir_fd))
            entries = []
            for name in names[:max_entries]:
                info = _lstat_at(name, dir_fd)
                if info is not None:
                    entries.append(DirectoryEntry(name, _file_type(info.st_mode), info.st_size))
        return entries, len(names) > max_entries

    def delete(self, path: str) -> str:
        """Remove the file, symbolic link (not its target) or empty directory at ``path``."""
        *parents, name = _components_of_file(path)
        with self._directory(path, parents) as dir_fd:
            info = _lstat_at(name, dir_fd)
            if info is None:
                raise PathNotFound(path, "does not exist")
            kind = _file_type(info.st_mode)
            try:
                if kind == "dir":
                    os.rmdir(name, dir_fd=dir_fd)
                else:
                    os.unlink(name, dir_fd=dir_fd)
            except OSError as error:
                raise WrongFileType(path, f"cannot be deleted: {error.strerror}") from None
        return kind

    def check_directory(self, path: str) -> None:
        """Confirm ``path`` is a directory reached without links (a command's cwd)."""
        with self._directory(path, split_relative_path(path)):
            pass

    @contextlib.contextmanager
    def _directory(
        self,
        path: str,
        parts: Sequence[str],
        *,
        create: bool = False,
        created: MutableSequence[str] | None = None,
    ) -> Iterator[int]:
        """A descriptor for the directory ``parts`` below the root, walked link-free; with
        ``create``, missing ones are made (and their paths appended to ``created``)."""
        fd = os.open(self.root, _DIR_FLAGS)
        try:
            for index, part in enumerate(parts):
                walked = "/".join(parts[: index + 1])
                if create and _lstat_at(part, fd) is None:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o755, dir_fd=fd)
                        if created is not None:
                            created.append(walked)
                        if os.geteuid() == 0:
                            uid, gid = workspace_owner()
                            os.chown(part, uid, gid, dir_fd=fd, follow_symlinks=False)
                next_fd = _open_directory_at(walked, part, fd)
                os.close(fd)
                fd = next_fd
            yield fd
        finally:
            os.close(fd)

    @staticmethod
    def _open_leaf(path: str, name: str, dir_fd: int, flags: int) -> int:
        try:
            return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            raise PathNotFound(path, "does not exist") from None
        except OSError as error:
            _raise_for_link(path, name, dir_fd)
            raise WrongFileType(path, error.strerror or "cannot be opened") from None


def _read_too_large(path: str, size: int, limit: int) -> FileTooLarge:
    return FileTooLarge(
        path,
        f"is {size} bytes; fs.read takes files of at most {limit} bytes "
        "(KESTREL_READ_MAX_FILE_BYTES). Read part of it with shell.exec (head -c, tail -c)",
    )


def _require_replaceable(path: str, name: str, dir_fd: int) -> None:
    existing = _lstat_at(name, dir_fd)
    if existing is not None and stat.S_ISLNK(existing.st_mode):
        raise PathRefused(path, "is a symbolic link; links are never followed")
    if existing is not None and not stat.S_ISREG(existing.st_mode):
        raise WrongFileType(path, "exists and is not a regular file")


def _write_temporary(path: str, dir_fd: int, data: bytes) -> str:
    """``data`` in a new temporary file in ``dir_fd``, synced and given to the sandbox user;
    its name. Removed again if the write fails; a full filesystem is ``WorkspaceFull``."""
    temp_name = _TEMP_PREFIX + secrets.token_hex(8)
    fd = os.open(
        temp_name,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o644,
        dir_fd=dir_fd,
    )
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            _give_to_sandbox_user(file.fileno())
            os.fsync(file.fileno())
    except BaseException as error:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp_name, dir_fd=dir_fd)
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise WorkspaceFull(
                path,
                f"does not fit: the workspace's filesystem is full ({len(data)} bytes to "
                "write; its size is the runner's KESTREL_WORKSPACE_QUOTA_MB). Delete files "
                "in it, or ask the operator for a larger quota",
            ) from None
        raise
    return temp_name


def _components_of_file(path: str) -> tuple[str, ...]:
    parts = split_relative_path(path)
    if not parts:
        raise WrongFileType(path, "is the workspace directory itself, not a file")
    return parts


def _open_directory_at(walked: str, name: str, dir_fd: int) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise PathNotFound(walked, "does not exist") from None
    except OSError as error:
        # O_NOFOLLOW | O_DIRECTORY on a link fails with ELOOP or ENOTDIR depending on the
        # kernel; look at the entry itself to say which it was.
        _raise_for_link(walked, name, dir_fd)
        raise WrongFileType(walked, f"is not a directory ({error.strerror})") from None


def _raise_for_link(path: str, name: str, dir_fd: int) -> None:
    info = _lstat_at(name, dir_fd)
    if info is not None and stat.S_ISLNK(info.st_mode):
        raise PathRefused(path, "is a symbolic link; links are never followed")


def _lstat_at(name: str, dir_fd: int) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _require_regular(path: str, info: os.stat_result) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise WrongFileType(path, f"is a {_file_type(info.st_mode)}, not a regular file")


def _file_type(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


def _give_to_sandbox_user(fd: int) -> None:
    if os.geteuid() == 0:
        uid, gid = workspace_owner()
        os.fchown(fd, uid, gid)
