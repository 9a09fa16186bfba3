"""An integration token belongs to the organization and outlives its maker's membership; the
maker saw its secret once. So whoever removes the maker is told which tokens they made, the
removal's audit record names them, and the token lists say who made each and whether they
are still a member: each can then be revoked or replaced."""

from __future__ import annotations

import html

import pytest

from kestrel_one.accounts.scopes import Role
from kestrel_one.audit.models import AuditRecord
from tests.conftest import make_person
from tests.console.test_administration import signed_in
from tests.tenancy.test_grant_rights import bearer

pytestmark = pytest.mark.spec("TEN-3")

ORG = "/api/v1/orgs/acme"


def test_the_tokens_a_removed_member_made_are_named_where_they_can_be_ended(world):
    admin = world["admin"]
    made = admin.client().post(
        f"{ORG}/tokens",
        {"name": "deploy bot", "scopes": ["org:read"], "integration": True},
        format="json",
    )
    assert made.status_code == 201, made.content
    bot_id, secret = made.json()["id"], made.json()["token"]
    assert made.json()["made_by"] == {"email": admin.user.email, "member": True}
    # A token of their own, and one they revoked, are not what the removal leaves behind.
    revoked = admin.client().post(
        f"{ORG}/tokens",
        {"name": "old bot", "scopes": ["org:read"], "integration": True},
        format="json",
    )
    assert admin.client().delete(f"{ORG}/tokens/{revoked.json()['id']}").status_code == 200

    owner = signed_in(world["owner"].user)
    page = owner.get(f"/console/acme/members/{admin.membership.public_id}")
    assert page.status_code == 200
    text = html.unescape(page.content.decode())
    assert "made 1 integration token still in force here" in text
    assert bot_id in text and "deploy bot" in text and revoked.json()["id"] not in text

    # Named only to whoever sees every token (tokens:admin), as the tokens page is: not to
    # an admin limited to some projects, who still manages members (members:write).
    limited = make_person(
        world.org, Role.ADMIN, name="hangar-admin", projects=[world.other_project]
    )
    seen = signed_in(limited.user).get(f"/console/acme/members/{admin.membership.public_id}")
    assert seen.status_code == 200 and "remove-heading" in seen.content.decode()
    assert bot_id not in seen.content.decode()

    removed = world["owner"].client().delete(f"{ORG}/members/{admin.membership.public_id}")
    assert removed.status_code == 204, removed.content
    record = AuditRecord.objects.get(
        action="membership.remove", target_id=admin.membership.public_id
    )
    assert record.data["integrations_made"] == [bot_id]
    # It still works: it is the organization's, not the person's...
    assert bearer(secret).get(ORG).status_code == 200
    # ...and the token lists say whose it was.
    listed = {t["id"]: t for t in world["owner"].client().get(f"{ORG}/tokens").json()["results"]}
    assert listed[bot_id]["made_by"] == {"email": admin.user.email, "member": False}
    assert listed[world["member"].token.public_id]["made_by"] is None  # made on the server
    tokens_page = html.unescape(owner.get("/console/acme/tokens").content.decode())
    assert f"made by {admin.user.email}" in tokens_page
    assert "no longer a member" in tokens_page
