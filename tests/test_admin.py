"""The operator admin shows no secret and keeps records read-only."""

import pytest

from tests.factories import UserFactory


@pytest.fixture
def operator(client, db):
    user = UserFactory(is_staff=True, is_superuser=True)
    client.force_login(user)
    return client


def test_token_pages_show_no_secret(operator, world):
    token = world["owner"].token
    page = operator.get(f"/admin/accounts/apitoken/{token.pk}/change/")
    assert page.status_code == 200
    assert token.secret_hash.encode() not in page.content
    assert world["owner"].plaintext.encode() not in page.content
    listing = operator.get("/admin/accounts/apitoken/")
    assert token.secret_hash.encode() not in listing.content


def test_runners_can_be_revoked_from_the_admin(operator, world):
    response = operator.post(
        "/admin/execution/runner/", {"action": "revoke", "_selected_action": [world.runner.pk]}
    )
    assert response.status_code == 302
    world.runner.refresh_from_db()
    assert world.runner.revoked_at is not None


def test_actions_and_audit_records_are_read_only(operator, world):
    action = world.action
    assert (
        operator.post(f"/admin/execution/action/{action.pk}/delete/", {"post": "yes"}).status_code
        == 403
    )
    assert operator.get("/admin/audit/auditrecord/add/").status_code == 403
