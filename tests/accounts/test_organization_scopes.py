"""Powers over the whole organization need the whole organization (TEN-3, TEN-1).

A principal that sees only some projects (a member granted some, a person's token limited to
some, an integration token given some) holds none of ``ORGANIZATION_SCOPES``, whatever its
role or token says: the audit log, everyone's tokens, environments and policies, runners,
webhooks, retention, credentials and MCP servers all reach projects it cannot see. What
stays within its projects it keeps.
"""

from __future__ import annotations

import pytest

from kestrel_one.accounts.models import ApiToken
from kestrel_one.accounts.principal import system_principal
from kestrel_one.accounts.scopes import ORGANIZATION_SCOPES, ROLE_SCOPES, SCOPES, Role
from kestrel_one.accounts.services import token_create
from tests.tenancy.test_grant_rights import bearer, limit_admin_to_hangar

pytestmark = pytest.mark.spec("TEN-3", "TEN-1")

ORG = "/api/v1/orgs/acme"
# A body no endpoint accepts, so nothing changes whoever sends it: 400 for a caller holding
# the scope, 403 for anyone else.
BOGUS = {"bogus": True}


def organization_requests(world) -> list[tuple[str, str, str, dict | None, int]]:
    """(scope, method, path, body, status for a caller holding the scope): a request for each
    organization scope. Reads ignore what they do not know and answer 200; the one that
    succeeds (an integration token) has no body that fails only after its scope is checked."""
    env = world.environment.public_id
    hangar = world.other_project.public_id
    integration = {"name": "bot", "scopes": ["org:read"], "integration": True}
    return [
        ("audit:read", "get", f"{ORG}/audit?after=x", None, 400),
        ("audit:read", "get", f"{ORG}/audit/head", None, 200),
        ("tokens:admin", "post", f"{ORG}/tokens", integration, 201),
        ("environments:write", "post", f"{ORG}/environments", BOGUS, 400),
        ("policies:write", "put", f"{ORG}/environments/{env}/policy", BOGUS, 400),
        ("policies:write", "put", f"{ORG}/projects/{hangar}/policy", BOGUS, 400),
        ("policies:write", "put", f"{ORG}/surfaces/mcp/policy", BOGUS, 400),
        ("runners:write", "get", f"{ORG}/runners", None, 200),
        ("webhooks:write", "get", f"{ORG}/webhooks", None, 200),
        ("webhooks:write", "post", f"{ORG}/webhooks", BOGUS, 400),
        ("retention:write", "put", f"{ORG}/retention", BOGUS, 400),
        ("credentials:read", "get", f"{ORG}/credentials", None, 200),
        ("credentials:write", "post", f"{ORG}/credentials", BOGUS, 400),
        ("mcp:write", "post", f"{ORG}/mcp-servers", BOGUS, 400),
    ]


def send(client, method: str, path: str, body):
    if body is None:
        return getattr(client, method)(path)
    return getattr(client, method)(path, body, format="json")


def stored_limited_token(world, scopes: list[str]) -> str:
    """An integration token given one project, holding ``scopes`` as stored before tokens
    like it were refused at creation (the row is what an upgrade finds)."""
    token, plaintext = token_create(
        actor=system_principal("tests"),
        organization=world.org,
        name="hangar bot",
        scopes=["org:read", "projects:read"],
        integration=True,
        projects=[world.other_project],
    )
    ApiToken.objects.filter(pk=token.pk).update(scopes=scopes)
    return plaintext


def test_the_organization_scopes_are_scopes_and_members_hold_none():
    assert ORGANIZATION_SCOPES <= set(SCOPES)
    # What a member holds is project-sized: limiting one to some projects takes nothing.
    assert not ROLE_SCOPES[Role.MEMBER] & ORGANIZATION_SCOPES


