"""A token minted by a token is the same agent (POL-5): it never gets `actions:approve`, never
approves or accepts what its lineage requested, and never outlives its parent."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from kestrel_one.accounts.models import ApiToken
from kestrel_one.accounts.principal import system_principal
from kestrel_one.accounts.services import token_create

TOKENS = "/api/v1/orgs/acme/tokens"


def bearer(plaintext: str) -> APIClient:
    return APIClient(REMOTE_ADDR="203.0.113.7", HTTP_AUTHORIZATION=f"Bearer {plaintext}")


def threads(world) -> str:
    return f"/api/v1/orgs/acme/projects/{world.project.public_id}/threads"


def awaiting_action(client, world) -> tuple[str, str]:
    thread = client.post(threads(world), {"title": "t", "mode": "agent"}, format="json")
    assert thread.status_code == 201, thread.content
    thread_id = thread.json()["id"]
    action = client.post(
        f"{threads(world)}/{thread_id}/actions",
        {"tool": "shell.exec", "args": {"argv": ["make"]}},
        format="json",
    )
    assert action.json()["state"] == "awaiting_approval", action.content
    return thread_id, action.json()["id"]


def approve(client, world, thread_id: str, action_id: str):
    return client.post(
        f"{threads(world)}/{thread_id}/actions/{action_id}/approve", {}, format="json"
    )


@pytest.mark.spec("POL-5")
def test_a_token_cannot_mint_a_sibling_that_approves(world):
    agent = world["member"]  # a person's token with actions:approve, handed to an agent
    client = agent.client()
    thread_id, action_id = awaiting_action(client, world)
    assert approve(client, world, thread_id, action_id).status_code == 403
    sibling = client.post(
        TOKENS,
        {"name": "sibling", "scopes": ["org:read", "projects:read", "actions:approve"]},
        format="json",
    )
    assert sibling.status_code == 403, sibling.content
    assert "console" in sibling.json()["error"]["message"]
    assert not ApiToken.objects.filter(name="sibling").exists()


@pytest.mark.spec("POL-5")
def test_no_token_of_the_lineage_approves_what_it_requested(world):
    root = world["member"]
    child = root.client().post(
        TOKENS, {"name": "agent", "scopes": ["org:read", "projects:write"]}, format="json"
    )
    assert child.status_code == 201, child.content
    body = child.json()
    assert body["parent"] == root.token.public_id and body["lineage"] == root.token.lineage
    thread_id, action_id = awaiting_action(bearer(body["token"]), world)
    # The parent holds actions:approve, yet it is the same agent as the child.
    refused = approve(root.client(), world, thread_id, action_id)
    assert refused.status_code == 403, refused.content
    assert "lineage" in refused.json()["error"]["message"]
    # A token of that lineage that holds actions:approve (say one made before this rule) is
    # still the same agent.
    old_sibling, plaintext = token_create(
        actor=system_principal("tests"),
        organization=world.org,
        name="old sibling",
        scopes=["org:read", "projects:read", "actions:approve"],
        user=root.user,
    )
    ApiToken.objects.filter(pk=old_sibling.pk).update(parent=root.token, lineage=root.token.lineage)
    assert approve(bearer(plaintext), world, thread_id, action_id).status_code == 403
    # Another person decides.
    approved = approve(world["admin"].client(), world, thread_id, action_id)
    assert approved.status_code == 200, approved.content


@pytest.mark.spec("POL-5", "POL-4")
def test_no_token_of_the_lineage_accepts_a_plan_it_proposed(world):
    root = world["member"]
    child = (
        root.client()
        .post(TOKENS, {"name": "planner", "scopes": ["org:read", "projects:write"]}, format="json")
        .json()
    )
    planner = bearer(child["token"])
    thread = planner.post(threads(world), {"title": "p", "mode": "plan"}, format="json").json()
    plan = planner.post(
        f"{threads(world)}/{thread['id']}/plans",
        {"steps": [{"tool": "fs.read", "args": {"path": "README.md"}}]},
        format="json",
    ).json()
    refused = root.client().post(f"{threads(world)}/{thread['id']}/plans/{plan['id']}/accept")
    assert refused.status_code == 403, refused.content
    message = refused.json()["error"]["message"]
    assert "cannot accept this plan:" in message and "lineage" in message
    assert "a plan it" not in message


@pytest.mark.spec("POL-5", "API-2")
def test_actions_approve_is_put_on_a_token_from_a_console_session(world, client):
    member = world["member"]
    client.force_login(member.user)
    page = client.get("/console/acme/tokens")
    assert page.status_code == 200 and b"actions:approve" in page.content
    # Another organization's page is the same 404 as a missing one.
    assert client.get("/console/globex/tokens").status_code == 404
    assert client.get("/console/no-such-org/tokens").status_code == 404
    made = client.post(
        "/console/acme/tokens",
        {
            "name": "deciding",
            "scopes": ["org:read", "projects:read", "actions:approve"],
        },
    )
    assert made.status_code == 200, made.content
    assert made["Cache-Control"] == "no-store"
    token = ApiToken.objects.get(name="deciding")
    assert token.user == member.user and token.parent is None
    assert token.lineage == token.public_id  # the root of its own lineage
    plaintext = made.content.decode().split('<code id="token">')[1].split("<")[0]
    thread_id, action_id = awaiting_action(member.client(), world)
    approved = approve(bearer(plaintext), world, thread_id, action_id)
    assert approved.status_code == 200, approved.content
    # The console holds a person to their role, too.
    viewer = APIClient()
    viewer.force_login(world["viewer"].user)
    refused = viewer.post("/console/acme/tokens", {"name": "x", "scopes": ["actions:approve"]})
    assert refused.status_code == 403
    assert not ApiToken.objects.filter(name="x").exists()


@pytest.mark.spec("API-1")
def test_a_child_token_never_outlives_its_parent(world):
    soon = timezone.now() + timedelta(hours=1)
    parent = (
        world["owner"]
        .client()
        .post(
            TOKENS,
            {"name": "short", "scopes": ["org:read", "tokens:write"], "expires_at": soon},
            format="json",
        )
        .json()
    )
    short = bearer(parent["token"])
    later = (timezone.now() + timedelta(days=30)).isoformat()
    refused = short.post(
        TOKENS, {"name": "long", "scopes": ["org:read"], "expires_at": later}, format="json"
    )
    assert refused.status_code == 400, refused.content
    error = refused.json()["error"]
    assert "expires_at" in error["details"]
    parent_expiry = ApiToken.objects.get(public_id=parent["id"]).expires_at
    assert parent_expiry.isoformat() in error["message"]
    # Left out, the default lifetime is clipped to the parent's expiry.
    clipped = short.post(TOKENS, {"name": "default", "scopes": ["org:read"]}, format="json")
    assert clipped.status_code == 201, clipped.content
    assert ApiToken.objects.get(public_id=clipped.json()["id"]).expires_at == parent_expiry
