"""Twenty reservations at once against one project's budget, on PostgreSQL.

Each caller is a real thread with its own database connection and its own transaction; they
start together at a barrier. The budget has room for exactly ten of them: whatever the
interleaving, exactly ten reserve and ten are refused, and the window never holds more than
the limit. A read-then-write check would let more than ten through.
"""

from __future__ import annotations

import pytest

from kestrel_one.accounts.principal import system_principal
from kestrel_one.gateway.models import BudgetWindow, ModelUsage, UsageState
from kestrel_one.gateway.services import (
    BudgetExceeded,
    Settlement,
    budget_set,
    usage_reserve,
    usage_settle,
)
from tests.factories import EnvironmentFactory, OrganizationFactory, ProjectFactory
from tests.support import at_once

CALLERS = 20
TOKENS = 100


def _project(per_day, per_month):
    organization = OrganizationFactory(slug="budgeted")
    environment = EnvironmentFactory(organization=organization, name="prod")
    project = ProjectFactory(organization=organization, environment=environment, name="p")
    budget_set(
        actor=system_principal("tests"),
        project=project,
        tokens_per_day=per_day,
        tokens_per_month=per_month,
    )
    return project


def _reserve(project):
    def work(number: int) -> str:
        try:
            usage_reserve(
                project=project,
                surface="tool",
                provider="openai",
                model="gpt-4o-mini",
                tokens=TOKENS,
                requested_by=f"caller-{number}",
            )
        except BudgetExceeded:
            return "refused"
        return "reserved"

    return work


@pytest.mark.parametrize("per_day, per_month", [(1000, None), (None, 1000), (5000, 1000)])
@pytest.mark.django_db(transaction=True)
def test_twenty_concurrent_reservations_never_overrun_the_budget(per_day, per_month):
    project = _project(per_day, per_month)
    outcomes = at_once(CALLERS, _reserve(project))
    assert outcomes.count("reserved") == 10
    assert outcomes.count("refused") == 10
    for window in BudgetWindow.objects.filter(project=project):
        assert window.used == 0
        assert window.reserved == 10 * TOKENS
    assert ModelUsage.objects.filter(project=project, state=UsageState.RESERVED).count() == 10


@pytest.mark.django_db(transaction=True)
def test_twenty_concurrent_calls_settled_with_usage_stay_within_the_budget():
    """Reserve, then settle with the provider's usage (less than reserved), twenty at once:
    what is charged never passes the limit, and every reservation is released."""
    project = _project(1000, None)

    def work(number: int) -> str:
        try:
            usage = usage_reserve(
                project=project,
                surface="tool",
                provider="openai",
                model="gpt-4o-mini",
                tokens=TOKENS,
                requested_by=f"caller-{number}",
            )
        except BudgetExceeded:
            return "refused"
        usage_settle(
            usage=usage,
            settlement=Settlement(outcome="succeeded", input_tokens=30, output_tokens=40),
        )
        return "settled"

    outcomes = at_once(CALLERS, work)
    window = BudgetWindow.objects.get(project=project, period="day")
    settled = outcomes.count("settled")
    assert settled >= 10  # released reservations make room for some of the late callers
    assert window.reserved == 0
    assert window.used == settled * 70
    assert window.used <= 1000
