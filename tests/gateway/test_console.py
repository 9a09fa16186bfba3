"""The console's usage pages: everyone who sees the project reads its usage; admins set its
budget; no page shows a prompt or a completion."""

from __future__ import annotations

import json

import pytest
from django.test import Client

from kestrel_one.gateway.models import ModelBudget

pytestmark = pytest.mark.spec("SURF-2")

HELLO = [{"role": "user", "content": "Plan the orbital insertion"}]


def signed_in(user) -> Client:
    client = Client()
    client.force_login(user)  # a sign-in, which starts sudo mode
    return client


def test_an_admin_sets_a_budget_and_members_see_the_usage(gateway_world, upstream):
    world = gateway_world
    called = world.member.client().post(
        world.url(),
        data=json.dumps({"model": "openai/gpt-4o-mini", "messages": HELLO, "max_tokens": 20}),
        content_type="application/json",
    )
    assert called.status_code == 200
    page = f"/console/{world.org.slug}/projects/{world.project.public_id}/usage"
    saved = signed_in(world.admin.user).post(
        page, {"tokens_per_day": "5000", "tokens_per_month": ""}
    )
    assert saved.status_code == 303
    budget = ModelBudget.objects.get(project=world.project)
    assert (budget.tokens_per_day, budget.tokens_per_month) == (5000, None)

    member = signed_in(world.member.user)
    html = member.get(page).content.decode()
    assert "openai/gpt-4o-mini" in html and "of 5000" in html
    assert 'name="tokens_per_day"' not in html  # a member cannot set it
    assert "orbital insertion" not in html and "Hello from" not in html
    index = member.get(f"/console/{world.org.slug}/usage").content.decode()
    assert world.project.name in index and "of 5000" in index

    refused = member.post(page, {"tokens_per_day": "1"})
    assert refused.status_code == 403
    assert ModelBudget.objects.get(project=world.project).tokens_per_day == 5000


def test_a_budget_form_with_a_bad_number_says_so(gateway_world, upstream):
    world = gateway_world
    page = f"/console/{world.org.slug}/projects/{world.project.public_id}/usage"
    response = signed_in(world.admin.user).post(page, {"tokens_per_day": "-5"})
    assert response.status_code == 400
    assert not ModelBudget.objects.filter(project=world.project).exists()
