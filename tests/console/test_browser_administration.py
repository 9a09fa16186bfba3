"""The administration pages in a real browser: a token made and revoked, the audit log read
and verified, and every other administration page visited once (axe-core on each)."""

from __future__ import annotations

import json
import re

import pytest
from playwright.sync_api import expect

from kestrel_one.accounts.models import ApiToken
from kestrel_one.audit.heads import verified_head_claims
from kestrel_one.audit.models import AuditChain
from tests.console.browser import check_accessibility, screenshot, sign_in
from tests.console.pages import acme_webhook


@pytest.mark.spec("SURF-2")
def test_create_and_revoke_a_token(world, browser_page):
    page = browser_page.page
    sign_in(browser_page, world["member"].user, next_path="/console/acme/tokens")
    expect(page.get_by_role("heading", level=1)).to_have_text("API tokens")
    check_accessibility(browser_page, context="tokens page")

    page.get_by_label("Name").fill("laptop script")
    page.locator('input[name="scopes"][value="org:read"]').check()
    page.locator('input[name="scopes"][value="projects:read"]').check()
    page.get_by_label(re.compile("Lifetime in days")).fill("30")
    page.get_by_role("button", name="Create token").click()

    secret = page.locator("#token")
    expect(secret).to_have_text(re.compile(r"^kst_"))
    plaintext = secret.inner_text()
    token = ApiToken.objects.get(name="laptop script")
    expect(page.get_by_role("heading", name="Token created")).to_be_visible()
    check_accessibility(browser_page, context="tokens page with a new secret")
    screenshot(browser_page, "tokens")

    # Shown once: a reload is a plain GET (no second token), and the secret is gone.
    page.reload()
    expect(page.locator("#token")).to_have_count(0)
    assert plaintext not in page.content()
    assert ApiToken.objects.filter(name="laptop script").count() == 1
    row = page.get_by_role("row").filter(has_text=token.public_id)
    expect(row).to_contain_text("active")

    row.get_by_role("button", name=re.compile("Revoke laptop script")).click()
    expect(page.get_by_role("status")).to_contain_text(f"Token {token.public_id} is revoked")
    expect(page.get_by_role("row").filter(has_text=token.public_id)).to_contain_text("revoked")
    check_accessibility(browser_page, context="tokens page after a revocation")
    token.refresh_from_db()
    assert token.revoked_at is not None


@pytest.mark.spec("SURF-2")
def test_read_and_verify_the_audit_log(world, browser_page):
    page = browser_page.page
    sign_in(browser_page, world["owner"].user, next_path="/console/acme/audit")
    expect(page.get_by_role("heading", level=1)).to_have_text("Audit log")
    check_accessibility(browser_page, context="audit log")

    page.get_by_label("Action").fill("token.*")
    page.get_by_role("button", name="Filter").click()
    page.wait_for_url(re.compile(r"action=token"))
    actions = page.locator(".audit-record code.action")
    expect(actions.first).to_be_visible()
    assert all(text.startswith("token.") for text in actions.all_inner_texts())
    expect(page.get_by_label("Action")).to_have_value("token.*")

    page.get_by_role("button", name="Verify the chain").click()
    expect(page.locator("#verify-outcome")).to_contain_text("The chain is intact.")
    chain = AuditChain.objects.get(organization=world.org)
    expect(page.locator("#head-seq")).to_have_text(str(chain.last_sequence))
    expect(page.locator("#head-hash")).to_have_text(chain.last_hash)
    head = page.locator("#head-json").inner_text()
    claims = verified_head_claims(json.loads(head), organization=world.org)
    assert claims["seq"] == chain.last_sequence
    check_accessibility(browser_page, context="audit log, verified")
    screenshot(browser_page, "audit", full_page=False)


@pytest.mark.spec("SURF-2")
def test_every_administration_page_in_a_browser(world, browser_page):
    page = browser_page.page
    ids = acme_webhook(world)
    sign_in(browser_page, world["owner"].user, next_path="/console/acme/members")
    pages = {
        "/console/acme/members": "Members",
        f"/console/acme/members/{world['limited'].membership.public_id}": world[
            "limited"
        ].user.email,
        "/console/acme/runners": "Runners",
        "/console/acme/retention": "Retention",
        "/console/acme/webhooks": "Webhooks",
        f"/console/acme/webhooks/{ids['whk']}": f"Webhook {ids['whk']}",
    }
    for path, heading in pages.items():
        browser_page.goto(path)
        expect(page.get_by_role("heading", level=1)).to_have_text(heading)
        check_accessibility(browser_page, context=path)
    # A narrow screen: the layout collapses, the pages stay usable.
    page.set_viewport_size({"width": 420, "height": 900})
    browser_page.goto("/console/acme/members")
    check_accessibility(browser_page, context="members on a narrow screen")
    screenshot(browser_page, "members-narrow")


@pytest.mark.spec("SURF-2", "SURF-4")
def test_a_viewer_reads_without_forms(world, browser_page):
    page = browser_page.page
    sign_in(browser_page, world["viewer"].user, next_path="/console/acme/retention")
    expect(page.get_by_role("heading", level=1)).to_have_text("Retention")
    expect(page.get_by_role("button", name="Save retention")).to_have_count(0)
    check_accessibility(browser_page, context="retention as a viewer")
    browser_page.goto("/console/acme/members")
    expect(page.get_by_role("button", name="Add member")).to_have_count(0)
    response = browser_page.goto("/console/acme/audit")
    assert response.status == 403
    expect(page.get_by_role("heading", level=1)).to_have_text("Not allowed")
    check_accessibility(browser_page, context="audit log refused to a viewer")
