"""Writes of the model gateway: budgets, and the reserve / settle / expire cycle of a call.

A reservation is the call's upper bound of tokens (its prompt's UTF-8 bytes plus a little
per message, plus the ``max_tokens`` the provider is held to), taken in the project's day
and month windows by one conditional UPDATE each, in that order, in one transaction: either
both take it or neither does. PostgreSQL re-evaluates an UPDATE's WHERE clause against the
row version it finally locks, so N concurrent reservations see each other's committed
totals and no set of them can go past a limit (tests/gateway/test_budget_concurrency.py).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from dataclasses import dataclass

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from kestrel_one.accounts.principal import system_principal
from kestrel_one.audit.services import audit_record
from kestrel_one.common.errors import KestrelError, ValidationFailed
from kestrel_one.gateway.models import (
    BudgetPeriod,
    BudgetWindow,
    ModelBudget,
    ModelUsage,
    UsageState,
)

# A budget above this is a typo, not a plan (and stays far inside a bigint with reservations).
MAX_BUDGET_TOKENS = 10**15


class BudgetExceeded(KestrelError):
    """The call's reservation does not fit in what is left of the project's budget."""

    code = "budget_exceeded"
    status = 429


@dataclass(frozen=True)
class Limits:
    """The limits a project's calls are held to now; None is no limit on that period."""

    tokens_per_day: int | None
    tokens_per_month: int | None


def budget_limits(project) -> Limits:
    """The project's own budget, or the operator's default for projects without one."""
    budget = ModelBudget.objects.filter(project=project).first()
    if budget is not None:
        return Limits(budget.tokens_per_day, budget.tokens_per_month)
    return Limits(
        settings.KESTREL_GATEWAY_DEFAULT_TOKENS_PER_DAY,
        settings.KESTREL_GATEWAY_DEFAULT_TOKENS_PER_MONTH,
    )


def periods_of(moment: dt.datetime) -> tuple[dt.date, dt.date]:
    """The UTC day and the first day of the UTC month ``moment`` falls in."""
    day = moment.astimezone(dt.UTC).date()
    return day, day.replace(day=1)


def _check_limit(value, field: str) -> int | None:
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_BUDGET_TOKENS:
        raise ValidationFailed(
            f"{field} must be a whole number of tokens from 0 to {MAX_BUDGET_TOKENS}, or empty "
            "for no limit.",
            details={field: ["invalid"]},
        )
    return value


@transaction.atomic
def budget_set(*, actor, project, tokens_per_day, tokens_per_month) -> ModelBudget:
    """Set a project's token budget (None on a period: no limit). Audited. Lowering a limit
    under what is already used refuses the next calls; it takes back nothing."""
    per_day = _check_limit(tokens_per_day, "tokens_per_day")
    per_month = _check_limit(tokens_per_month, "tokens_per_month")
    budget, _ = ModelBudget.objects.select_for_update().get_or_create(
        project=project,
        defaults={"organization": project.organization, "updated_by": actor.actor_id},
    )
    # Keys without "token" in them: redaction masks the values of secret-like keys.
    before = {"per_day": budget.tokens_per_day, "per_month": budget.tokens_per_month}
    budget.tokens_per_day = per_day
    budget.tokens_per_month = per_month
    budget.updated_by = actor.actor_id
    budget.save()
    audit_record(
        organization=project.organization,
        actor=actor,
        action="gateway.budget.set",
        target=project,
        data={
            "before": before,
            "after": {"per_day": per_day, "per_month": per_month},
        },
    )
    return budget


def reservation_tokens(*, messages: list[dict], max_tokens: int) -> int:
    """An upper bound of the tokens a call can use: every token of the providers' tokenizers
    covers at least one byte of text, so the prompt's bytes bound its tokens; each message
    adds a few tokens of framing; the output is held to ``max_tokens``."""
    prompt = sum(len(str(m.get("content", "")).encode()) + 8 for m in messages)
    return prompt + 16 + max_tokens


