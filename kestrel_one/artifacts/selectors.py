"""Reads for records: what a principal may see, what a share token opens, a thread's replay."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any

from django.apps import apps
from django.db.models import Min
from django.utils import timezone

from kestrel_one.artifacts.models import Artifact, Checkpoint, OrganizationRetention, ShareLink
from kestrel_one.artifacts.services import SHARE_TOKEN_PREFIX, share_token_hash
from kestrel_one.common.ids import PREFIXES
from kestrel_one.common.redaction import bounded
from kestrel_one.tenancy.models import Project
from kestrel_one.threads.models import ThreadEvent

# Replay projections are bounded per item, so one huge call cannot make a replay unbounded.
REPLAY_ARGS_MAX_BYTES = 4096
REPLAY_RESULT_MAX_BYTES = 8192
REPLAY_SMALL_MAX_BYTES = 2048
REPLAY_PAGE_DEFAULT = 500
REPLAY_PAGE_MAX = 1000
# The last page lists at most this many of the thread's artifacts, and of its checkpoints
# (the oldest first); ``artifacts_more`` / ``checkpoints_more`` say when there are more.
REPLAY_RECORDS_MAX = 1000

# What a share link shows (TEN-6) is built from allowlists: a field is shown only once it is
# named here, so a field added to a record later stays out of shared views by default. No
# id of a person, token, runner, organization, project, thread, record or policy version is
# among them; within a shared replay an action is referred to by ``action_ref``, the sequence
# number of its first event in the thread.
SHARED_THREAD_FIELDS = ("title", "mode", "created_at", "last_event")
SHARED_EVENT_DATA_FIELDS = frozenset(
    {
        "tool",
        "args_digest",
        "mode",
        "flags",
        "outcome",
        "reasons",
        "state",
        "exit_code",
        "error",
        "attempt",
        "accepted",
        "steps",
    }
)
SHARED_ACTION_FIELDS = (
    "tool",
    "args",
    "args_digest",
    "action_digest",
    "mode",
    "state",
    "decision",
    "approval",
    "flags",
    "result",
    "error",
    "created_at",
    "finished_at",
)
SHARED_DECISION_FIELDS = ("outcome", "capability", "reasons")
SHARED_APPROVAL_FIELDS = ("decision", "reason", "at")
SHARED_RECEIPT_FIELDS = (
    "tool",
    "args",
    "args_digest",
    "action_digest",
    "outcome",
    "result",
    "error",
    "sandbox",
    "started_at",
    "finished_at",
)
SHARED_ARTIFACT_FIELDS = ("kind", "name", "content_type", "size", "sha256", "created_at")
SHARED_CHECKPOINT_FIELDS = ("sha256", "size", "files", "bytes", "created_at")
# Free text inside shown fields (a result's output, an error message, a reason) may still
# quote an id; in a shared view it is replaced by this.
SHARED_ID_MASK = "[id]"
_ANY_PUBLIC_ID = re.compile(
    r"(?:%s)_[0-9A-Z]{26}" % "|".join(sorted(PREFIXES))  # noqa: UP031
)


def visible_projects(*, principal, organization):
    return Project.objects.visible_to(principal, organization)


def artifacts_visible_to(queryset, *, principal, organization):
    """Artifacts in projects the principal may see (a limited member: granted ones only)."""
    return queryset.filter(
        project__in=visible_projects(principal=principal, organization=organization)
    ).select_related("project", "thread", "action")


def share_links_visible_to(queryset, *, principal, organization):
    return queryset.filter(
        project__in=visible_projects(principal=principal, organization=organization)
    ).select_related("artifact", "thread")


def share_resolve(token: str, *, now: datetime | None = None) -> ShareLink | None:
    """The live link this token opens, or None: unknown, revoked and expired look the same."""
    if not isinstance(token, str) or not token.startswith(SHARE_TOKEN_PREFIX) or len(token) > 100:
        return None
    now = now or timezone.now()
    return (
        ShareLink.objects.select_related("artifact", "thread", "organization")
        .filter(token_hash=share_token_hash(token), revoked_at__isnull=True, expires_at__gt=now)
        .first()
    )


def retention_for(organization) -> OrganizationRetention:
    """The organization's retention, or the defaults (unsaved) when it never set one."""
    return OrganizationRetention.objects.filter(
        organization=organization
    ).first() or OrganizationRetention(organization=organization)


def _only(projection: dict, fields) -> dict:
    return {name: projection[name] for name in fields if name in projection}


