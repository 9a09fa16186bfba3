"""The console in a real browser: signing in and the organization list."""

from __future__ import annotations

import pytest

from tests.console.browser import check_accessibility, screenshot, sign_in


@pytest.mark.spec("API-2", "SURF-4")
def test_a_person_signs_in_and_reaches_their_organization(world, browser_page):
    page = browser_page.page
    browser_page.goto("/console/acme/")
    assert "/login" in page.url  # not signed in: sent to sign in, then back here
    check_accessibility(browser_page, context="sign-in page")
    sign_in(browser_page, world["member"].user, next_path="/console/acme/")
    assert page.url.endswith("/console/acme/")
    assert page.get_by_role("heading", level=1).inner_text() == "Acme Rockets"
    check_accessibility(browser_page, context="overview")
    session = next(c for c in page.context.cookies() if c["name"] == "sessionid")
    assert session["httpOnly"] and session["sameSite"] == "Lax"
    screenshot(browser_page, "overview")
    # Keyboard: the skip link is the first stop and moves focus to the content.
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.textContent") == "Skip to content"
