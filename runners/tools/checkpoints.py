"""workspace.checkpoint and workspace.restore: a workspace to a bounded archive and back.

Specs and implementations. Both run on the runner host, like the file tools, and keep to
the same rule: nothing is ever reached through a symbolic link. A checkpoint walks the
workspace by directory descriptor with ``O_NOFOLLOW`` and refuses (rather than skips)
links, devices, sockets and pipes, so a snapshot is never silently partial. A restore
validates the whole archive before it writes anything: only regular files and directories
with canonical relative names (no absolute paths, no ``..``), within size and count caps,
and the archive must match the SHA-256 the control plane recorded. Files are written
through ``runners.workspace.Workspace.write_all``, link-free and all or nothing (each is
staged beside its target, then all are renamed into place; a failure on the way removes
what was staged); nothing is extracted by ``tarfile`` itself, and an extended header
larger than ``MAX_EXTENDED_HEADER_BYTES`` is refused before ``tarfile`` reads it.

A restore writes back every file and directory in the checkpoint. Files created since then
stay in place, unless the restore is ``exact``: then everything the checkpoint does not hold
is removed too, walking by directory descriptor and never following a link (a link is
removed itself), so the workspace ends as the checkpoint was (docs/records.md).
"""

from __future__ import annotations

import base64
import binascii
import gzip
import hashlib
import io
import os
import stat
import tarfile
from typing import Any

from runners.contract.arguments import object_schema, whole_workspace_request
from runners.contract.errors import PathRefused, WorkspaceError
from runners.contract.paths import split_relative_path
from runners.contract.toolspec import Captures, ToolContext, ToolSpec
from runners.workspace import Workspace

# The compressed archive travels base64-encoded inside a signed report or command (4 MiB
# at most each), so it stays well under that.
MAX_ARCHIVE_BYTES = 1024 * 1024
MAX_CONTENT_BYTES = 64 * 1024 * 1024
MAX_ENTRIES = 10_000
# An extended header (PAX, or GNU's long name and long link) is read whole by ``tarfile``
# before anything else is known: one declaring 900 MB, in an archive of 917 KB that
# decompresses to it, cost the runner 1 GB. Past this size one is refused unread; a name a
# checkpoint writes needs a few hundred bytes.
MAX_EXTENDED_HEADER_BYTES = 16 * 1024
_EXTENDED_HEADER_TYPES = frozenset(
    {
        tarfile.XHDTYPE,
        tarfile.XGLTYPE,
        tarfile.SOLARIS_XHDTYPE,
        tarfile.GNUTYPE_LONGNAME,
        tarfile.GNUTYPE_LONGLINK,
    }
)
_TEMP_PREFIX = ".kestrel-tmp-"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class CheckpointRefused(WorkspaceError):
    """The workspace or the archive cannot be checkpointed or restored safely; says why."""

    code = "checkpoint_refused"


class _Budget:
    def __init__(self) -> None:
        self.entries = 0
        self.content_bytes = 0
        self.files = 0

    def take(self, path: str, size: int) -> None:
        self.entries += 1
        self.content_bytes += size
        if self.entries > MAX_ENTRIES:
            raise CheckpointRefused(path, f"more than {MAX_ENTRIES} entries")
        if self.content_bytes > MAX_CONTENT_BYTES:
            raise CheckpointRefused(path, f"more than {MAX_CONTENT_BYTES} bytes of content")