@transaction.atomic
def usage_reserve(
    *,
    project,
    surface: str,
    provider: str,
    model: str,
    tokens: int,
    requested_by: str,
    policy_version: str = "",
    action=None,
    stream: bool = False,
    now: dt.datetime | None = None,
) -> ModelUsage:
    """Reserve ``tokens`` in the project's day and month windows, or raise BudgetExceeded.

    Nothing is reserved when either window lacks room (the transaction rolls back)."""
    now = now or timezone.now()
    day, month = periods_of(now)
    taken = _take(project, day, month, tokens)
    if taken.day and not taken.month and not _window_exists(project, BudgetPeriod.MONTH, month):
        # The month's first call (the day's row was there): make its row, take it there.
        _windows_make(project, ((BudgetPeriod.MONTH, month),))
        taken = dataclasses.replace(taken, month=_take_month(project, month, taken, tokens))
    elif not taken.day and not _window_exists(project, BudgetPeriod.DAY, day):
        # The day's first call: make the rows, then take them.
        _windows_make(project, ((BudgetPeriod.DAY, day), (BudgetPeriod.MONTH, month)))
        taken = _take(project, day, month, tokens)
    for period, ok, limit in (
        (BudgetPeriod.DAY, taken.day, taken.per_day),
        (BudgetPeriod.MONTH, taken.month, taken.per_month),
    ):
        if not ok:
            # Raised inside the transaction: whatever the other window took is rolled back.
            raise BudgetExceeded(
                f"This call would need up to {tokens} tokens, more than is left of the "
                f"project's {period} budget ({limit} tokens per {period}). Ask an admin to "
                "raise it, or send a smaller max_tokens.",
                details={"period": period, "limit": limit, "reservation": tokens},
            )
    return ModelUsage.objects.create(
        organization=project.organization,
        project=project,
        action=action,
        surface=surface,
        provider=provider,
        model=model,
        stream=stream,
        requested_by=requested_by,
        policy_version=policy_version,
        state=UsageState.RESERVED,
        day=day,
        month=month,
        reserved_tokens=tokens,
        expires_at=now + dt.timedelta(seconds=settings.KESTREL_GATEWAY_RESERVATION_SECONDS),
    )


@dataclass(frozen=True)
class _Taken:
    day: bool
    month: bool
    per_day: int | None
    per_month: int | None


# One statement: the project's limits (its budget, else the operator's default), then the
# day's window and, only if that took, the month's, each a conditional UPDATE that
# PostgreSQL re-checks on the row it locks. The month's UPDATE reads the day's result, so
# the day's row is always locked first (one order for every reservation: no deadlock).
_TAKE_SQL = """
WITH lim AS (
    SELECT CASE WHEN b.id IS NULL THEN %(default_day)s::bigint ELSE b.tokens_per_day END
               AS per_day,
           CASE WHEN b.id IS NULL THEN %(default_month)s::bigint ELSE b.tokens_per_month END
               AS per_month
    FROM (SELECT 1) AS one LEFT JOIN {budget} b ON b.project_id = %(project)s
), d AS (
    UPDATE {window} w SET reserved = w.reserved + %(tokens)s FROM lim
    WHERE w.project_id = %(project)s AND w.period = 'day' AND w.starts_on = %(day)s
      AND (lim.per_day IS NULL OR w.used + w.reserved + %(tokens)s <= lim.per_day)
    RETURNING w.id
), m AS (
    UPDATE {window} w SET reserved = w.reserved + %(tokens)s FROM lim
    WHERE w.project_id = %(project)s AND w.period = 'month' AND w.starts_on = %(month)s
      AND (lim.per_month IS NULL OR w.used + w.reserved + %(tokens)s <= lim.per_month)
      AND EXISTS (SELECT 1 FROM d)
    RETURNING w.id
)
SELECT (SELECT count(*) FROM d), (SELECT count(*) FROM m), lim.per_day, lim.per_month
FROM lim
"""


