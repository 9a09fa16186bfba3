"""Reads of actions that the console and the API share."""

from __future__ import annotations

from collections import Counter

from django.db.models import Count, QuerySet

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


def thread_actions(thread) -> QuerySet[Action]:
    """A thread's actions with what their projection (``ActionSerializer``) reads, joined."""
    return Action.objects.filter(thread=thread).select_related(
        "thread", "plan", "receipt", "approval__decided_by"
    )


def plan_step_uses(plans) -> dict[int, Counter]:
    """Plan pk -> how many actions have named each of its steps, for all ``plans`` in one
    aggregate query (a plan's projection shows each step's ``used``)."""
    uses: dict[int, Counter] = {plan.pk: Counter() for plan in plans}
    rows = (
        Action.objects.filter(plan__in=[plan.pk for plan in plans])
        .values("plan_id", "plan_step")
        .annotate(count=Count("pk"))
        .order_by()
    )
    for row in rows:
        uses[row["plan_id"]][row["plan_step"]] = row["count"]
    return uses
