"""What a finished action's result feeds into: output past the inline cap, declared output
files, and a checkpoint's workspace archive, each kept as an artifact.

Called by ``report_ingest`` (``kestrel_one.execution.services``) under the action's row
lock, before the result is stored on the action and its receipt.
"""

from __future__ import annotations

import base64
import binascii
import mimetypes

from django.conf import settings

from kestrel_one.artifacts.models import ArtifactKind, Checkpoint
from kestrel_one.artifacts.services import artifact_create
from kestrel_one.artifacts.storage import sha256_of
from kestrel_one.common.ids import new_public_id
from kestrel_one.common.redaction import redact_result
from runners.contract.arguments import (
    MAX_OUTPUT_FILE_BYTES,
    MAX_OUTPUTS_TOTAL_BYTES,
    declared_outputs,
)
from runners.contract.registry import get_tool
from runners.contract.toolspec import Captures

# The runner caps a checkpoint archive well below this (runners.tools.checkpoints); the
# control plane checks again because a report is untrusted data until proven otherwise.
CHECKPOINT_MAX_ARCHIVE_BYTES = 2 * 1024 * 1024
OUTPUT_STREAMS = ("stdout", "stderr")
# The errors a runner may report for a declared output (runners.tools.processes); anything
# else it says is replaced by "invalid" rather than stored.
OUTPUT_RUNNER_ERRORS = frozenset({"not_found", "too_large", "path_refused", "wrong_file_type"})


def artifacts_capture(*, action, result, known: list[str] | tuple[str, ...] = ()):
    """Move what is too large for an action's result into artifacts; return the result to keep.

    Called once by ``report_ingest`` while it holds the action's row lock, before the result
    is stored on the action and its receipt. Output past the inline cap is kept whole (after
    redaction, ``known`` being the call's write-only values) as an artifact, the result
    keeps its first bytes and a marker naming the artifact. A checkpoint's archive becomes a
    checkpoint artifact and never stays in the result. The caller (``report_ingest``) calls
    it only for an action still in flight.
    """
    if not isinstance(result, dict):
        return result
    if get_tool(action.tool).captures is Captures.CHECKPOINT:
        return checkpoint_capture(action=action, result=result)
    cap = settings.KESTREL_ARTIFACT_INLINE_BYTES
    kept = dict(result)
    stored = {}
    for stream in OUTPUT_STREAMS:
        text = result.get(stream)
        if not isinstance(text, str) or len(text.encode()) <= cap:
            continue
        # Artifacts are secret-free like every other record (CRED-1): redacted before stored,
        # by the same path as the result that stays inline.
        clean = redact_result(text, known=known).encode()
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
        kept[stream] = f"{inline}\n[{_cut_note(result, stream, len(clean), artifact.public_id)}]"
        stored[stream] = artifact.public_id
    if stored:
        kept["artifacts"] = stored
    if "outputs" in result:
        kept["outputs"] = _outputs_capture(action=action, reported=result["outputs"], known=known)
    return kept


def _cut_note(result: dict, stream: str, stored: int, artifact_id: str) -> str:
    """The marker after a stream's inline part: where the rest is, and whether the runner
    already cut the stream to fit its report (``report_cut``, runners.report_budget)."""
    cut = result.get("report_cut")
    cut = cut.get(stream) if isinstance(cut, dict) else None
    whole = cut.get("bytes") if isinstance(cut, dict) else None
    if isinstance(whole, int) and not isinstance(whole, bool):
        return (
            f"truncated: the command printed {whole} bytes, the runner's report kept the "
            f"first of them; those ({stored} bytes) are artifact {artifact_id}"
        )
    return f"truncated: {stored} bytes in all; the full text is artifact {artifact_id}"


def _outputs_capture(*, action, reported, known=()) -> list[dict]:
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
        stored, redacted = _output_stored_bytes(content, known=known)
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


def _output_stored_bytes(content: bytes, *, known=()) -> tuple[bytes, bool]:
    """What to store for an output file, and whether redaction changed it."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        # Binary: stored as is (like checkpoint archives), readable only as an attachment.
        return content, False
    clean = redact_result(text, known=known).encode()
    return clean, clean != content


def checkpoint_capture(*, action, result: dict) -> dict:
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
