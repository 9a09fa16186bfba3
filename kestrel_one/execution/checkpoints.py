"""Checkpoint restore: a ``workspace.restore`` action of a kept checkpoint, requested through
the normal action path (capture, which keeps the checkpoint, is ``artifacts.capture``)."""

from __future__ import annotations

import base64

from kestrel_one.artifacts.models import Checkpoint
from kestrel_one.artifacts.storage import sha256_of, storage_read
from kestrel_one.common.errors import Conflict, ValidationFailed
from kestrel_one.execution.services import action_request
from runners.tools.checkpoints import WORKSPACE_RESTORE


def checkpoint_restore(*, actor, checkpoint: Checkpoint, thread, exact: bool = False):
    """Request ``workspace.restore`` of a checkpoint through the normal action path.

    Policy (fs.write on the whole workspace), the thread's mode and approvals apply exactly
    as for any other call; this only fetches the archive and names it in the arguments.
    ``exact`` asks the runner to remove what the checkpoint does not hold, and is part of
    the arguments an approval binds to.
    """
    if thread.project_id != checkpoint.project_id:
        raise ValidationFailed(
            "The thread must belong to the checkpoint's project.",
            details={"thread": ["not in this project"]},
        )
    archive = storage_read(checkpoint.artifact.storage_name)
    if sha256_of(archive) != checkpoint.artifact.sha256:
        raise Conflict("The checkpoint's stored archive no longer matches its SHA-256.")
    return action_request(
        actor=actor,
        thread=thread,
        tool=WORKSPACE_RESTORE.name,
        args={
            "archive_b64": base64.b64encode(archive).decode("ascii"),
            "sha256": checkpoint.artifact.sha256,
            **({"exact": True} if exact else {}),
        },
    )
