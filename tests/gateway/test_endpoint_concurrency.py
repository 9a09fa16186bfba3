"""Twenty model calls at once through the endpoint, against PostgreSQL and the test upstream.

Each caller is a real thread with its own database connection; every call goes to the
upstream over TLS. The budget has room for the reservations of exactly five calls at a
time; reservations settled early make room for later ones, so more may succeed, but what
is charged never passes the limit, every refused call reached no provider, and nothing stays
reserved.
"""

from __future__ import annotations

import json
import threading

import pytest
from django.db import connection

from kestrel_one.accounts.principal import system_principal
from kestrel_one.gateway.models import BudgetWindow, ModelUsage
from kestrel_one.gateway.services import budget_set, reservation_tokens
from tests.gateway.conftest import gateway_world_make

CALLERS = 20
MESSAGES = [{"role": "user", "content": "Count the boosters"}]
MAX_TOKENS = 100


@pytest.mark.django_db(transaction=True)
def test_the_budget_holds_under_twenty_concurrent_model_calls(upstream):
    world = gateway_world_make(upstream)
    reservation = reservation_tokens(messages=MESSAGES, max_tokens=MAX_TOKENS)
    limit = 5 * reservation
    budget_set(
        actor=system_principal("tests"),
        project=world.project,
        tokens_per_day=limit,
        tokens_per_month=None,
    )
    body = json.dumps(
        {"model": "openai/gpt-4o-mini", "messages": MESSAGES, "max_tokens": MAX_TOKENS}
    )
    start = threading.Barrier(CALLERS)
    statuses: list[int] = []
    errors: list[BaseException] = []

    def caller() -> None:
        try:
            client = world.member.client()
            start.wait(timeout=30)
            response = client.post(world.url(), data=body, content_type="application/json")
            statuses.append(response.status_code)
        except BaseException as error:  # reported to the main thread below
            errors.append(error)
        finally:
            connection.close()

    threads = [threading.Thread(target=caller) for _ in range(CALLERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    assert not errors, errors
    assert sorted(set(statuses)) <= [200, 429], statuses
    succeeded = statuses.count(200)
    assert succeeded >= 5
    assert len(upstream.requests(host="openai")) == succeeded
    window = BudgetWindow.objects.get(project=world.project, period="day")
    assert window.reserved == 0
    assert window.used <= limit
    charged = sum(
        ModelUsage.objects.filter(project=world.project).values_list("charged_tokens", flat=True)
    )
    assert window.used == charged == succeeded * 9  # 3 prompt words + 6 completion words
