"""fs.read, fs.write, fs.list and fs.delete, run on the runner host inside the workspace."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runners.workspace import Workspace

# A read returns at most this much content (the size and hash cover the whole file).
READ_MAX_BYTES = 1024 * 1024
LIST_MAX_ENTRIES = 10_000


def read(args: dict[str, Any], *, workspace: Path, **_context: Any) -> dict[str, Any]:
    content = Workspace(workspace).read(args["path"], max_bytes=READ_MAX_BYTES)
    return {
        "path": args["path"],
        "content": content.data.decode("utf-8", errors="replace"),
        "size": content.size,
        "sha256": content.sha256,
        "truncated": content.truncated,
    }


def write(args: dict[str, Any], *, workspace: Path, **_context: Any) -> dict[str, Any]:
    written = Workspace(workspace).write(args["path"], args["content"].encode("utf-8"))
    return {"path": args["path"], "size": written.size, "sha256": written.sha256}


def list_directory(args: dict[str, Any], *, workspace: Path, **_context: Any) -> dict[str, Any]:
    entries, truncated = Workspace(workspace).list(args["path"], max_entries=LIST_MAX_ENTRIES)
    return {
        "path": args["path"],
        "entries": [{"name": e.name, "type": e.type, "size": e.size} for e in entries],
        "truncated": truncated,
    }


def delete(args: dict[str, Any], *, workspace: Path, **_context: Any) -> dict[str, Any]:
    kind = Workspace(workspace).delete(args["path"])
    return {"path": args["path"], "type": kind}
