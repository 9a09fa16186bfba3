"""Writes for records: artifacts, checkpoints, share links, retention and its sweep.

Artifact bytes go to the artifact storage (``kestrel_one.artifacts.storage``); rows and
audit records go to the database in the caller's transaction. Storage is not transactional:
a file is deleted only after the transaction that deleted its row commits (see ``signals``),
so a rolled-back deletion never leaves a row pointing at nothing.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import mimetypes
import secrets
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Exists, F, OuterRef, Q
from django.utils import timezone

from kestrel_one.accounts.principal import system_principal
from kestrel_one.artifacts.models import (
    Artifact,
    ArtifactKind,
    Checkpoint,
    OrganizationRetention,
    ShareLink,
)
from kestrel_one.artifacts.storage import (
    sha256_of,
    storage_name_for,
    storage_read,
    storage_save,
)
from kestrel_one.audit import services as audit_services
from kestrel_one.audit.services import audit_record
from kestrel_one.common.errors import Conflict, ValidationFailed
from kestrel_one.common.ids import new_public_id
from kestrel_one.common.redaction import redact_text
from runners.registry import MAX_OUTPUT_FILE_BYTES, MAX_OUTPUTS_TOTAL_BYTES, declared_outputs

# The runner caps a checkpoint archive well below this (runners.tools.checkpoints); the
# control plane checks again because a report is untrusted data until proven otherwise.
CHECKPOINT_MAX_ARCHIVE_BYTES = 2 * 1024 * 1024
SHARE_TOKEN_PREFIX = "ksh_"  # noqa: S105 - a token prefix, not a secret
# Which ids a retention sweep names in its audit record (the counts are always complete).
SWEEP_AUDIT_MAX_IDS = 50
OUTPUT_STREAMS = ("stdout", "stderr")
# The errors a runner may report for a declared output (runners.tools.processes); anything
# else it says is replaced by "invalid" rather than stored.
OUTPUT_RUNNER_ERRORS = frozenset({"not_found", "too_large", "path_refused", "wrong_file_type"})
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


def artifacts_capture(*, action, result):
    """Move what is too large for an action's result into artifacts; return the result to keep.

    Called once by ``report_ingest`` while it holds the action's row lock, before the result
    is stored on the action and its receipt. Output past the inline cap is kept whole (after
    redaction) as an artifact, the result keeps its first bytes and a marker naming the
    artifact. A checkpoint's archive becomes a checkpoint artifact and never stays in the
    result. A report for an action that already finished changes nothing.
    """
    from kestrel_one.execution.models import ActionState

    if not isinstance(result, dict) or action.state not in (
        ActionState.QUEUED,
        ActionState.RUNNING,
    ):
        return result
    if action.tool == "workspace.checkpoint":
        return _checkpoint_capture(action=action, result=result)
    cap = settings.KESTREL_ARTIFACT_INLINE_BYTES
    kept = dict(result)
    stored = {}
    for stream in OUTPUT_STREAMS:
        text = result.get(stream)
        if not isinstance(text, str) or len(text.encode()) <= cap:
            continue
        # Artifacts are secret-free like every other record (CRED-1): redacted before stored.
        clean = redact_text(text).encode()
        artifact = artifact_create(
            project=action.project,
            thread=action.thread,
            action=action,
            kind=stream,
            name=f"{action.public_id}.{stream}.txt",
            content=clean,
            created_by=action.requested_by,
        )
        inline = clean[:cap].decode("utf-8", errors="ignore")
        kept[stream] = (
            f"{inline}\n[truncated: {len(clean)} bytes in all; "
            f"the full text is artifact {artifact.public_id}]"
        )
        stored[stream] = artifact.public_id
    if stored:
        kept["artifacts"] = stored
    if "outputs" in result:
        kept["outputs"] = _outputs_capture(action=action, reported=result["outputs"])
    return kept


def _outputs_capture(*, action, reported) -> list[dict]:
    """Keep each declared output file a runner returned as a ``file`` artifact.

    The report is untrusted until checked: only paths the action declared are taken, each
    once, within the same caps the runner applies; the bytes must match the reported
    SHA-256, else the output is refused (``sha256_mismatch``) and nothing is stored. What is
    kept in the result (and so the receipt) is the path, the reported size and SHA-256 and
    the artifact's id, never the base64 content.

    Text files (valid UTF-8) are redacted before they are stored, exactly like output
    streams (CRED-1); ``redacted`` says when that changed the bytes, so the artifact's
    SHA-256 then differs from the file's. Other files are stored as they are; no file's
    content is ever shown inline.
    """
    declared = declared_outputs(action.args or {})
    if not isinstance(reported, list):
        return [{"path": path, "error": "not_reported"} for path in declared]
    by_path: dict[str, dict] = {}
    for entry in reported:
        path = entry.get("path") if isinstance(entry, dict) else None
        if path in declared and path not in by_path:
            by_path[path] = entry
    kept = []
    remaining = MAX_OUTPUTS_TOTAL_BYTES
    for path in declared:
        entry = by_path.get(path)
        if entry is None:
            kept.append({"path": path, "error": "not_reported"})
            continue
        content = _output_content(entry, remaining)
        if isinstance(content, str):
            kept.append({"path": path, "error": content})
            continue
        remaining -= len(content)
        stored, redacted = _output_stored_bytes(content)
        artifact = artifact_create(
            project=action.project,
            thread=action.thread,
            action=action,
            kind=ArtifactKind.FILE,
            name=path,
            content=stored,
            created_by=action.requested_by,
            content_type=mimetypes.guess_type(path, strict=False)[0] or "application/octet-stream",
        )
        item = {
            "path": path,
            "size": len(content),
            "sha256": entry["sha256"],
            "artifact": artifact.public_id,
        }
        if redacted:
            item["redacted"] = True
        kept.append(item)
    return kept


def _bounded_b64decode(encoded, limit: int) -> bytes | str:
    """Base64 of at most ``limit`` bytes, decoded strictly; or "invalid" / "too_large".
    The length is checked before decoding, so an oversized report costs no memory."""
    if not isinstance(encoded, str):
        return "invalid"
    if len(encoded) > limit * 4 // 3 + 4:
        return "too_large"
    try:
        content = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        return "invalid"
    return "too_large" if len(content) > limit else content


def _output_content(entry: dict, remaining: int) -> bytes | str:
    """One reported output's bytes, or the error to keep in their place."""
    if "error" in entry:
        error = entry["error"]
        return error if error in OUTPUT_RUNNER_ERRORS else "invalid"
    content = _bounded_b64decode(entry.get("content_b64"), min(MAX_OUTPUT_FILE_BYTES, remaining))
    if isinstance(content, str):
        return content
    if sha256_of(content) != entry.get("sha256"):
        return "sha256_mismatch"
    if entry.get("size") != len(content):
        return "size_mismatch"
    return content


