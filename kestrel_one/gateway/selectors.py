"""Reads of the model gateway: a project's budget as it stands, and its recent calls."""

from __future__ import annotations

from django.db.models import QuerySet
from django.utils import timezone

from kestrel_one.gateway.models import BudgetPeriod, BudgetWindow, ModelBudget, ModelUsage
from kestrel_one.gateway.services import budget_limits, periods_of


def budget_view(project) -> dict:
    """The project's limits (its own, or the operator's default), and this UTC day's and
    month's used and reserved tokens."""
    day, month = periods_of(timezone.now())
    limits = budget_limits(project)
    windows = {
        (w.period, w.starts_on): w
        for w in BudgetWindow.objects.filter(
            project=project, starts_on__in=[day, month], period__in=list(BudgetPeriod)
        )
    }
    own = ModelBudget.objects.filter(project=project).exists()

    def period(name: str, starts_on, limit) -> dict:
        window = windows.get((name, starts_on))
        used = window.used if window else 0
        reserved = window.reserved if window else 0
        return {
            "starts_on": starts_on.isoformat(),
            "limit": limit,
            "used": used,
            "reserved": reserved,
            "left": None if limit is None else max(limit - used - reserved, 0),
        }

    return {
        "project": project.public_id,
        "source": "project" if own else "default",
        "tokens_per_day": limits.tokens_per_day,
        "tokens_per_month": limits.tokens_per_month,
        "day": period(BudgetPeriod.DAY, day, limits.tokens_per_day),
        "month": period(BudgetPeriod.MONTH, month, limits.tokens_per_month),
    }


def usages_of(project) -> QuerySet[ModelUsage]:
    """The project's model calls, newest first."""
    return ModelUsage.objects.filter(project=project).order_by("-created_at", "-id")