def shared_view(value: Any) -> Any:
    """``value`` with every public id in its strings masked: the last step of every shared
    projection, after the allowlists, for ids quoted in free text."""
    if isinstance(value, dict):
        return {key: shared_view(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [shared_view(item) for item in value]
    if isinstance(value, str):
        return _ANY_PUBLIC_ID.sub(SHARED_ID_MASK, value)
    return value


def artifact_projection(artifact: Artifact, *, shared: bool = False) -> dict:
    projection = {
        "id": artifact.public_id,
        "kind": artifact.kind,
        "name": artifact.name,
        "content_type": artifact.content_type,
        "size": artifact.size,
        "sha256": artifact.sha256,
        "created_at": artifact.created_at,
    }
    if shared:
        return shared_view(_only(projection, SHARED_ARTIFACT_FIELDS))
    projection.update(_provenance(artifact))
    return projection


def _provenance(record) -> dict:
    """Where an artifact or checkpoint came from; never shown through a share link."""
    return {
        "project": record.project.public_id,
        "thread": record.thread.public_id if record.thread_id else None,
        "action": record.action.public_id if record.action_id else None,
        "created_by": record.created_by,
    }


def checkpoint_projection(checkpoint: Checkpoint, *, shared: bool = False) -> dict:
    projection = {
        "id": checkpoint.public_id,
        "artifact": checkpoint.artifact.public_id,
        "sha256": checkpoint.artifact.sha256,
        "size": checkpoint.artifact.size,
        "files": checkpoint.files,
        "bytes": checkpoint.content_bytes,
        "created_at": checkpoint.created_at,
    }
    if shared:
        return _only(projection, SHARED_CHECKPOINT_FIELDS)
    projection.update(_provenance(checkpoint))
    return projection


def thread_replay(
    *, thread, after: int = 0, limit: int = REPLAY_PAGE_DEFAULT, shared: bool = False
) -> dict:
    """The thread's events in order, with the actions (and their decisions) and receipts
    they refer to, each redacted and bounded (AUD-5).

    Events are the spine: actions appear in the order their first event does, receipts in
    the order of the event that recorded them, so reading a finished thread twice gives the
    same sequence. Pages follow ``after`` like the events endpoint. ``shared`` is for a
    share link that grants the thread alone (TEN-6): only the allowlisted fields
    (``SHARED_*_FIELDS``) and no id at all, actions referred to by ``action_ref``.
    """
    limit = max(1, min(limit, REPLAY_PAGE_MAX))
    events = list(
        ThreadEvent.objects.filter(thread=thread, sequence__gt=after)
        .select_related("action")
        .order_by("sequence")[: limit + 1]
    )
    more = len(events) > limit
    events = events[:limit]
    action_order: list[int] = []
    for event in events:
        if event.action_id is not None and event.action_id not in action_order:
            action_order.append(event.action_id)
    # Execution's rows by relation and app label: artifacts sit below execution and import
    # none of its modules (the import-linter layers contract in pyproject.toml).
    actions = {
        action.pk: action
        for action in thread.actions.filter(pk__in=action_order).select_related(
            "approval__decided_by", "receipt"
        )
    }
    receipt_ids = [
        event.data.get("receipt")
        for event in events
        if event.kind == "action.finished" and isinstance(event.data, dict)
    ]
    receipts = {
        receipt.public_id: receipt
        for receipt in apps.get_model("execution", "Receipt").objects.filter(
            action__thread=thread, public_id__in=[r for r in receipt_ids if r]
        )
    }
    first = ThreadEvent.objects.filter(thread=thread).order_by("sequence").first()
    replay = {
        "thread": {
            "id": thread.public_id,
            "title": thread.title,
            "mode": thread.mode,
            "created_at": thread.created_at,
            "last_event": thread.last_event_sequence,
        },
        # Retention may have removed the oldest events of a thread still in use.
        "first_sequence": first.sequence if first else None,
        "events": [_event_projection(event) for event in events],
        "actions": [
            _action_projection(actions[pk], shared=shared) for pk in action_order if pk in actions
        ],
        "receipts": [
            _receipt_projection(receipts[rid], shared=shared)
            for rid in receipt_ids
            if rid in receipts
        ],
        "next_after": events[-1].sequence if more else None,
    }
    if shared:
        replay = _shared_replay(replay, thread=thread, action_ids=action_order)
    if not more:
        # Bounded like the events: a thread's records grow with every call it makes.
        artifacts = _first_records(
            thread.artifacts.select_related("project", "thread", "action").order_by("public_id")
        )
        checkpoints = _first_records(
            thread.checkpoints.select_related("artifact", "project", "thread", "action").order_by(
                "public_id"
            )
        )
        replay["artifacts"] = [
            artifact_projection(artifact, shared=shared) for artifact in artifacts[0]
        ]
        replay["artifacts_more"] = artifacts[1]
        replay["checkpoints"] = [
            checkpoint_projection(checkpoint, shared=shared) for checkpoint in checkpoints[0]
        ]
        replay["checkpoints_more"] = checkpoints[1]
    if shared:
        return shared_view(replay)
    replay["thread"]["project"] = thread.project.public_id
    return replay


def _first_records(queryset) -> tuple[list, bool]:
    """At most REPLAY_RECORDS_MAX rows of ``queryset``, and whether it holds more."""
    rows = list(queryset[: REPLAY_RECORDS_MAX + 1])
    return rows[:REPLAY_RECORDS_MAX], len(rows) > REPLAY_RECORDS_MAX


def _shared_replay(replay: dict, *, thread, action_ids: list[int]) -> dict:
    """The replay's allowlisted fields, each action named by its ``action_ref``."""
    firsts = dict(
        ThreadEvent.objects.filter(thread=thread, action_id__in=action_ids)
        .values("action_id")
        .annotate(first=Min("sequence"))
        .values_list("action_id", "first")
    )
    refs = {public_id: firsts.get(pk) for pk, public_id in _public_ids(thread, action_ids).items()}
    return {
        "thread": _only(replay["thread"], SHARED_THREAD_FIELDS),
        "first_sequence": replay["first_sequence"],
        "events": [
            {
                "sequence": event["sequence"],
                "kind": event["kind"],
                "action_ref": refs.get(event["action"]),
                "data": _only(event["data"], SHARED_EVENT_DATA_FIELDS)
                if isinstance(event["data"], dict)
                else None,
                "created_at": event["created_at"],
            }
            for event in replay["events"]
        ],
        "actions": [
            {
                "action_ref": refs.get(action["id"]),
                **_only(action, SHARED_ACTION_FIELDS),
                "decision": _only(action["decision"] or {}, SHARED_DECISION_FIELDS),
                "approval": _only(action["approval"], SHARED_APPROVAL_FIELDS)
                if action["approval"]
                else None,
            }
            for action in replay["actions"]
        ],
        "receipts": [
            {"action_ref": refs.get(receipt["call_id"]), **_only(receipt, SHARED_RECEIPT_FIELDS)}
            for receipt in replay["receipts"]
        ],
        "next_after": replay["next_after"],
    }


def _public_ids(thread, action_ids: list[int]) -> dict[int, str]:
    return dict(thread.actions.filter(pk__in=action_ids).values_list("pk", "public_id"))


def _event_projection(event) -> dict:
    return {
        "sequence": event.sequence,
        "kind": event.kind,
        "action": event.action.public_id if event.action_id else None,
        # Redacted and bounded when appended; bounded again so a replay stays bounded even
        # if the event limit is raised later.
        "data": bounded(event.data, max_bytes=REPLAY_RESULT_MAX_BYTES),
        "created_at": event.created_at,
    }


def _action_projection(action, *, shared: bool) -> dict:
    approval = getattr(action, "approval", None) if hasattr(action, "approval") else None
    projection = {
        "id": action.public_id,
        "tool": action.tool,
        "args": bounded(action.args, max_bytes=REPLAY_ARGS_MAX_BYTES),
        "args_digest": action.args_digest,
        "action_digest": action.action_digest,
        "mode": action.mode,
        "state": action.state,
        "decision": bounded(action.decision, max_bytes=REPLAY_SMALL_MAX_BYTES),
        "policy_version": action.policy_version,
        "approval": (
            {
                "decision": approval.decision,
                "reason": bounded(approval.reason, max_bytes=REPLAY_SMALL_MAX_BYTES),
                "at": approval.created_at,
            }
            if approval
            else None
        ),
        "flags": action.flags,
        "result": bounded(action.result, max_bytes=REPLAY_RESULT_MAX_BYTES),
        "error": bounded(action.error, max_bytes=REPLAY_SMALL_MAX_BYTES),
        "created_at": action.created_at,
        "finished_at": action.finished_at,
    }
    if not shared:
        projection["requested_by"] = action.requested_by
        if approval:
            projection["approval"]["by"] = approval.decided_by.public_id
    return projection


def _receipt_projection(receipt, *, shared: bool) -> dict:
    projection = {
        "id": receipt.public_id,
        "call_id": receipt.call_id,
        "tool": receipt.tool,
        "args": bounded(receipt.args, max_bytes=REPLAY_ARGS_MAX_BYTES),
        "args_digest": receipt.args_digest,
        "action_digest": receipt.action_digest,
        "outcome": receipt.outcome,
        "result": bounded(receipt.result, max_bytes=REPLAY_RESULT_MAX_BYTES),
        "error": bounded(receipt.error, max_bytes=REPLAY_SMALL_MAX_BYTES),
        "policy_version": receipt.policy_version,
        "sandbox": receipt.sandbox,
        "started_at": receipt.started_at,
        "finished_at": receipt.finished_at,
    }
    if not shared:
        projection["scope"] = receipt.scope
        projection["runner"] = receipt.runner
    return projection
