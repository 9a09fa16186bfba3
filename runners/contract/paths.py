"""The spelling rules of a workspace-relative path, shared by both tiers.

The control plane judges a path and the runner opens it; both accept only the canonical
spelling, so the path a policy judged is byte for byte the path that is opened. Walking the
path safely on disk is the runner's job (``runners.workspace``).
"""

from __future__ import annotations

from runners.contract.errors import PathRefused

__all__ = ["MAX_NAME_BYTES", "split_relative_path"]

# A file name's limit on every filesystem the runner writes to (NAME_MAX), in UTF-8 bytes.
MAX_NAME_BYTES = 255


def split_relative_path(path: str) -> tuple[str, ...]:
    """The components of a workspace-relative path, or ``PathRefused`` saying why not.

    Only canonical spellings pass (no ``//``, no ``./``, no trailing ``/``), so the path a
    policy judged is byte for byte the path that is opened. ``"."`` alone is the workspace.
    """
    if not isinstance(path, str) or path == "":
        raise PathRefused(str(path), "an empty path names nothing")
    if "\x00" in path:
        raise PathRefused(path, "paths must not contain NUL characters")
    if path.startswith("/"):
        raise PathRefused(path, "absolute paths are refused; give a path inside the workspace")
    if path == ".":
        return ()
    parts = tuple(path.split("/"))
    if ".." in parts:
        raise PathRefused(path, "'..' is refused; paths cannot climb out of the workspace")
    if "" in parts or "." in parts:
        raise PathRefused(path, "write the path without '//', './' or a trailing '/'")
    for part in parts:
        try:
            size = len(part.encode("utf-8"))
        except UnicodeEncodeError:
            raise PathRefused(path, "paths must be valid Unicode (no lone surrogates)") from None
        if size > MAX_NAME_BYTES:
            raise PathRefused(
                path,
                f"each name in a path may hold {MAX_NAME_BYTES} bytes (UTF-8); one holds {size}",
            )
    return parts
