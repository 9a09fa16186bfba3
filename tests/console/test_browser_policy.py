"""The policy console in a real browser: edit a project policy, see a widening named and
refused, preview a narrowing against the recorded decisions, explain a call, publish it."""

from __future__ import annotations

import json

import pytest
from playwright.sync_api import expect

from kestrel_one.execution.services import action_request
from kestrel_one.governance.models import PolicyVersion
from tests.console.browser import SCREENSHOTS, check_accessibility, screenshot, sign_in

# The world's environment grants fs.write on src/** and out/** only: etc/** widens it.
WIDENING = {
    "capabilities": {"fs.read": {"paths": ["**"]}, "fs.write": {"paths": ["src/**", "etc/**"]}}
}
NARROWING = {"capabilities": {"fs.read": {"paths": ["src/**"]}}}


@pytest.mark.spec("SURF-2", "POL-2")
def test_an_admin_edits_previews_and_publishes_a_project_policy(world, browser_page):
    page = browser_page.page
    # Recorded decisions to replay: the agent read a file the narrowing keeps, and one it drops.
    kept = action_request(
        actor=world.agent, thread=world.thread, tool="fs.read", args={"path": "src/main.py"}
    )
    dropped = action_request(
        actor=world.agent, thread=world.thread, tool="fs.read", args={"path": "docs/guide.md"}
    )
    url = f"/console/acme/projects/{world.project.public_id}/policy"
    sign_in(browser_page, world["owner"].user, next_path=url)
    assert page.url.endswith(url)
    expect(page.get_by_role("heading", level=1)).to_have_text("Policy of project launchpad")
    check_accessibility(browser_page, context="project policy editor")

    # A widening draft saves, and the page names the widening before anyone publishes.
    editor = page.get_by_label("Draft policy document (JSON)")
    editor.fill(json.dumps(WIDENING, indent=2))
    page.get_by_role("button", name="Save draft").click()
    expect(page.get_by_role("status")).to_have_text("Draft saved.")
    widenings = page.locator("#widenings")
    expect(widenings).to_contain_text("would widen its environment in 1 place")
    expect(widenings).to_contain_text("capabilities.fs.write.paths[1]")
    expect(widenings).to_contain_text("etc/**")
    check_accessibility(browser_page, context="editor with a widening draft")

    # Publishing it is refused with exactly that reason.
    page.get_by_role("button", name="Publish this draft").click()
    refusal = page.locator("#publish-errors")
    expect(refusal).to_contain_text("would widen its environment")
    expect(refusal).to_contain_text("capabilities.fs.write.paths[1]")
    assert not PolicyVersion.objects.filter(project=world.project).exists()
    check_accessibility(browser_page, context="publish refused")

    # A narrowing draft: its diff against what the project uses, then the preview.
    page.get_by_label("Draft policy document (JSON)").fill(json.dumps(NARROWING, indent=2))
    page.get_by_role("button", name="Save draft").click()
    expect(page.locator("#widenings")).to_have_text(
        "The draft stays within its environment's policy."
    )
    # The project has no policy of its own yet: the diff is against the environment's.
    expect(page.locator("#diff-heading")).to_contain_text("the environment's policy")
    expect(page.locator("pre.diff .diff-del", has_text='"shell.exec"')).to_be_visible()
    screenshot(browser_page, "policy-editor-diff")

    page.get_by_role("link", name="Preview the draft").click()
    preview = page.locator("#preview-result")
    expect(preview).to_contain_text("3 of 4 recorded decisions of the last 14 days would change")
    expect(preview).to_contain_text(dropped.public_id)
    expect(preview).to_contain_text(world.finished_action.public_id)
    assert kept.public_id not in preview.inner_text()
    row = preview.locator("tr", has_text=dropped.public_id)
    expect(row).to_contain_text("allowed")
    expect(row).to_contain_text("denied")
    screenshot(browser_page, "policy-preview")
    check_accessibility(browser_page, context="preview against history")
    # The parts docs/console.md shows, on their own.
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.locator("#diff-heading + pre.diff").screenshot(path=str(SCREENSHOTS / "policy-diff.png"))
    preview.screenshot(path=str(SCREENSHOTS / "policy-preview-result.png"))

    # Readable on a narrow screen too: the layout collapses, nothing needs a wider window.
    page.set_viewport_size({"width": 390, "height": 844})
    check_accessibility(browser_page, context="project policy editor, narrow")
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")
    screenshot(browser_page, "policy-editor-narrow")
    page.set_viewport_size({"width": 1280, "height": 900})

    # Explain: the same call under the published policy and under the draft.
    page.get_by_label("Tool").select_option("fs.read")
    page.get_by_label("Arguments (JSON)").fill('{"path": "docs/guide.md"}')
    page.get_by_label("Mode").select_option("agent")
    page.get_by_role("button", name="Explain").click()
    result = page.locator("#explain-result")
    expect(result.locator(".decision").first).to_contain_text("Allowed")
    expect(result.locator(".decision").nth(1)).to_contain_text("Denied")
    check_accessibility(browser_page, context="explain")

    # Publish the narrowing (the sign-in just now is sudo mode).
    page.get_by_role("button", name="Publish this draft").click()
    expect(page.get_by_role("status")).to_contain_text("Published.")
    version = PolicyVersion.objects.get(project=world.project)
    expect(page.locator("#published-heading + dl")).to_contain_text(version.public_id)
    expect(page.locator("#published-heading + dl")).to_contain_text(world["owner"].user.email)
    check_accessibility(browser_page, context="after publishing")


@pytest.mark.spec("SURF-2", "SURF-4")
def test_a_viewer_reads_the_policy_pages_without_forms_to_change_them(world, browser_page):
    page = browser_page.page
    sign_in(browser_page, world["viewer"].user, next_path="/console/acme/policy")
    expect(page.get_by_role("heading", level=1)).to_have_text("Policy")
    check_accessibility(browser_page, context="policy index")
    page.get_by_role("link", name="production").click()
    expect(page.get_by_role("heading", level=1)).to_have_text("Policy of environment production")
    assert page.get_by_role("button", name="Save draft").count() == 0
    assert page.get_by_role("button", name="Publish this draft").count() == 0
    check_accessibility(browser_page, context="environment policy, viewer")
    screenshot(browser_page, "policy-environment-viewer")
