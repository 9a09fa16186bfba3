"""Grant rights (TEN-3): nobody grants a role or projects they do not hold, changes or removes
someone of their own or a higher rank (owners manage owners), or widens themselves; an
integration token sees an explicit project set no wider than its creator's, and a principal
with neither a membership nor such a set sees nothing."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from kestrel_one.accounts.principal import Principal, PrincipalKind, system_principal
from kestrel_one.accounts.scopes import Role
from kestrel_one.accounts.services import token_create
from kestrel_one.tenancy.models import Membership, Project
from tests.conftest import make_person

pytestmark = pytest.mark.spec("TEN-3")

MEMBERS = "/api/v1/orgs/acme/members"


def limit_admin_to_hangar(world):
    """The world's admin, limited by the owner to one project (``other_project``)."""
    admin = world["admin"]
    limited = (
        world["owner"]
        .client()
        .patch(
            f"{MEMBERS}/{admin.membership.public_id}",
            {"projects": [world.other_project.public_id]},
            format="json",
        )
    )
    assert limited.status_code == 200, limited.content
    return admin


def bearer(plaintext: str) -> APIClient:
    return APIClient(REMOTE_ADDR="203.0.113.7", HTTP_AUTHORIZATION=f"Bearer {plaintext}")


def test_a_limited_admin_cannot_lock_out_the_owner(world):
    admin = limit_admin_to_hangar(world).client()
    owner = world["owner"].membership
    for body in (
        {"projects": []},
        {"projects": [world.other_project.public_id]},
        {"role": "admin"},
    ):
        response = admin.patch(f"{MEMBERS}/{owner.public_id}", body, format="json")
        assert response.status_code == 403, (body, response.content)
        assert response.json()["error"]["code"] == "permission_denied"
    assert admin.delete(f"{MEMBERS}/{owner.public_id}").status_code == 403
    owner.refresh_from_db()
    assert owner.all_projects is True and owner.role == "owner"
    # Nor lock the owner out of the API by revoking the owner's token: without tokens:admin,
    # which nobody limited to some projects holds, it sees only its own tokens.
    revoked = admin.delete(f"/api/v1/orgs/acme/tokens/{world['owner'].token.public_id}")
    assert revoked.status_code == 404, revoked.content
    assert world["owner"].client().get("/api/v1/orgs/acme").status_code == 200


def test_a_limited_admin_cannot_widen_itself(world):
    admin = limit_admin_to_hangar(world)
    client = admin.client()
    own = f"{MEMBERS}/{admin.membership.public_id}"
    for body in (
        {"projects": None},
        {"projects": [world.other_project.public_id, world.project.public_id]},
        {"role": "owner"},
    ):
        response = client.patch(own, body, format="json")
        assert response.status_code in {400, 403}, (body, response.content)
    membership = Membership.objects.get(pk=admin.membership.pk)
    assert membership.all_projects is False and membership.role == "admin"
    assert client.get(f"/api/v1/orgs/acme/projects/{world.project.public_id}").status_code == 404
    # Stepping down is allowed: narrowing oneself widens nothing.
    narrowed = client.patch(own, {"role": "member"}, format="json")
    assert narrowed.status_code == 200, narrowed.content


def test_a_limited_admin_grants_only_projects_it_holds(world):
    client = limit_admin_to_hangar(world).client()
    everything = client.post(MEMBERS, {"email": "a@example.com", "role": "member"}, format="json")
    assert everything.status_code == 403, everything.content
    assert "limited to some projects" in everything.json()["error"]["message"]
    hidden = client.post(
        MEMBERS,
        {"email": "b@example.com", "role": "member", "projects": [world.project.public_id]},
        format="json",
    )
    # A project the admin cannot see is answered like a missing one.
    assert hidden.status_code == 400 and "projects[0]" in hidden.json()["error"]["details"]
    mine = client.post(
        MEMBERS,
        {"email": "c@example.com", "role": "member", "projects": [world.other_project.public_id]},
        format="json",
    )
    assert mine.status_code == 201, mine.content
    assert mine.json()["projects"] == [world.other_project.public_id]
    # A member who sees all projects is beyond this admin: it cannot narrow them either.
    member = world["member"].membership
    refused = client.patch(f"{MEMBERS}/{member.public_id}", {"role": "viewer"}, format="json")
    assert refused.status_code == 403, refused.content