def _output_stored_bytes(content: bytes) -> tuple[bytes, bool]:
    """What to store for an output file, and whether redaction changed it."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        # Binary: stored as is (like checkpoint archives), readable only as an attachment.
        return content, False
    clean = redact_text(text).encode()
    return clean, clean != content


def _checkpoint_capture(*, action, result: dict) -> dict:
    """Keep a reported workspace archive as a checkpoint; the result keeps a reference."""
    archive = _decoded_archive(result)
    if isinstance(archive, str):
        # The report is kept as evidence of what the runner said, minus the bytes.
        return {
            "checkpoint": None,
            "error": archive,
            **{k: v for k, v in result.items() if k != "archive_b64"},
        }
    checkpoint_id = new_public_id("chk")
    artifact = artifact_create(
        project=action.project,
        thread=action.thread,
        action=action,
        kind=ArtifactKind.CHECKPOINT,
        name=f"{checkpoint_id}.tar.gz",
        content=archive,
        created_by=action.requested_by,
    )
    checkpoint = Checkpoint.objects.create(
        public_id=checkpoint_id,
        organization_id=action.organization_id,
        project=action.project,
        thread=action.thread,
        action=action,
        artifact=artifact,
        files=int(result.get("files") or 0),
        content_bytes=int(result.get("bytes") or 0),
        created_by=action.requested_by,
    )
    return {
        "checkpoint": checkpoint.public_id,
        "artifact": artifact.public_id,
        "sha256": artifact.sha256,
        "size": artifact.size,
        "files": checkpoint.files,
        "bytes": checkpoint.content_bytes,
    }


def _decoded_archive(result: dict) -> bytes | str:
    """The archive's bytes, or why they cannot be kept."""
    if not isinstance(result.get("archive_b64"), str):
        return "the report carries no archive"
    archive = _bounded_b64decode(result["archive_b64"], CHECKPOINT_MAX_ARCHIVE_BYTES)
    if archive == "too_large":
        return "the archive is larger than a checkpoint may be"
    if isinstance(archive, str):
        return "the archive is not valid base64"
    if sha256_of(archive) != result.get("sha256"):
        return "the archive does not match its reported sha256"
    return archive