def checkpoint(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    """A gzip'd tar of the workspace, base64-encoded, with its SHA-256 and counts."""
    workspace = ctx.workspace
    Workspace(workspace)  # the root must be a real directory
    budget = _Budget()
    buffer = io.BytesIO()
    # mtime=0 in the gzip header: the same workspace gives the same archive bytes.
    with (
        gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as compressed,
        tarfile.open(fileobj=compressed, mode="w", format=tarfile.PAX_FORMAT) as archive,
    ):
        root_fd = os.open(workspace, _DIR_FLAGS)
        try:
            _add_directory(archive, root_fd, "", budget, buffer)
        finally:
            os.close(root_fd)
    data = buffer.getvalue()
    if len(data) > MAX_ARCHIVE_BYTES:
        raise CheckpointRefused(".", f"the archive would exceed {MAX_ARCHIVE_BYTES} bytes")
    return {
        "archive_b64": base64.b64encode(data).decode("ascii"),
        "sha256": hashlib.sha256(data).hexdigest(),
        "size": len(data),
        "files": budget.files,
        "bytes": budget.content_bytes,
    }


def _add_directory(
    archive: tarfile.TarFile, dir_fd: int, prefix: str, budget: _Budget, buffer: io.BytesIO
) -> None:
    for name in sorted(os.listdir(dir_fd)):
        if name.startswith(_TEMP_PREFIX):
            continue  # a write in progress; the finished file is what counts
        path = prefix + name
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISLNK(info.st_mode):
            raise PathRefused(path, "is a symbolic link; checkpoints never contain links")
        if stat.S_ISDIR(info.st_mode):
            budget.take(path, 0)
            member = _member(path, tarfile.DIRTYPE, 0o755, info)
            archive.addfile(member)
            child = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
            try:
                _add_directory(archive, child, path + "/", budget, buffer)
            finally:
                os.close(child)
        elif stat.S_ISREG(info.st_mode):
            data = _read_regular(path, name, dir_fd, budget)
            member = _member(path, tarfile.REGTYPE, 0o755 if info.st_mode & 0o111 else 0o644, info)
            member.size = len(data)
            archive.addfile(member, io.BytesIO(data))
            budget.files += 1
        else:
            raise PathRefused(path, "is a device, socket or pipe; checkpoints hold files only")
        if buffer.tell() > MAX_ARCHIVE_BYTES:
            raise CheckpointRefused(path, f"the archive would exceed {MAX_ARCHIVE_BYTES} bytes")


def _read_regular(path: str, name: str, dir_fd: int, budget: _Budget) -> bytes:
    fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    try:
        # Checked on the open descriptor: a swap after the listing cannot slip a device in.
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise PathRefused(path, "changed into something other than a regular file")
        remaining = MAX_CONTENT_BYTES - budget.content_bytes
        with os.fdopen(os.dup(fd), "rb") as handle:
            data = handle.read(remaining + 1)
    finally:
        os.close(fd)
    budget.take(path, len(data))
    return data


def _member(path: str, kind: bytes, mode: int, info: os.stat_result) -> tarfile.TarInfo:
    member = tarfile.TarInfo(path)
    member.type = kind
    member.mode = mode
    member.mtime = int(info.st_mtime)
    # Ownership is the runner's business, not the archive's.
    member.uid = member.gid = 0
    member.uname = member.gname = ""
    return member


def restore(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    """Write a checkpoint's files back into the workspace, after checking all of it."""
    workspace = ctx.workspace
    try:
        data = base64.b64decode(args["archive_b64"], validate=True)
    except (binascii.Error, ValueError):
        raise CheckpointRefused("archive_b64", "is not valid base64") from None
    if len(data) > MAX_ARCHIVE_BYTES:
        raise CheckpointRefused("archive_b64", f"the archive exceeds {MAX_ARCHIVE_BYTES} bytes")
    if hashlib.sha256(data).hexdigest() != args["sha256"]:
        raise CheckpointRefused("archive_b64", "does not match the sha256 it was sent with")
    directories, files = _validated_members(data)
    # All or nothing: a link or a file in the way, or a full workspace, leaves it unchanged.
    written = Workspace(workspace).write_all(directories, files)
    removed = 0
    if args.get("exact"):
        keep = set(directories) | {path for path, _ in files}
        root_fd = os.open(workspace, _DIR_FLAGS)
        try:
            removed = _remove_unlisted(root_fd, "", keep)
        finally:
            os.close(root_fd)
    return {
        "sha256": args["sha256"],
        "files": len(files),
        "directories": len(directories),
        "bytes": written,
        "removed": removed,
    }


def _remove_unlisted(dir_fd: int, prefix: str, keep: set[str] | None) -> int:
    """Remove every entry below ``dir_fd`` whose path is not in ``keep``; returns how many.

    ``keep`` is None inside a directory that is removed whole. A link is unlinked itself,
    never followed; a write in progress (its temporary name) is left to finish.
    """
    removed = 0
    for name in sorted(os.listdir(dir_fd)):
        if name.startswith(_TEMP_PREFIX):
            continue
        path = prefix + name
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        listed = keep is not None and path in keep
        if stat.S_ISDIR(info.st_mode):
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
            except OSError:
                raise PathRefused(path, "changed into a link while it was being removed") from None
            try:
                removed += _remove_unlisted(child, path + "/", keep if listed else None)
            finally:
                os.close(child)
            if not listed:
                os.rmdir(name, dir_fd=dir_fd)
                removed += 1
        elif not (listed and stat.S_ISREG(info.st_mode)):
            os.unlink(name, dir_fd=dir_fd)
            removed += 1
    return removed


class _BoundedTarInfo(tarfile.TarInfo):
    """A member header that refuses an oversized extended header before ``tarfile`` reads
    it (``_proc_member`` is where ``tarfile`` dispatches to the reader of each type)."""

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in _EXTENDED_HEADER_TYPES and self.size > MAX_EXTENDED_HEADER_BYTES:
            raise CheckpointRefused(
                "archive_b64",
                f"an extended tar header of {self.size} bytes is larger than "
                f"{MAX_EXTENDED_HEADER_BYTES}; it is not read",
            )
        member: tarfile.TarInfo = super()._proc_member(tarfile_)  # type: ignore[misc]
        return member


def _validated_members(data: bytes) -> tuple[list[str], list[tuple[str, bytes]]]:
    """Every member checked before anything is written: a bad archive changes nothing."""
    budget = _Budget()
    directories: list[str] = []
    files: list[tuple[str, bytes]] = []
    try:
        with tarfile.open(
            fileobj=io.BytesIO(data), mode="r:gz", tarinfo=_BoundedTarInfo
        ) as archive:
            for member in archive:
                name = member.name
                try:
                    split_relative_path(name)
                except PathRefused as refused:
                    raise CheckpointRefused(name, refused.reason) from None
                if name == ".":
                    continue
                if member.isdir():
                    budget.take(name, 0)
                    directories.append(name)
                elif member.isreg():
                    # The declared size is checked before any of the member is read.
                    budget.take(name, member.size)
                    extracted = archive.extractfile(member)
                    files.append((name, extracted.read() if extracted else b""))
                else:
                    raise CheckpointRefused(name, "links, devices and pipes are never restored")
    except (tarfile.TarError, EOFError, OSError, gzip.BadGzipFile) as error:
        raise CheckpointRefused("archive_b64", f"is not a readable tar.gz ({error})") from None
    return directories, files


# A checkpoint archive is at most MAX_ARCHIVE_BYTES, base64 a third more.
MAX_ARCHIVE_B64_CHARS = MAX_ARCHIVE_BYTES * 4 // 3 + 4

WORKSPACE_CHECKPOINT = ToolSpec(
    name="workspace.checkpoint",
    capability="fs.read",
    summary="Snapshot the whole workspace as a bounded tar.gz (no links or devices).",
    input_schema=object_schema({}, []),
    idempotent=True,
    build_request=whole_workspace_request("fs.read"),
    implementation=checkpoint,
    captures=Captures.CHECKPOINT,
)

WORKSPACE_RESTORE = ToolSpec(
    name="workspace.restore",
    capability="fs.write",
    summary="Write a checkpoint's files back into the workspace, checked first.",
    input_schema=object_schema(
        {
            "archive_b64": {
                "type": "string",
                "minLength": 1,
                "maxLength": MAX_ARCHIVE_B64_CHARS,
                "pattern": "^[A-Za-z0-9+/]*={0,2}$",
            },
            "sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
            # Also remove what the checkpoint does not hold.
            "exact": {"type": "boolean"},
        },
        ["archive_b64", "sha256"],
    ),
    # Writing the same files again leaves the same workspace.
    idempotent=True,
    build_request=whole_workspace_request("fs.write"),
    implementation=restore,
)

TOOLS = (WORKSPACE_CHECKPOINT, WORKSPACE_RESTORE)
