"""Reservations settle once, and one nobody settles expires and is charged in full."""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone

from kestrel_one.accounts.principal import system_principal
from kestrel_one.audit.models import AuditRecord
from kestrel_one.gateway.models import BudgetWindow, ModelUsage, UsageState
from kestrel_one.gateway.services import (
    BudgetExceeded,
    Settlement,
    budget_set,
    usage_reservations_expire,
    usage_reserve,
    usage_settle,
)
from tests.factories import EnvironmentFactory, OrganizationFactory, ProjectFactory


@pytest.fixture
def project(db):
    organization = OrganizationFactory(slug="ledger")
    environment = EnvironmentFactory(organization=organization, name="prod")
    return ProjectFactory(organization=organization, environment=environment, name="books")


def reserve(project, tokens=100, **kwargs):
    return usage_reserve(
        project=project,
        surface="tool",
        provider="openai",
        model="gpt-4o-mini",
        tokens=tokens,
        requested_by="tests",
        **kwargs,
    )


def totals(project, period="day"):
    window = BudgetWindow.objects.get(project=project, period=period)
    return window.used, window.reserved


def test_a_settled_call_is_charged_its_usage_once(project):
    usage = reserve(project)
    assert totals(project) == (0, 100)
    done = Settlement(outcome="succeeded", input_tokens=10, output_tokens=20)
    assert usage_settle(usage=usage, settlement=done) is not None
    assert usage_settle(usage=usage, settlement=done) is None  # the second changes nothing
    assert totals(project) == totals(project, "month") == (30, 0)


def test_a_reservation_nobody_settles_expires_charged_in_full(project):
    usage = reserve(project)
    assert usage_reservations_expire() == 0  # not yet expired
    later = timezone.now() + dt.timedelta(hours=1)
    assert usage_reservations_expire(now=later) == 1
    usage.refresh_from_db()
    assert (usage.state, usage.charged_tokens, usage.outcome) == (
        UsageState.EXPIRED,
        100,
        "expired",
    )
    assert totals(project) == (100, 0)
    assert AuditRecord.objects.filter(action="model.reservation.expire").count() == 1
    # The worker that comes back late settles nothing.
    late = Settlement(outcome="succeeded", input_tokens=1, output_tokens=1)
    assert usage_settle(usage=usage, settlement=late) is None
    assert totals(project) == (100, 0)


def test_a_zero_budget_allows_nothing_and_no_budget_no_limit(project):
    reserve(project, tokens=10**9)  # no budget set: no limit
    budget_set(
        actor=system_principal("tests"), project=project, tokens_per_day=0, tokens_per_month=None
    )
    with pytest.raises(BudgetExceeded):
        reserve(project, tokens=1)


def test_a_refused_reservation_takes_nothing_from_either_window(project):
    budget_set(
        actor=system_principal("tests"), project=project, tokens_per_day=1000, tokens_per_month=150
    )
    reserve(project, tokens=100)
    with pytest.raises(BudgetExceeded) as refused:
        reserve(project, tokens=100)  # fits the day, not the month
    assert refused.value.details["period"] == "month"
    assert totals(project) == totals(project, "month") == (0, 100)
    assert ModelUsage.objects.filter(project=project).count() == 1


def test_a_reservation_settles_in_the_windows_it_was_taken_in(project):
    yesterday = timezone.now() - dt.timedelta(days=1)
    usage = reserve(project, now=yesterday)
    usage_settle(
        usage=usage, settlement=Settlement(outcome="succeeded", input_tokens=5, output_tokens=5)
    )
    window = BudgetWindow.objects.get(project=project, period="day", starts_on=usage.day)
    assert (window.used, window.reserved) == (10, 0)
    assert not BudgetWindow.objects.filter(
        project=project, period="day", starts_on=timezone.now().date()
    ).exists()


@pytest.mark.parametrize("value", [-1, 1.5, "many", True, 10**16])
def test_a_budget_must_be_a_whole_number_of_tokens(project, value):
    from kestrel_one.common.errors import ValidationFailed

    with pytest.raises(ValidationFailed):
        budget_set(
            actor=system_principal("tests"),
            project=project,
            tokens_per_day=value,
            tokens_per_month=None,
        )
