"""Approvals in a real browser: approve an action from the inbox in sudo mode and watch it
run on real workers, deny one, accept a plan, and confirm one's password when the sign-in
is old (SURF-3)."""

from __future__ import annotations

import pytest
from django.contrib.sessions.backends.db import SessionStore
from django.db import connection
from playwright.sync_api import expect

from kestrel_one.console.sudo import SESSION_KEY
from kestrel_one.execution.models import Action, Approval
from kestrel_one.execution.services import action_request
from tests.console.browser import PASSWORD, check_accessibility, screenshot, sign_in
from tests.execution.workers import governed_thread, real_workers

RUNNER_ID = "run_CONSOLEAPPROVALS0000000000"
# Every shell call needs a person's approval; the rest of the policy is the end-to-end one.
APPROVAL_POLICY = {
    "capabilities": {
        "fs.read": {"paths": ["**"]},
        "shell.exec": {
            "approval": "always",
            "limits": {"timeout_s": 30, "memory_mb": 256, "pids": 64},
        },
    }
}
# Long enough for a first container start on a busy machine; Playwright polls until then.
RUN_TIMEOUT_MS = 120_000


@pytest.fixture(scope="module")
def workers(django_db_setup, django_db_blocker, tmp_path_factory, docker_backend):
    with django_db_blocker.unblock():
        database = connection.settings_dict
    with real_workers(
        tmp_path_factory.mktemp("approvals-runner"), runner_id=RUNNER_ID, database=database
    ) as files:
        yield files


def review_from_inbox(browser_page, action) -> None:
    """Open the inbox, check it, and follow the action's Review link."""
    page = browser_page.page
    browser_page.goto("/console/acme/approvals")
    expect(page.get_by_role("heading", level=1)).to_have_text("Approvals")
    check_accessibility(browser_page, context="approvals inbox")
    page.get_by_role("link", name=f"Review {action.public_id}").click()
    page.wait_for_url(f"**/console/acme/actions/{action.public_id}")
    expect(page.locator("#action-digest")).to_have_text(action.action_digest)
    check_accessibility(browser_page, context="action page")


@pytest.mark.spec("SURF-3", "SURF-4")
@pytest.mark.docker
def test_approve_from_the_inbox_in_sudo_mode_and_see_it_run(world, workers, browser_page):
    thread = governed_thread(
        workers, world.org, runner_id=RUNNER_ID, policy=APPROVAL_POLICY, name="console-approve"
    )
    action = action_request(
        actor=world.agent,
        thread=thread,
        tool="shell.exec",
        args={"argv": ["echo", "approved in the console"]},
    )
    assert action.state == "awaiting_approval", action.decision
    page = browser_page.page
    sign_in(browser_page, world["member"].user)  # a fresh sign-in: sudo mode
    review_from_inbox(browser_page, action)
    expect(page.get_by_role("navigation", name="Console").locator(".count")).to_have_text("2")
    screenshot(browser_page, "approvals-action")
    page.get_by_label("Reason for approving (optional)").fill("echo is harmless")
    page.get_by_role("button", name="Approve").click()
    expect(page.get_by_role("status")).to_have_text("Approved: the action is queued to run.")
    # The status part polls (htmx) while the call is queued or running.
    expect(page.locator("#action-state")).to_have_text("succeeded", timeout=RUN_TIMEOUT_MS)
    expect(page.locator("#action-status")).to_contain_text("approved in the console")
    expect(page.locator("#action-status")).to_contain_text("rcp_")
    check_accessibility(browser_page, context="action page, succeeded")
    screenshot(browser_page, "approvals-action-succeeded")
    approval = Approval.objects.get(action=action)
    assert (approval.decision, approval.decided_by, approval.reason) == (
        "approved",
        world["member"].user,
        "echo is harmless",
    )


@pytest.mark.spec("SURF-3")
def test_deny_an_action(world, browser_page):
    page = browser_page.page
    sign_in(browser_page, world["owner"].user)
    page.set_viewport_size({"width": 390, "height": 844})  # a phone: the layout collapses
    review_from_inbox(browser_page, world.action)
    screenshot(browser_page, "approvals-action-narrow")
    page.get_by_label("Reason for denying (optional)").fill("not on a Friday")
    page.get_by_role("button", name="Deny").click()
    expect(page.get_by_role("status")).to_have_text("Denied.")
    expect(page.locator("#action-state")).to_have_text("denied")
    expect(page.get_by_role("button", name="Approve")).to_have_count(0)
    check_accessibility(browser_page, context="action page, denied")
    world.action.refresh_from_db()
    assert world.action.state == "denied"
    browser_page.goto("/console/acme/approvals")
    expect(page.get_by_text("No approvals waiting.")).to_be_visible()
    check_accessibility(browser_page, context="empty inbox")
    screenshot(browser_page, "approvals-inbox-empty")


@pytest.mark.spec("SURF-3")
def test_accept_a_plan(world, browser_page):
    page = browser_page.page
    sign_in(browser_page, world["member"].user)
    browser_page.goto("/console/acme/approvals")
    check_accessibility(browser_page, context="approvals inbox")
    screenshot(browser_page, "approvals-inbox")
    page.get_by_role("link", name=f"Review {world.plan.public_id}").click()
    page.wait_for_url(f"**/console/acme/plans/{world.plan.public_id}")
    expect(page.get_by_role("heading", name="Step 0: fs.write")).to_be_visible()
    expect(page.locator("pre").first).to_contain_text('"path": "src/a.py"')
    check_accessibility(browser_page, context="plan page")
    page.get_by_role("button", name="Accept plan").click()
    expect(page.get_by_role("status")).to_have_text("Accepted: its steps may now run.")
    expect(page.locator("#plan-state")).to_have_text("accepted")
    check_accessibility(browser_page, context="plan page, accepted")
    world.plan.refresh_from_db()
    assert (world.plan.state, world.plan.accepted_by) == ("accepted", world["member"].user)


@pytest.mark.spec("SURF-3", "SURF-4")
def test_an_old_sign_in_confirms_the_password_then_approves(world, browser_page):
    page = browser_page.page
    sign_in(browser_page, world["admin"].user)
    # The sign-in grows old: its sudo stamp goes, as it would after a few minutes.
    cookie = next(c for c in page.context.cookies() if c["name"] == "sessionid")
    session = SessionStore(session_key=cookie["value"])
    session.pop(SESSION_KEY)
    session.save()
    review_from_inbox(browser_page, world.action)
    expect(page.get_by_text("You will be asked to confirm your password first.")).to_be_visible()
    page.get_by_role("button", name="Approve").click()
    page.wait_for_url("**/console/sudo?**")
    expect(page.get_by_role("heading", level=1)).to_have_text("Confirm it is you")
    expect(page.get_by_text("To approve or deny this action")).to_be_visible()
    check_accessibility(browser_page, context="sudo confirmation")
    world.action.refresh_from_db()
    assert world.action.state == "awaiting_approval"  # nothing was posted on their behalf
    page.get_by_label(f"Password for {world['admin'].user.email}").fill(PASSWORD)
    page.get_by_role("button", name="Confirm").click()
    page.wait_for_url(f"**/console/acme/actions/{world.action.public_id}")
    expect(page.get_by_text("You will be asked to confirm your password first.")).to_have_count(0)
    page.get_by_role("button", name="Approve").click()
    expect(page.get_by_role("status")).to_have_text("Approved: the action is queued to run.")
    check_accessibility(browser_page, context="action page, approved")
    assert Action.objects.get(pk=world.action.pk).state != "awaiting_approval"
    assert Approval.objects.get(action=world.action).decided_by == world["admin"].user