def test_an_admin_cannot_change_another_admin_but_an_owner_can(world):
    owner = world["owner"].client()
    second = owner.post(MEMBERS, {"email": "second@example.com", "role": "admin"}, format="json")
    assert second.status_code == 201, second.content
    url = f"{MEMBERS}/{second.json()['id']}"
    admin = world["admin"].client()
    for body in ({"projects": []}, {"role": "viewer"}):
        assert admin.patch(url, body, format="json").status_code == 403, body
    assert admin.delete(url).status_code == 403
    assert owner.patch(url, {"projects": []}, format="json").status_code == 200
    # Owners manage owners (the last-owner rule still holds).
    promoted = owner.patch(url, {"role": "owner", "projects": None}, format="json")
    assert promoted.status_code == 200, promoted.content
    demoted = owner.patch(url, {"role": "admin"}, format="json")
    assert demoted.status_code == 200, demoted.content


def test_an_integration_token_sees_no_more_than_its_creator(world):
    # Integration tokens are made with tokens:admin, a power over the whole organization:
    # nobody limited to some projects holds it, so no such token is wider than its creator.
    limited = limit_admin_to_hangar(world).client()
    refused = limited.post(
        "/api/v1/orgs/acme/tokens",
        {"name": "bot", "scopes": ["org:read", "projects:read"], "integration": True},
        format="json",
    )
    assert refused.status_code == 403, refused.content
    assert (
        "'tokens:admin' scope, which acts on the whole organization"
        in (refused.json()["error"]["message"])
    )
    owner = world["owner"].client()
    made = owner.post(
        "/api/v1/orgs/acme/tokens",
        {
            "name": "bot",
            "scopes": ["org:read", "projects:read"],
            "integration": True,
            "projects": [world.other_project.public_id],
        },
        format="json",
    )
    assert made.status_code == 201, made.content
    assert made.json()["projects"] == [world.other_project.public_id]
    bot = bearer(made.json()["token"])
    listed = bot.get("/api/v1/orgs/acme/projects").json()["results"]
    assert [p["id"] for p in listed] == [world.other_project.public_id]
    assert bot.get(f"/api/v1/orgs/acme/projects/{world.project.public_id}").status_code == 404
    threads = bot.get(f"/api/v1/orgs/acme/projects/{world.project.public_id}/threads")
    assert threads.status_code == 404
    # Left out, the set is what the creator sees (the owner: every project).
    everything = owner.post(
        "/api/v1/orgs/acme/tokens",
        {"name": "all", "scopes": ["org:read"], "integration": True},
        format="json",
    )
    assert everything.status_code == 201 and everything.json()["projects"] is None
    # A project the creator cannot see (another organization's) is answered like a missing one.
    hidden = owner.post(
        "/api/v1/orgs/acme/tokens",
        {
            "name": "other",
            "scopes": ["org:read"],
            "integration": True,
            "projects": [world.foreign_project.public_id],
        },
        format="json",
    )
    assert hidden.status_code == 400 and "projects[0]" in hidden.json()["error"]["details"]


def test_an_integration_token_limited_to_projects_sees_the_project_it_creates(world):
    _, plaintext = token_create(
        actor=system_principal("tests"),
        organization=world.org,
        name="project maker",
        scopes=["org:read", "projects:read", "projects:manage"],
        integration=True,
        projects=[world.other_project],
    )
    bot = bearer(plaintext)
    made = bot.post(
        "/api/v1/orgs/acme/projects",
        {"name": "bot-made", "environment": world.environment.public_id},
        format="json",
    )
    assert made.status_code == 201, made.content
    listed = sorted(p["id"] for p in bot.get("/api/v1/orgs/acme/projects").json()["results"])
    assert listed == sorted([world.other_project.public_id, made.json()["id"]])


