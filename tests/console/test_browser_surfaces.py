"""The surfaces page in a real browser: an admin publishes the MCP surface's policy, a
malformed one is shown at its path, and the page passes axe-core."""

from __future__ import annotations

import json

import pytest
from playwright.sync_api import expect

from kestrel_one.governance.models import SurfacePolicyVersion
from tests.console.browser import check_accessibility, screenshot, sign_in

READS_ONLY = {"capabilities": {"fs.read": {"paths": ["**"]}}}


@pytest.mark.spec("POL-2", "SURF-2")
def test_an_admin_publishes_a_surface_policy_in_the_browser(world, browser_page):
    page = browser_page.page
    sign_in(browser_page, world["admin"].user, next_path="/console/acme/surfaces")
    expect(page.get_by_role("heading", level=1)).to_have_text("Surfaces")
    check_accessibility(browser_page, context="surfaces page")

    editor = page.get_by_label("New mcp surface policy (JSON)")
    editor.fill('{"capabilities": {"fs.read": {"paths": ["src/**", 7]}}}')
    page.get_by_role("button", name="Publish the mcp surface policy").click()
    errors = page.locator("#surface-mcp-errors")
    expect(errors).to_contain_text("capabilities.fs.read.paths[1]")
    assert not SurfacePolicyVersion.objects.exists()
    check_accessibility(browser_page, context="surfaces page with an error")

    page.get_by_label("New mcp surface policy (JSON)").fill(json.dumps(READS_ONLY, indent=2))
    page.get_by_role("button", name="Publish the mcp surface policy").click()
    expect(page.get_by_role("status")).to_contain_text("Published the mcp surface policy")
    version = SurfacePolicyVersion.objects.get()
    expect(page.locator("#surface-mcp")).to_contain_text(version.public_id)
    check_accessibility(browser_page, context="surfaces page after publishing")
    screenshot(browser_page, "surfaces")
