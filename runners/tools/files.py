"""The file tools, fs.read, fs.write, fs.list and fs.delete: specs and implementations.

They run on the runner host inside the workspace, through the link-free
``runners.workspace`` API; they never start a process.
"""

from __future__ import annotations

from typing import Any

from runners.contract.arguments import MAX_FILE_CONTENT_CHARS, PATH, object_schema, path_request
from runners.contract.toolspec import ToolContext, ToolSpec
from runners.workspace import Workspace

# A read returns at most this much content (the size and hash cover the whole file).
READ_MAX_BYTES = 1024 * 1024
LIST_MAX_ENTRIES = 10_000


def read(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    content = Workspace(ctx.workspace).read(
        args["path"], max_bytes=READ_MAX_BYTES, max_file_bytes=ctx.read_max_file_bytes
    )
    return {
        "path": args["path"],
        "content": content.data.decode("utf-8", errors="replace"),
        "size": content.size,
        "sha256": content.sha256,
        "truncated": content.truncated,
    }


def write(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    written = Workspace(ctx.workspace).write(args["path"], args["content"].encode("utf-8"))
    return {"path": args["path"], "size": written.size, "sha256": written.sha256}


def list_directory(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    entries, truncated = Workspace(ctx.workspace).list(args["path"], max_entries=LIST_MAX_ENTRIES)
    return {
        "path": args["path"],
        "entries": [{"name": e.name, "type": e.type, "size": e.size} for e in entries],
        "truncated": truncated,
    }


def delete(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    kind = Workspace(ctx.workspace).delete(args["path"])
    return {"path": args["path"], "type": kind}


_PATH_ONLY = object_schema({"path": PATH}, ["path"])

FS_READ = ToolSpec(
    name="fs.read",
    capability="fs.read",
    summary="Read a file in the workspace.",
    input_schema=_PATH_ONLY,
    idempotent=True,
    build_request=path_request("fs.read"),
    implementation=read,
)

FS_LIST = ToolSpec(
    name="fs.list",
    capability="fs.read",
    summary="List a directory in the workspace.",
    input_schema=_PATH_ONLY,
    idempotent=True,
    build_request=path_request("fs.read"),
    implementation=list_directory,
)

FS_WRITE = ToolSpec(
    name="fs.write",
    capability="fs.write",
    summary="Create or replace a file in the workspace with the given text.",
    input_schema=object_schema(
        {
            "path": PATH,
            "content": {"type": "string", "maxLength": MAX_FILE_CONTENT_CHARS},
        },
        ["path", "content"],
    ),
    # Writing the same content again leaves the same file and the same result.
    idempotent=True,
    build_request=path_request("fs.write"),
    implementation=write,
)

FS_DELETE = ToolSpec(
    name="fs.delete",
    capability="fs.write",
    summary="Delete a file, a symbolic link or an empty directory in the workspace.",
    input_schema=_PATH_ONLY,
    # A second delete finds nothing and fails, unlike the first.
    idempotent=False,
    build_request=path_request("fs.write"),
    implementation=delete,
)

TOOLS = (FS_READ, FS_LIST, FS_WRITE, FS_DELETE)