def test_without_a_membership_or_an_explicit_project_set_nothing_is_visible(world):
    bare, _ = token_create(
        actor=system_principal("tests"),
        organization=world.org,
        name="no projects",
        scopes=["org:read", "projects:read"],
        integration=True,
        projects=[],
    )
    assert not Project.objects.visible_to(Principal(PrincipalKind.TOKEN, token=bare), world.org)
    # A person with no membership here (the outsider) sees nothing in acme either.
    outsider = Principal(PrincipalKind.SESSION, user=world["outsider"].user)
    assert not Project.objects.visible_to(outsider, world.org)
    # A token of another organization sees nothing in this one.
    foreign = Principal(PrincipalKind.TOKEN, token=world["outsider"].token)
    assert not Project.objects.visible_to(foreign, world.org)
    # An operator's command on the server sees every project.
    assert Project.objects.visible_to(system_principal("tests"), world.org).count() == 2


def test_a_limited_admin_makes_projects_only_in_the_environments_of_its_own(world):
    client = limit_admin_to_hangar(world).client()
    # Hangar is in production; a project in another environment would reach that one's
    # ceiling, credentials and MCP servers.
    elsewhere = client.post(
        "/api/v1/orgs/acme/projects",
        {"name": "side door", "environment": world.empty_environment.public_id},
        format="json",
    )
    assert elsewhere.status_code == 403, elsewhere.content
    assert elsewhere.json()["error"]["details"] == {
        "environment": ["not an environment of your projects"]
    }
    assert not Project.objects.filter(name="side door").exists()
    beside = client.post(
        "/api/v1/orgs/acme/projects",
        {"name": "annex", "environment": world.environment.public_id},
        format="json",
    )
    assert beside.status_code == 201, beside.content
    # Whoever sees every project makes one anywhere.
    anywhere = (
        world["owner"]
        .client()
        .post(
            "/api/v1/orgs/acme/projects",
            {"name": "side door", "environment": world.empty_environment.public_id},
            format="json",
        )
    )
    assert anywhere.status_code == 201, anywhere.content


@pytest.mark.spec("SURF-1", "TEN-3")
def test_the_members_api_names_only_the_projects_the_caller_can_see(world):
    """A member limited to hangar read, through the API, the ids of every project another
    limited member holds; the console already named only its own. Now the others are only
    counted, in the list, a member's page and what a change returns."""
    both = make_person(
        world.org, Role.MEMBER, name="both", projects=[world.project, world.other_project]
    )
    hidden = world.project.public_id  # launchpad: not the limited reader's
    reader = world["limited"].client()
    listed = {row["id"]: row for row in reader.get(MEMBERS).json()["results"]}
    one = reader.get(f"{MEMBERS}/{both.membership.public_id}").json()
    for row in (listed[both.membership.public_id], one):
        assert row["projects"] == [world.other_project.public_id]
        assert row["hidden_projects"] == 1
        assert row["all_projects"] is False
    assert hidden not in str(reader.get(MEMBERS).content)
    # Someone who sees every project reads every id, and nothing hidden.
    owner = world["owner"].client()
    theirs = owner.get(f"{MEMBERS}/{both.membership.public_id}").json()
    assert sorted(theirs["projects"]) == sorted([hidden, world.other_project.public_id])
    assert theirs["hidden_projects"] == 0
    everyone = owner.get(f"{MEMBERS}/{world['owner'].membership.public_id}").json()
    assert (everyone["projects"], everyone["hidden_projects"]) == (None, None)
    # What a limited admin's change returns is read the same way.
    admin = limit_admin_to_hangar(world).client()
    changed = admin.patch(
        f"{MEMBERS}/{world['limited'].membership.public_id}", {"role": "viewer"}, format="json"
    )
    assert changed.status_code == 200, changed.content
    assert changed.json()["projects"] == [world.other_project.public_id]
    assert changed.json()["hidden_projects"] == 0
