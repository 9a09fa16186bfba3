"""The credentials pages in a real browser: an admin adds, rotates and revokes a credential;
a member adds and revokes their own connection. No page ever shows a secret (CRED-1); nobody
else sees the connection (TEN-5)."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect

from kestrel_one.audit.models import AuditRecord
from kestrel_one.credentials.models import Connection, Credential
from tests.console.browser import check_accessibility, screenshot, sign_in
from tests.credentials.helpers import assert_secret_free

SECRET = "ghp_BrowserPlantedSecret000111222"
ROTATED = "ghp_BrowserRotatedSecret333444555"
MINE = "xoxb-BrowserConnection-666777888"


@pytest.mark.spec("CRED-1")
def test_add_rotate_and_revoke_a_credential(world, browser_page):
    page = browser_page.page
    sign_in(browser_page, world["admin"].user, next_path="/console/acme/credentials")
    expect(page.get_by_role("heading", level=1)).to_have_text("Credentials")
    check_accessibility(browser_page, context="credentials page")

    # A refused secret (a space in it) is not filled back in, nor shown anywhere.
    page.get_by_label("Name").fill("github-ci")
    page.get_by_label("Adapter").select_option("github")
    page.get_by_label("Secret").fill(SECRET + " x")
    page.get_by_role("button", name="Add credential").click()
    expect(page.get_by_role("alert")).to_contain_text("printable ASCII")
    expect(page.get_by_label("Secret")).to_have_value("")
    assert_secret_free(page.content(), SECRET)
    assert not Credential.objects.exists()

    page.get_by_label("Secret").fill(SECRET)
    page.get_by_role("button", name="Add credential").click()
    credential = Credential.objects.get(name="github-ci")
    expect(page.get_by_role("status")).to_contain_text(f"Credential {credential.public_id}")
    row = page.get_by_role("row").filter(has_text=credential.public_id)
    expect(row).to_contain_text(credential.fingerprint)
    expect(row).to_contain_text("active")
    assert_secret_free(page.content(), SECRET)
    check_accessibility(browser_page, context="credentials page with a credential")
    screenshot(browser_page, "credentials")

    row.get_by_label("New secret for github-ci").fill(ROTATED)
    row.get_by_role("button", name="Rotate credential github-ci").click()
    expect(page.get_by_role("status")).to_contain_text("now holds the new secret")
    credential.refresh_from_db()
    assert credential.rotated_at is not None
    row = page.get_by_role("row").filter(has_text=credential.public_id)
    expect(row).to_contain_text(credential.fingerprint)

    row.get_by_role("button", name="Revoke credential github-ci").click()
    expect(page.get_by_role("status")).to_contain_text("is revoked")
    expect(page.get_by_role("row").filter(has_text=credential.public_id)).to_contain_text("revoked")
    assert_secret_free(page.content(), SECRET, ROTATED)
    credential.refresh_from_db()
    assert credential.revoked_at is not None
    actions = set(
        AuditRecord.objects.filter(target_id=credential.public_id).values_list("action", flat=True)
    )
    assert actions == {"credential.create", "credential.rotate", "credential.revoke"}


@pytest.mark.spec("TEN-5")
def test_a_member_adds_and_revokes_their_own_connection_and_nobody_else_sees_it(
    world, browser_page
):
    page = browser_page.page
    sign_in(browser_page, world["member"].user, next_path="/console/acme/connections")
    expect(page.get_by_role("heading", level=1)).to_have_text("My connections")
    # Members do not manage the organization's credentials.
    assert browser_page.goto("/console/acme/credentials").status == 403
    browser_page.goto("/console/acme/connections")
    page.get_by_label("Adapter").select_option("slack")
    page.get_by_label("Secret").fill(MINE)
    page.get_by_role("button", name="Add connection").click()
    connection = Connection.objects.get(owner=world["member"].user)
    row = page.get_by_role("row").filter(has_text=connection.public_id)
    expect(row).to_contain_text(connection.fingerprint)
    assert_secret_free(page.content(), MINE)
    check_accessibility(browser_page, context="my connections")
    screenshot(browser_page, "connections")

    # The owner of the organization signs in: it is not on their page, and its revoke is a 404.
    page.context.clear_cookies()
    sign_in(browser_page, world["owner"].user, next_path="/console/acme/connections")
    expect(page.get_by_role("heading", level=1)).to_have_text("My connections")
    assert connection.public_id not in page.content()

    page.context.clear_cookies()
    sign_in(browser_page, world["member"].user, next_path="/console/acme/connections")
    row = page.get_by_role("row").filter(has_text=connection.public_id)
    row.get_by_role("button", name=re.compile("Revoke connection")).click()
    expect(page.get_by_role("status")).to_contain_text("is revoked")
    connection.refresh_from_db()
    assert connection.revoked_at is not None