def checkpoint_restore(*, actor, checkpoint: Checkpoint, thread, exact: bool = False):
    """Request ``workspace.restore`` of a checkpoint through the normal action path.

    Policy (fs.write on the whole workspace), the thread's mode and approvals apply exactly
    as for any other call; this only fetches the archive and names it in the arguments.
    ``exact`` asks the runner to remove what the checkpoint does not hold, and is part of
    the arguments an approval binds to.
    """
    from kestrel_one.execution.services import action_request

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
        tool="workspace.restore",
        args={
            "archive_b64": base64.b64encode(archive).decode("ascii"),
            "sha256": checkpoint.artifact.sha256,
            **({"exact": True} if exact else {}),
        },
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


# --- retention ----------------------------------------------------------------------------

RETENTION_FIELDS = ("events_days", "artifacts_days", "checkpoints_days", "audit_days")


@transaction.atomic
def retention_update(*, actor, organization, values: dict) -> OrganizationRetention:
    retention, _ = OrganizationRetention.objects.select_for_update().get_or_create(
        organization=organization
    )
    before = {name: getattr(retention, name) for name in RETENTION_FIELDS}
    for name in RETENTION_FIELDS:
        setattr(retention, name, values[name])
    retention.updated_by = actor.actor_id
    retention.save()
    audit_record(
        organization=organization,
        actor=actor,
        action="retention.update",
        data={"before": before, "after": {name: values[name] for name in RETENTION_FIELDS}},
    )
    return retention


def retention_sweep(*, now: datetime | None = None) -> dict[str, dict]:
    """Sweep every organization; each in its own transaction, so one failure stops one."""
    from kestrel_one.tenancy.models import Organization

    now = now or timezone.now()
    swept = {}
    for organization in Organization.objects.order_by("pk"):
        swept[organization.slug] = retention_sweep_organization(organization=organization, now=now)
    return swept


