"""Artifact files leave the storage when their rows do, whatever deleted the row.

Rows go by many paths (the retention sweep, a project or organization deleted with
everything under it); one receiver covers them all. The file is deleted only once the
deleting transaction commits, so a rollback never leaves a row without its file.
"""

from __future__ import annotations

import structlog
from django.db import transaction
from django.db.models.signals import post_delete
from django.dispatch import receiver

from kestrel_one.artifacts.models import Artifact
from kestrel_one.artifacts.storage import storage_delete

logger = structlog.get_logger(__name__)


@receiver(post_delete, sender=Artifact, dispatch_uid="artifact-file-delete")
def delete_artifact_file(sender, instance: Artifact, **kwargs) -> None:
    name = instance.storage_name

    def delete_file() -> None:
        try:
            storage_delete(name)
        except Exception:
            # The row is gone; a file left behind is logged for the operator, never raised
            # into the transaction that already committed.
            logger.exception("artifact.file_not_deleted", storage_name=name)

    transaction.on_commit(delete_file)
