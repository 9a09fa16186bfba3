"""Reads of actions and plans that the console and the API share."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta

from django.conf import settings
from django.db.models import Count, QuerySet
from django.utils import timezone

from kestrel_one.execution.models import Action, ActionState, Plan
from kestrel_one.tenancy.models import Project
from kestrel_one.threads.models import Thread


def actions_visible_to(*, principal, organization) -> QuerySet[Action]:
    """The organization's actions in the projects this principal may see."""
    return Action.objects.filter(
        organization=organization,
        project__in=Project.objects.visible_to(principal, organization),
    )


def plans_visible_to(*, principal, organization) -> QuerySet[Plan]:
    """The organization's plans in threads of the projects this principal may see."""
    return Plan.objects.filter(
        organization=organization,
        thread__project__in=Project.objects.visible_to(principal, organization),
    )


def _may_decide(principal, organization) -> bool:
    """Only a person holding ``actions:approve`` decides (``approvals.require_person``): an
    integration token or the local agent never does, whatever its scopes."""
    return principal.is_person and "actions:approve" in principal.scopes_in(organization)


def actions_awaiting_decision(*, principal, organization) -> QuerySet[Action]:
    """Actions this principal could approve now, newest first: awaiting approval in projects
    it may see, when it is a person holding ``actions:approve``, never what a token of its
    own lineage requested, and only while ``approvals.approval_decide`` would take the
    approval (the window ``KESTREL_APPROVAL_TTL_SECONDS`` still open, the thread open).

    A policy published since the request is the one refusal left to the decision itself:
    it needs the policy judged again (``approvals._policy_unchanged``)."""
    if not _may_decide(principal, organization):
        return Action.objects.none()
    window = timedelta(seconds=settings.KESTREL_APPROVAL_TTL_SECONDS)
    queryset = actions_visible_to(principal=principal, organization=organization).filter(
        state=ActionState.AWAITING_APPROVAL,
        created_at__gte=timezone.now() - window,
        thread__status=Thread.Status.OPEN,
    )
    if principal.lineage:
        queryset = queryset.exclude(requested_by_lineage=principal.lineage)
    return queryset.order_by("-created_at", "-pk")


def plans_awaiting_acceptance(*, principal, organization) -> QuerySet[Plan]:
    """Proposed plans this principal could accept now (``plans.plan_accept``), newest first:
    the same person rules as actions, in open threads."""
    if not _may_decide(principal, organization):
        return Plan.objects.none()
    queryset = plans_visible_to(principal=principal, organization=organization).filter(
        state="proposed", thread__status=Thread.Status.OPEN
    )
    if principal.lineage:
        queryset = queryset.exclude(proposed_by_lineage=principal.lineage)
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