def _take(project, day: dt.date, month: dt.date, tokens: int) -> _Taken:
    """Take ``tokens`` in the day's window, then the month's, where they fit."""
    connection = transaction.get_connection()
    if connection.vendor != "postgresql":
        # SQLite (single host): its writing transactions begin IMMEDIATE (settings), so
        # they run one at a time, and the same conditional UPDATEs, one per window, do.
        limits = budget_limits(project)
        took_day = _take_one(project, BudgetPeriod.DAY, day, limits.tokens_per_day, tokens)
        took_month = took_day and _take_one(
            project, BudgetPeriod.MONTH, month, limits.tokens_per_month, tokens
        )
        return _Taken(took_day, took_month, limits.tokens_per_day, limits.tokens_per_month)
    quote = connection.ops.quote_name
    sql = _TAKE_SQL.format(
        budget=quote(ModelBudget._meta.db_table), window=quote(BudgetWindow._meta.db_table)
    )
    with connection.cursor() as cursor:
        cursor.execute(
            sql,
            {
                "project": project.pk,
                "day": day,
                "month": month,
                "tokens": tokens,
                "default_day": settings.KESTREL_GATEWAY_DEFAULT_TOKENS_PER_DAY,
                "default_month": settings.KESTREL_GATEWAY_DEFAULT_TOKENS_PER_MONTH,
            },
        )
        took_day, took_month, per_day, per_month = cursor.fetchone()
    return _Taken(took_day == 1, took_month == 1, per_day, per_month)


def _take_month(project, month: dt.date, taken: _Taken, tokens: int) -> bool:
    return _take_one(project, BudgetPeriod.MONTH, month, taken.per_month, tokens)


def _take_one(project, period: str, starts_on: dt.date, limit: int | None, tokens: int) -> bool:
    """One window's conditional UPDATE: ``tokens`` reserved if they fit under ``limit``."""
    rows = BudgetWindow.objects.filter(project=project, period=period, starts_on=starts_on)
    if limit is not None:
        rows = rows.alias(committed=F("used") + F("reserved")).filter(committed__lte=limit - tokens)
    return rows.update(reserved=F("reserved") + tokens) == 1


def _window_exists(project, period: str, starts_on: dt.date) -> bool:
    return BudgetWindow.objects.filter(project=project, period=period, starts_on=starts_on).exists()


def _windows_make(project, windows) -> None:
    BudgetWindow.objects.bulk_create(
        [
            BudgetWindow(
                organization_id=project.organization_id,
                project=project,
                period=period,
                starts_on=starts_on,
            )
            for period, starts_on in windows
        ],
        # Another call may be making them at the same moment: then they are that one's rows.
        ignore_conflicts=True,
    )


def _release(usage: ModelUsage, charged: int) -> None:
    for period, starts_on in ((BudgetPeriod.DAY, usage.day), (BudgetPeriod.MONTH, usage.month)):
        BudgetWindow.objects.filter(
            project_id=usage.project_id, period=period, starts_on=starts_on
        ).update(reserved=F("reserved") - usage.reserved_tokens, used=F("used") + charged)


@dataclass(frozen=True)
class Settlement:
    """What a finished call reports: the provider's usage (None when it reported none) and
    how the call ended. ``charge_reservation``: no usage is known but the provider may have
    done the work (a timeout after sending, a stream cut short), so the whole reservation
    is charged."""

    outcome: str
    input_tokens: int | None = None
    output_tokens: int | None = None
    charge_reservation: bool = False
    upstream_status: int | None = None
    error_code: str = ""
    credential: str = ""
    request_bytes: int = 0
    request_sha256: str = ""
    response_bytes: int = 0
    response_sha256: str = ""
    duration_ms: int | None = None

    def charged(self, reserved: int) -> int:
        """The provider's reported usage; the whole reservation when ``charge_reservation``
        and the call failed (a partial report undercounts) or reported nothing."""
        reported = (self.input_tokens or 0) + (self.output_tokens or 0)
        unreported = self.input_tokens is None and self.output_tokens is None
        if self.charge_reservation and (unreported or self.outcome != "succeeded"):
            return max(reserved, reported)
        return reported


