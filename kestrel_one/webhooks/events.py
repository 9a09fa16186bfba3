"""The public webhook event types, and how internal events become them.

Internal thread-event kinds are free to change; these names and payload shapes are a public
contract (docs/webhooks.md), versioned by ``SCHEMA_VERSION``. Payloads carry identifiers and
API links only: never arguments, results, error messages, reasons or anything a person typed,
because those are where secrets and bulk live.
"""

from __future__ import annotations

import re

SCHEMA_VERSION = 1

EVENT_TYPES: dict[str, str] = {
    "action.awaiting_approval": "An action needs a person's approval before it can run.",
    "action.approved": "A person approved an action; it is queued to run.",
    "action.denied": "Policy or a person denied an action; it will not run.",
    "action.succeeded": "An action finished and its tool succeeded.",
    "action.failed": "An action finished and failed (including a lost runner).",
    "action.expired": "An action expired: nobody approved it, or no runner took it, in time.",
    "action.cancelled": "An action was cancelled before it finished.",
    "plan.accepted": "A person accepted a plan, which makes its steps executable.",
    "policy.published": "A new policy version was published for an environment or project.",
    "webhook.disabled": "The service disabled one of the organization's webhook endpoints.",
}

PUBLIC_ID = re.compile(r"[a-z]{3}_[0-9A-Z]{26}")
_FINISHED_STATES = {"succeeded", "failed", "expired", "cancelled"}
# Identifier fields copied from an internal event's data when present (never free text).
_ID_FIELDS = ("approval", "plan", "receipt")


def public_event_type(kind: str, data: dict) -> str | None:
    """The public type for an internal thread-event kind, or None when it is not published."""
    if kind == "action.decided":
        return {"needs_approval": "action.awaiting_approval", "deny": "action.denied"}.get(
            data.get("outcome")
        )
    if kind == "action.finished":
        state = data.get("state")
        return f"action.{state}" if state in _FINISHED_STATES else None
    if kind in {"action.approved", "action.denied", "action.expired", "plan.accepted"}:
        return kind
    return None


def _id_fields(data: dict) -> dict:
    return {
        name: data[name]
        for name in _ID_FIELDS
        if isinstance(data.get(name), str) and PUBLIC_ID.fullmatch(data[name])
    }


# The action's state each public type implies. The action object handed to event_append can
# predate the UPDATE that moved it, so its own ``state`` is not trusted here.
_ACTION_STATE = {
    "action.awaiting_approval": "awaiting_approval",
    "action.approved": "queued",
    "action.denied": "denied",
    "action.succeeded": "succeeded",
    "action.failed": "failed",
    "action.expired": "expired",
    "action.cancelled": "cancelled",
}


def thread_event_payload(event, event_type: str) -> dict:
    """Identifiers and links for a thread event: organization, project, thread, action."""
    thread = event.thread
    project = thread.project
    organization = thread.organization
    thread_path = (
        f"/api/v1/orgs/{organization.slug}/projects/{project.public_id}/threads/{thread.public_id}"
    )
    payload = {
        "environment": project.environment.public_id,
        "project": project.public_id,
        "thread": thread.public_id,
        "links": {"thread": thread_path},
        **_id_fields(event.data or {}),
    }
    action = event.action
    if action is not None:
        action_path = f"{thread_path}/actions/{action.public_id}"
        payload["action"] = {
            "id": action.public_id,
            "tool": action.tool,
            "state": _ACTION_STATE.get(event_type, action.state),
        }
        payload["links"]["action"] = action_path
        if "receipt" in payload:
            payload["links"]["receipt"] = f"{action_path}/receipt"
        error = event.data.get("error") if isinstance(event.data, dict) else None
        if isinstance(error, dict) and isinstance(error.get("code"), str):
            payload["error_code"] = error["code"][:64]
    if "plan" in payload:
        payload["links"]["plan"] = f"{thread_path}/plans/{payload['plan']}"
    return payload


def policy_published_payload(*, owner, version, previous) -> dict:
    """Which environment or project, which version replaced which, and where to read it."""
    organization = owner.organization
    kind = "environment" if owner._meta.model_name == "environment" else "project"
    return {
        kind: owner.public_id,
        "policy": {
            "version": version.public_id,
            "sha256": version.sha256,
            "previous_version": previous.public_id if previous else None,
        },
        "links": {
            "policy": f"/api/v1/orgs/{organization.slug}/{kind}s/{owner.public_id}/policy",
        },
    }


def endpoint_disabled_payload(endpoint, *, reason: str) -> dict:
    return {
        "webhook": endpoint.public_id,
        "reason": reason,
        "links": {
            "webhook": f"/api/v1/orgs/{endpoint.organization.slug}/webhooks/{endpoint.public_id}"
        },
    }
