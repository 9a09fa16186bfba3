"""Preview against history: the recorded decisions a policy draft would change.

Each recorded action of the last days (in the environment or project the draft is for, in
projects the person may see) is decided again, with the engine's ``decide_call`` as it was
first decided: its exact arguments (``action_arguments``), its mode, the surface it came
through (with the organization's current policy for that surface), and the layers with the
draft in place of one of them. Where the outcome differs from the recorded
one (allowed -> denied, needs approval -> allowed, ...) the action is listed. The token scope
is not replayed: an action was only ever recorded for a caller allowed to request it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from django.utils import timezone

from kestrel_one.common.errors import ValidationFailed
from kestrel_one.common.redaction import redact
from kestrel_one.execution.arguments import action_arguments
from kestrel_one.execution.models import Action
from kestrel_one.governance.judging import decide_call, tool_call_request
from kestrel_one.governance.selectors import (
    SURFACES,
    environment_ceiling,
    policy_of,
    surface_policy,
    surface_version_current,
)
from kestrel_one.tenancy.models import Project
from policies import Mode, Policy, meet_all, mode_mask

PREVIEW_VERSION = "draft"
# The most changed decisions a preview lists (all of them are counted).
SHOWN_CHANGES = 200


@dataclass(frozen=True)
class ChangedDecision:
    """A recorded action whose outcome the draft would change, and the draft's reasons."""

    action: Action
    recorded: str
    draft: str
    # Redacted like the recorded reasons (they may quote a path or a program).
    reasons: tuple[str, ...]


@dataclass
class Preview:
    days: int
    limit: int
    considered: int = 0
    changed_count: int = 0
    # Actions whose arguments the tool registry no longer accepts (a tool removed since).
    unreplayable: int = 0
    changed: list[ChangedDecision] = field(default_factory=list)

    @property
    def truncated(self) -> bool:
        """Whether the limit cut the window short (older actions were not replayed)."""
        return self.considered >= self.limit


def decisions_preview(
    *,
    principal,
    organization,
    days: int,
    limit: int,
    environment=None,
    project=None,
    environment_draft: Policy | None = None,
    project_draft: Policy | None = None,
) -> Preview:
    """Replay the newest ``limit`` actions of the last ``days`` in ``environment`` (with
    ``environment_draft`` as its ceiling) or in ``project`` (with ``project_draft`` as its
    own policy) and report those whose outcome would change."""
    since = timezone.now() - timedelta(days=days)
    actions = Action.objects.filter(
        organization=organization,
        created_at__gte=since,
        project__in=Project.objects.visible_to(principal, organization).values("pk"),
    )
    if project is not None:
        actions = actions.filter(project=project)
    else:
        actions = actions.filter(environment=environment)
    actions = actions.select_related(
        "project__policy_version", "project__environment__policy_version"
    ).order_by("-created_at", "-pk")[:limit]
    preview = Preview(days=days, limit=limit)
    layered: dict[tuple[int, str, str], Policy] = {}
    # Each surface's current policy, read once: what a decision now would meet.
    surfaces = {
        surface: surface_policy(surface_version_current(organization, surface))
        for surface in SURFACES
    }
    for action in actions:
        preview.considered += 1
        try:
            mode = Mode(action.mode)
            on_surface = surfaces[action.surface]
            _, canonical, request = tool_call_request(action.tool, action_arguments(action))
        except (KeyError, ValueError, ValidationFailed):
            preview.unreplayable += 1
            continue
        key = (action.project_id, mode.value, action.surface)
        if key not in layered:
            layered[key] = _effective(
                action.project, mode, on_surface, environment_draft, project_draft
            )
        decision = decide_call(layered[key], request, canonical, version=PREVIEW_VERSION, mode=mode)
        recorded = (action.decision or {}).get("outcome", "")
        if decision.outcome == recorded:
            continue
        preview.changed_count += 1
        if len(preview.changed) < SHOWN_CHANGES:
            preview.changed.append(
                ChangedDecision(
                    action=action,
                    recorded=recorded,
                    draft=decision.outcome,
                    reasons=tuple(redact(list(decision.reasons))),
                )
            )
    return preview


def _effective(
    project,
    mode: Mode,
    on_surface: Policy,
    environment_draft: Policy | None,
    project_draft: Policy | None,
) -> Policy:
    environment = environment_draft or environment_ceiling(project.environment)
    own = project_draft if project_draft is not None else policy_of(project.policy_version)
    layers = [environment] if own is None else [environment, own]
    return meet_all(*layers, on_surface, mode_mask(mode))
