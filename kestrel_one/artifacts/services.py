"""Writes for records: artifacts and share links. What a result feeds into (outputs,
checkpoints) is ``capture``; retention is ``retention`` (and ``execution.retention``).

Artifact bytes go to the artifact storage (``kestrel_one.artifacts.storage``); rows and
audit records go to the database in the caller's transaction. Storage is not transactional:
a file is deleted only after the transaction that deleted its row commits (see ``signals``),
so a rolled-back deletion never leaves a row pointing at nothing.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import timedelta

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from kestrel_one.artifacts.models import (
    Artifact,
    ArtifactKind,
    ShareLink,
)
from kestrel_one.artifacts.storage import (
    sha256_of,
    storage_name_for,
    storage_save,
)
from kestrel_one.audit.services import audit_record
from kestrel_one.common.ids import new_public_id

SHARE_TOKEN_PREFIX = "ksh_"  # noqa: S105 - a token prefix, not a secret
CONTENT_TYPES = {
    ArtifactKind.STDOUT: "text/plain; charset=utf-8",
    ArtifactKind.STDERR: "text/plain; charset=utf-8",
    ArtifactKind.CHECKPOINT: "application/gzip",
    ArtifactKind.FILE: "application/octet-stream",
}


# --- artifacts ----------------------------------------------------------------------------


def artifact_create(
    *,
    project,
    kind: str,
    name: str,
    content: bytes,
    created_by: str,
    thread=None,
    action=None,
    content_type: str | None = None,
) -> Artifact:
    """Store ``content`` and record it. The storage name holds public ids only.

    ``content_type`` defaults to the kind's; declared output files bring one guessed from
    their name. Either way downloads are attachments with ``nosniff``, never rendered.
    """
    public_id = new_public_id("art")
    stored_as = storage_save(
        storage_name_for(
            organization_public_id=project.organization.public_id, artifact_public_id=public_id
        ),
        content,
    )
    return Artifact.objects.create(
        public_id=public_id,
        organization_id=project.organization_id,
        project=project,
        thread=thread,
        action=action,
        kind=kind,
        name=name[:255],
        content_type=(content_type or CONTENT_TYPES[kind])[:100],
        size=len(content),
        sha256=sha256_of(content),
        storage_name=stored_as,
        created_by=created_by,
    )


# --- share links --------------------------------------------------------------------------


def share_token_hash(token: str) -> str:
    # The token carries 256 random bits, so a fast hash is enough: nothing to brute-force.
    return hashlib.sha256(token.encode()).hexdigest()


@transaction.atomic
def share_create(
    *, actor, artifact: Artifact | None = None, thread=None, expires_in: int
) -> tuple[ShareLink, str]:
    """Make a link to exactly one artifact or one thread; returns it and its token (once)."""
    if (artifact is None) == (thread is None):
        raise ValueError("a share link names exactly one artifact or one thread")
    token = SHARE_TOKEN_PREFIX + secrets.token_urlsafe(32)
    subject = artifact if artifact is not None else thread
    link = ShareLink.objects.create(
        organization_id=subject.organization_id,
        project_id=subject.project_id,
        artifact=artifact,
        thread=thread,
        token_hash=share_token_hash(token),
        created_by=actor.actor_id,
        expires_at=timezone.now() + timedelta(seconds=expires_in),
    )
    audit_record(
        organization=subject.organization,
        actor=actor,
        action="share.create",
        target=link,
        data={
            "artifact": artifact.public_id if artifact else None,
            "thread": thread.public_id if thread else None,
            "expires_at": link.expires_at.isoformat(),
        },
    )
    return link, token


def share_used(link: ShareLink) -> None:
    """Count one request through a live link; one UPDATE, so concurrent opens all count."""
    ShareLink.objects.filter(pk=link.pk).update(uses=F("uses") + 1, last_used_at=timezone.now())


@transaction.atomic
def share_revoke(*, actor, link: ShareLink) -> ShareLink:
    """Revoke a link at once; revoking it again changes nothing but is still recorded."""
    now = timezone.now()
    revoked = ShareLink.objects.filter(pk=link.pk, revoked_at__isnull=True).update(
        revoked_at=now, revoked_by=actor.actor_id
    )
    link.refresh_from_db()
    audit_record(
        organization=link.organization,
        actor=actor,
        action="share.revoke",
        target=link,
        data={"already_revoked": not revoked},
    )
    return link