@transaction.atomic
def retention_sweep_organization(*, organization, now: datetime) -> dict:
    """Delete what this organization keeps no longer, and record the sweep in its audit log.

    - Checkpoints older than ``checkpoints_days`` (their archives with them).
    - Other artifacts older than ``artifacts_days``.
    - Threads whose last event is older than ``events_days`` and with no call still pending:
      the whole thread (events, actions, decisions, receipts, plans, share links).
    - In threads still in use: events, and finished actions with their receipts, older than
      ``events_days``. The replay then says where the kept history starts.
    - Share links that have expired.
    - The audit log's records older than ``audit_days``, by the audit app's own trim, which
      keeps the remaining chain verifiable.

    Files leave the storage after this transaction commits. One audit record per sweep that
    deleted anything gives the counts and the deleted artifact, checkpoint and thread ids.
    """
    from kestrel_one.execution.models import TERMINAL_STATES, Action
    from kestrel_one.threads.models import Thread, ThreadEvent

    retention = OrganizationRetention.objects.filter(organization=organization).first()
    retention = retention or OrganizationRetention(organization=organization)
    events_cutoff = now - timedelta(days=retention.events_days)
    artifacts_cutoff = now - timedelta(days=retention.artifacts_days)
    checkpoints_cutoff = now - timedelta(days=retention.checkpoints_days)
    pending = [state for state in _all_action_states() if state not in TERMINAL_STATES]

    checkpoints = Checkpoint.objects.filter(
        organization=organization, created_at__lt=checkpoints_cutoff
    )
    checkpoint_ids = list(checkpoints.values_list("public_id", flat=True))
    # Deleting the archive deletes the checkpoint row (one-to-one, cascade).
    Artifact.objects.filter(checkpoint__in=checkpoints).delete()

    artifacts = Artifact.objects.filter(
        organization=organization, created_at__lt=artifacts_cutoff
    ).exclude(kind=ArtifactKind.CHECKPOINT)
    artifact_ids = list(artifacts.values_list("public_id", flat=True))
    artifacts.delete()

    recent_event = ThreadEvent.objects.filter(thread=OuterRef("pk"), created_at__gte=events_cutoff)
    pending_action = Action.objects.filter(thread=OuterRef("pk"), state__in=pending)
    threads = Thread.objects.filter(organization=organization, created_at__lt=events_cutoff).filter(
        ~Exists(recent_event), ~Exists(pending_action)
    )
    thread_ids = list(threads.values_list("public_id", flat=True))
    threads.delete()

    old_actions = Action.objects.filter(
        Q(finished_at__lt=events_cutoff)
        | Q(finished_at__isnull=True, created_at__lt=events_cutoff),
        organization=organization,
        state__in=list(TERMINAL_STATES),
    )
    actions_deleted = old_actions.count()
    old_actions.delete()
    old_events = ThreadEvent.objects.filter(
        organization=organization, created_at__lt=events_cutoff
    ).exclude(action__state__in=pending)
    events_deleted, _ = old_events.delete()

    shares_deleted, _ = ShareLink.objects.filter(
        Q(organization=organization) & Q(expires_at__lt=now)
    ).delete()

    counts = {
        "checkpoints": len(checkpoint_ids),
        "artifacts": len(artifact_ids),
        "threads": len(thread_ids),
        "actions": actions_deleted,
        "events": events_deleted,
        "share_links": shares_deleted,
    }
    if any(counts.values()):
        audit_record(
            organization=organization,
            actor=system_principal("retention"),
            action="retention.sweep",
            data={
                "now": now.isoformat(),
                "retention": {name: getattr(retention, name) for name in RETENTION_FIELDS},
                "deleted": counts,
                "checkpoints": checkpoint_ids[:SWEEP_AUDIT_MAX_IDS],
                "artifacts": artifact_ids[:SWEEP_AUDIT_MAX_IDS],
                "threads": thread_ids[:SWEEP_AUDIT_MAX_IDS],
            },
        )
    counts["audit_records"] = _audit_trim(
        organization=organization, before=now - timedelta(days=retention.audit_days)
    )
    return counts


def _audit_trim(*, organization, before: datetime) -> int:
    """Trim the audit chain through the audit app's own service, when it offers one.

    The audit app owns its chain and how a trim stays verifiable; this sweep only says when.
    It is asked only when something is due, since each trim appends its own record.
    """
    trim = getattr(audit_services, "audit_trim", None)
    if trim is None:
        return 0
    from kestrel_one.audit.models import AuditRecord

    if not AuditRecord.objects.filter(organization=organization, created_at__lt=before).exists():
        return 0
    record = trim(organization=organization, actor=system_principal("retention"), before=before)
    return int((record.data or {}).get("deleted", 0))


def _all_action_states() -> list[str]:
    from kestrel_one.execution.models import ActionState

    return [state.value for state in ActionState]