def test_a_limited_admin_holds_no_power_over_the_whole_organization(world):
    requests = organization_requests(world)
    assert {scope for scope, *_ in requests} == ORGANIZATION_SCOPES
    everywhere = world["admin"].client()
    for scope, method, path, body, status in requests:
        allowed = send(everywhere, method, path, body)
        assert allowed.status_code == status, (scope, path, allowed.content)
    limited = limit_admin_to_hangar(world).client()
    for scope, method, path, body, _ in requests:
        refused = send(limited, method, path, body)
        assert refused.status_code == 403, (scope, path, refused.content)
        error = refused.json()["error"]
        assert error["code"] == "permission_denied"
        assert f"'{scope}' scope, which acts on the whole organization" in error["message"]


def test_a_limited_admin_sees_only_its_own_tokens_and_keeps_its_project_powers(world):
    admin = limit_admin_to_hangar(world)
    client = admin.client()
    listed = client.get(f"{ORG}/tokens").json()["results"]
    assert [t["id"] for t in listed] == [admin.token.public_id]
    # Nor revokes anyone else's.
    other = world["member"].token.public_id
    assert client.delete(f"{ORG}/tokens/{other}").status_code in {403, 404}
    assert ApiToken.objects.get(public_id=other).revoked_at is None
    # What stays within its project it keeps: work there, and members limited to it.
    hangar = world.other_project.public_id
    thread = client.post(f"{ORG}/projects/{hangar}/threads", {"title": "t"}, format="json")
    assert thread.status_code == 201, thread.content
    added = client.post(
        f"{ORG}/members",
        {"email": "hangar-admin@example.com", "role": "admin", "projects": [hangar]},
        format="json",
    )
    assert added.status_code == 201, added.content
    # The new admin is limited as much, so holds nothing the limited admin lacks: its
    # sign-in link may go to the one who added it.
    assert added.json()["sign_in_link"], added.content


def test_a_token_limited_to_some_projects_made_before_the_rule_holds_none_of_them(world):
    plaintext = stored_limited_token(world, ["org:read", "projects:read", *ORGANIZATION_SCOPES])
    bot = bearer(plaintext)
    for scope, method, path, body, _ in organization_requests(world):
        refused = send(bot, method, path, body)
        assert refused.status_code == 403, (scope, path, refused.content)
    # What it was given within its project still works.
    hangar = bot.get(f"{ORG}/projects/{world.other_project.public_id}/threads")
    assert hangar.status_code == 200, hangar.content


def test_a_token_limited_to_some_projects_is_refused_an_organization_scope(world):
    owner = world["owner"].client()
    for body in (
        {
            "name": "hooks",
            "scopes": ["org:read", "webhooks:write"],
            "integration": True,
            "projects": [world.other_project.public_id],
        },
        {
            "name": "hooks",
            "scopes": ["org:read", "audit:read"],
            "integration": True,
            "projects": [],
        },
    ):
        refused = owner.post(f"{ORG}/tokens", body, format="json")
        assert refused.status_code == 400, refused.content
        error = refused.json()["error"]
        assert error["code"] == "invalid"
        assert "act on the whole organization" in error["message"]
        assert any("needs every project" in d for d in error["details"]["scopes"])
    # Given every project, the same scopes are fine.
    everywhere = owner.post(
        f"{ORG}/tokens",
        {
            "name": "hooks",
            "scopes": ["org:read", "webhooks:write"],
            "integration": True,
            "projects": None,
        },
        format="json",
    )
    assert everywhere.status_code == 201, everywhere.content
    assert bearer(everywhere.json()["token"]).get(f"{ORG}/webhooks").status_code == 200
    # A limited admin asking for one on its own token is told why it does not hold it.
    limited = limit_admin_to_hangar(world).client()
    own = limited.post(
        f"{ORG}/tokens", {"name": "mine", "scopes": ["webhooks:write"]}, format="json"
    )
    assert own.status_code == 403, own.content
    assert "Each acts on the whole organization" in own.json()["error"]["message"]
