"""Verification records (AUD-4): acceptance needs its own evidence, and a named check speaks
only through a token bound to it."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from kestrel_one.accounts.models import ApiToken
from kestrel_one.accounts.principal import Principal, PrincipalKind, system_principal
from kestrel_one.accounts.services import token_create
from kestrel_one.common.errors import ValidationFailed
from kestrel_one.execution.approvals import verification_record
from kestrel_one.execution.models import Action, ActionState, Verification
from kestrel_one.execution.services import action_request

pytestmark = pytest.mark.spec("AUD-4")


def verifications_url(world) -> str:
    return (
        f"/api/v1/orgs/acme/projects/{world.project.public_id}/threads/"
        f"{world.thread.public_id}/actions/{world.finished_action.public_id}/verifications"
    )


def check_token_made(world, *, checks: list[str]) -> tuple[ApiToken, str]:
    """An integration token bound to ``checks`` that may also request actions, and its
    plaintext."""
    return token_create(
        actor=system_principal("tests"),
        organization=world.org,
        name="ci",
        scopes=["org:read", "projects:read", "projects:write"],
        integration=True,
        checks=checks,
    )


def check_token(world, *, checks: list[str]) -> str:
    return check_token_made(world, checks=checks)[1]


def bearer(plaintext: str) -> APIClient:
    return APIClient(REMOTE_ADDR="203.0.113.7", HTTP_AUTHORIZATION=f"Bearer {plaintext}")


@pytest.mark.parametrize("evidence", ["\u200b", "\u200b\u200b", "...", "\t-\u00a0"])
def test_evidence_without_substance_is_refused(world, evidence):
    response = (
        world["member"]
        .client()
        .post(verifications_url(world), {"accepted": True, "evidence": evidence}, format="json")
    )
    assert response.status_code == 400, response.content
    assert response.json()["error"]["details"] == {"evidence": ["empty"]}
    assert not Verification.objects.exists()


def test_the_service_refuses_empty_evidence_from_any_caller(world):
    member = world["member"]
    actor = Principal(PrincipalKind.TOKEN, user=member.user, token=member.token)
    for evidence in ("", "   "):
        with pytest.raises(ValidationFailed):
            verification_record(
                actor=actor, action=world.finished_action, accepted=True, evidence=evidence
            )
    assert not Verification.objects.exists()


def test_a_member_cannot_post_as_a_check(world):
    for name in ("owner", "member"):
        response = (
            world[name]
            .client()
            .post(
                verifications_url(world),
                {"accepted": True, "evidence": "ci run 981 green", "check": "ci"},
                format="json",
            )
        )
        assert response.status_code == 403, (name, response.content)
        error = response.json()["error"]
        assert error["code"] == "check_not_bound"
        assert "'ci'" in error["message"]
    assert not Verification.objects.exists()


def test_a_check_speaks_only_through_a_token_bound_to_it(world):
    lint = bearer(check_token(world, checks=["lint"]))
    other = lint.post(
        verifications_url(world),
        {"accepted": True, "evidence": "ci run 981 green", "check": "ci"},
        format="json",
    )
    assert other.status_code == 403 and other.json()["error"]["code"] == "check_not_bound"
    own = lint.post(
        verifications_url(world),
        {"accepted": True, "evidence": "ruff: 0 findings", "check": "lint"},
        format="json",
    )
    assert own.status_code == 201, own.content
    assert own.json()["verified_by"] == "check:lint"
    # Without naming its check, an integration is not a person and accepts nothing.
    person = lint.post(
        verifications_url(world), {"accepted": True, "evidence": "looks fine"}, format="json"
    )
    assert person.status_code == 403


def test_binding_a_check_needs_an_integration_token_made_by_an_admin(world):
    member = world["member"].client()
    refused = member.post(
        "/api/v1/orgs/acme/tokens",
        {"name": "my ci", "scopes": ["org:read"], "checks": ["ci"]},
        format="json",
    )
    assert refused.status_code == 400, refused.content
    made = (
        world["admin"]
        .client()
        .post(
            "/api/v1/orgs/acme/tokens",
            {"name": "ci", "scopes": ["projects:write"], "integration": True, "checks": ["ci"]},
            format="json",
        )
    )
    assert made.status_code == 201, made.content
    assert made.json()["checks"] == ["ci"]
    # A check token passes on only the checks it is bound to.
    bound = bearer(
        token_create(
            actor=system_principal("tests"),
            organization=world.org,
            name="ci admin",
            scopes=["org:read", "tokens:admin", "tokens:write"],
            integration=True,
            checks=["ci"],
        )[1]
    )
    widened = bound.post(
        "/api/v1/orgs/acme/tokens",
        {"name": "deploy", "scopes": ["org:read"], "integration": True, "checks": ["deploy"]},
        format="json",
    )
    assert widened.status_code == 403, widened.content


@pytest.mark.spec("POL-5")
def test_accepting_a_task_needs_actions_approve_like_every_other_decision(world):
    """A person's token without ``actions:approve`` (one an agent holds: made by another
    token, or an MCP client's) is refused approving and accepting plans; it used to record a
    person's acceptance of a task, in the person's name, on the same endpoint that named
    checks use with ``projects:write``."""
    member = world["member"]
    _, agent = token_create(
        actor=Principal(PrincipalKind.TOKEN, user=member.user, token=member.token),
        organization=world.org,
        name="agent",
        scopes=["org:read", "projects:read", "projects:write"],
    )
    refused = bearer(agent).post(
        verifications_url(world),
        {"accepted": True, "evidence": "all good, trust me"},
        format="json",
    )
    assert refused.status_code == 403, refused.content
    assert refused.json()["error"]["code"] == "permission_denied"
    assert "actions:approve" in refused.json()["error"]["message"]
    assert not Verification.objects.exists()

    accepted = member.client().post(
        verifications_url(world),
        {"accepted": True, "evidence": "ran the tests: 12 passed"},
        format="json",
    )
    assert accepted.status_code == 201, accepted.content
    assert accepted.json()["verified_by"] == member.user.public_id


def test_verifications_are_listed_a_page_at_a_time(world):
    member = world["member"]
    actor = Principal(PrincipalKind.TOKEN, user=member.user, token=member.token)
    # Pages follow the ids, time-ordered to the millisecond (the same millisecond: random).
    made = sorted(
        verification_record(
            actor=actor, action=world.finished_action, accepted=False, evidence=f"run {n} red"
        ).public_id
        for n in range(3)
    )
    client = member.client()
    first = client.get(verifications_url(world), {"limit": 2})
    assert first.status_code == 200, first.content
    assert [v["id"] for v in first.json()["results"]] == made[:2]
    rest = client.get(first.json()["next"])
    assert [v["id"] for v in rest.json()["results"]] == made[2:]
    assert rest.json()["next"] is None
    assert client.get(verifications_url(world), {"limit": "all"}).status_code == 400


def test_a_check_never_accepts_a_task_its_own_lineage_requested(world):
    """A check token is an agent like any other: bound to a check, it may still request
    actions, and what it requested it never accepts (nor rejects) as that check."""
    token, plaintext = check_token_made(world, checks=["ci"])
    own = action_request(
        actor=Principal(PrincipalKind.TOKEN, token=token),
        thread=world.thread,
        tool="fs.read",
        args={"path": "README.md"},
    )
    Action.objects.filter(pk=own.pk).update(state=ActionState.SUCCEEDED)
    url = verifications_url(world).replace(world.finished_action.public_id, own.public_id)

    response = bearer(plaintext).post(
        url, {"accepted": True, "evidence": "ci run 982 green", "check": "ci"}, format="json"
    )

    assert response.status_code == 403, response.content
    assert response.json()["error"]["code"] == "permission_denied"
    assert "lineage" in response.json()["error"]["message"]
    assert not Verification.objects.filter(action=own).exists()
    # The same check still speaks on what another agent requested.
    other = bearer(plaintext).post(
        verifications_url(world),
        {"accepted": True, "evidence": "ci run 982 green", "check": "ci"},
        format="json",
    )
    assert other.status_code == 201, other.content
