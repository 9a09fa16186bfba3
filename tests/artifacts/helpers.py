"""Helpers for records tests: a workspace archive, a checkpoint, a verified runner report."""

from __future__ import annotations

import base64
import tempfile
from pathlib import Path

from kestrel_one.artifacts.models import Checkpoint
from kestrel_one.artifacts.services import artifact_create
from runners.contract.tokens import sign_result
from runners.contract.toolspec import ToolContext
from runners.tools import checkpoints


def workspace_archive(files: dict[str, str] | None = None) -> dict:
    """What the runner's workspace.checkpoint returns for a workspace holding ``files``."""
    files = files if files is not None else {"src/app.py": "print('v1')\n", "README.md": "hi\n"}
    with tempfile.TemporaryDirectory() as root:
        for path, content in files.items():
            target = Path(root) / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content)
        # A checkpoint starts no process: it needs no sandbox.
        return checkpoints.checkpoint({}, ToolContext(workspace=Path(root), sandbox=None))


def make_checkpoint(*, project, thread=None) -> Checkpoint:
    """A stored checkpoint of a small workspace, as if a runner had taken it."""
    result = workspace_archive()
    artifact = artifact_create(
        project=project,
        thread=thread,
        kind="checkpoint",
        name="walker.tar.gz",
        content=base64.b64decode(result["archive_b64"]),
        created_by="tests",
    )
    return Checkpoint.objects.create(
        organization_id=project.organization_id,
        project=project,
        thread=thread,
        artifact=artifact,
        files=result["files"],
        content_bytes=result["bytes"],
        created_by="tests",
    )


def finished_report(action, runner, key, *, result, outcome="succeeded", error=None) -> str:
    """A runner's signed "finished" report for ``action``, as report_ingest receives it."""
    return sign_result(
        {
            "call_id": action.public_id,
            "command_digest": action.command_digest,
            "attempt": 1,
            "event": "finished",
            "outcome": outcome,
            "result": result,
            "error": error,
            "sandbox": None,
            "started_at": "2026-11-29T12:00:00Z",
            "finished_at": "2026-11-29T12:00:01Z",
        },
        key,
        runner.public_id,
    )
