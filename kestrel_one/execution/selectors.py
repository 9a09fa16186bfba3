"""Reads of actions that the console and the API share."""

from __future__ import annotations

from django.db.models import QuerySet

from kestrel_one.execution.models import Action, ActionState
from kestrel_one.tenancy.models import Project


def actions_awaiting_decision(*, principal, organization) -> QuerySet[Action]:
    """Actions waiting for a decision that this principal could give: in projects it may
    see, only when it holds ``actions:approve``, and never what a token of its own lineage
    requested (``approvals.require_person`` refuses those). Newest first."""
    if "actions:approve" not in principal.scopes_in(organization):
        return Action.objects.none()
    queryset = Action.objects.filter(
        organization=organization,
        state=ActionState.AWAITING_APPROVAL,
        project__in=Project.objects.visible_to(principal, organization),
    )
    if principal.lineage:
        queryset = queryset.exclude(requested_by_lineage=principal.lineage)
    return queryset.order_by("-created_at", "-pk")