@transaction.atomic
def usage_settle(*, usage: ModelUsage, settlement: Settlement, actor=None) -> ModelUsage | None:
    """Release the reservation and charge what the provider reported, once: None when the
    reservation was already settled or expired (then nothing changes)."""
    fields = {
        "state": UsageState.SETTLED,
        "settled_at": timezone.now(),
        "charged_tokens": settlement.charged(usage.reserved_tokens),
        "input_tokens": settlement.input_tokens,
        "output_tokens": settlement.output_tokens,
        "outcome": settlement.outcome,
        "upstream_status": settlement.upstream_status,
        "error_code": settlement.error_code[:40],
        "credential": settlement.credential,
        "request_bytes": settlement.request_bytes,
        "request_sha256": settlement.request_sha256,
        "response_bytes": settlement.response_bytes,
        "response_sha256": settlement.response_sha256,
        "duration_ms": settlement.duration_ms,
    }
    claimed = ModelUsage.objects.filter(pk=usage.pk, state=UsageState.RESERVED).update(**fields)
    if claimed != 1:
        return None
    _release(usage, fields["charged_tokens"])
    # The row now holds exactly these values; no need to read it back.
    for name, value in fields.items():
        setattr(usage, name, value)
    if actor is not None:
        audit_record(
            organization=usage.organization,
            actor=actor,
            action="model.invoke",
            target=usage,
            outcome="success" if settlement.outcome == "succeeded" else "failure",
            data=usage_audit_data(usage),
        )
    return usage


def usage_audit_data(usage: ModelUsage) -> dict:
    """What audit keeps of a call: who, which model, tokens, sizes and hashes; no content."""
    # Token counts under "usage" as input/output/charged: a key naming "token" is masked.
    return {
        "record": usage.public_id,
        "project": usage.project.public_id,
        "surface": usage.surface,
        "model": f"{usage.provider}/{usage.model}",
        "stream": usage.stream,
        "policy_version": usage.policy_version,
        "outcome": usage.outcome,
        "upstream_status": usage.upstream_status,
        "error_code": usage.error_code,
        "credential": usage.credential,
        "usage": {
            "input": usage.input_tokens,
            "output": usage.output_tokens,
            "reserved": usage.reserved_tokens,
            "charged": usage.charged_tokens,
        },
        "request_bytes": usage.request_bytes,
        "request_sha256": usage.request_sha256,
        "response_bytes": usage.response_bytes,
        "response_sha256": usage.response_sha256,
    }


def usage_reservations_expire(*, now: dt.datetime | None = None) -> int:
    """Charge in full and release every reservation past its expiry (its worker died or
    hung: the provider may have done the work, and a budget must not be overrun by a crash).
    How many. Each in its own transaction, claimed by a conditional UPDATE, so a settle that
    races the sweep wins or loses whole."""
    now = now or timezone.now()
    expired = 0
    stale = ModelUsage.objects.filter(state=UsageState.RESERVED, expires_at__lt=now)
    for usage in stale.select_related("project", "organization").order_by("pk")[:1000]:
        with transaction.atomic():
            claimed = ModelUsage.objects.filter(pk=usage.pk, state=UsageState.RESERVED).update(
                state=UsageState.EXPIRED,
                settled_at=now,
                charged_tokens=usage.reserved_tokens,
                outcome="expired",
            )
            if claimed != 1:
                continue
            _release(usage, usage.reserved_tokens)
            usage.refresh_from_db()
            audit_record(
                organization=usage.organization,
                actor=system_principal("gateway"),
                action="model.reservation.expire",
                target=usage,
                outcome="failure",
                data=usage_audit_data(usage),
            )
            expired += 1
    return expired
