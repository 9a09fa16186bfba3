"""The team dashboard in a real browser: the overview with its chart, and a thread's
timeline that shows an action move through its states while the person watches.

The action is requested through ``action_request`` and moved on by signed runner reports
through ``report_ingest``, the very calls a runner's reports take into the control plane
(the broker is a stand-in that keeps the signed command, as in tests/execution)."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from kestrel_one.accounts.principal import system_principal
from kestrel_one.artifacts.services import artifact_create
from kestrel_one.execution.enrollment import runner_enroll
from kestrel_one.execution.models import ActionState
from kestrel_one.execution.services import action_request, report_ingest
from runners.contract.tokens import generate_private_key_pem, public_key_pem
from tests.console.browser import check_accessibility, screenshot, sign_in
from tests.execution.test_report_ingest import report as signed_report

# Generous: the page polls every 2 s, and the machine is shared.
LIVE_TIMEOUT_MS = 20_000


@pytest.mark.spec("SURF-1")
def test_a_member_watches_a_thread_timeline_update_while_an_action_runs(
    world, browser_page, monkeypatch
):
    sent = []
    monkeypatch.setattr(
        "kestrel_one.celery.app.send_task",
        lambda name, args, queue: sent.append((name, args, queue)),
    )
    key = generate_private_key_pem()
    runner = runner_enroll(
        actor=system_principal("tests"),
        pool="default",
        public_key_pem=public_key_pem(key).decode(),
    )
    artifact = artifact_create(
        project=world.project,
        thread=world.thread,
        action=world.finished_action,
        kind="file",
        name="README.md",
        content=b"# Acme\n",
        created_by="tests",
    )
    page = browser_page.page
    sign_in(browser_page, world["member"].user, next_path="/console/acme/")

    # The overview: projects, the pending approval, recent activity, and the chart.
    expect(page.get_by_role("heading", level=1)).to_have_text("Acme Rockets")
    expect(page.locator("svg.chart")).to_be_visible()
    expect(page.get_by_role("img", name="Actions per day by outcome")).to_be_visible()
    expect(page.get_by_role("link", name="launchpad", exact=True)).to_be_visible()
    pending = page.locator(f'a[href="/console/acme/actions/{world.action.public_id}"]').first
    expect(pending).to_be_visible()
    check_accessibility(browser_page, context="dashboard overview")
    screenshot(browser_page, "dashboard-overview")
    # The chart's numbers are a table too, one click (or key press) away.
    page.get_by_text("The numbers").click()
    expect(page.get_by_role("table", name="Actions per day by outcome (UTC days)")).to_be_visible()
    check_accessibility(browser_page, context="dashboard overview, the chart's numbers")

    # Into the project, then the thread.
    page.get_by_role("link", name="launchpad", exact=True).click()
    expect(page.get_by_role("heading", level=1)).to_have_text("launchpad")
    check_accessibility(browser_page, context="project threads")
    page.get_by_role("link", name="build", exact=True).click()
    expect(page.get_by_role("heading", level=1)).to_have_text("build")
    expect(page.locator(f"#action-{world.finished_action.public_id}")).to_be_visible()
    download = page.get_by_role("link", name="README.md", exact=True)
    expect(download).to_have_attribute(
        "href", f"/console/acme/artifacts/{artifact.public_id}/content"
    )
    expect(page.get_by_role("button", name="Create share link")).to_be_visible()
    check_accessibility(browser_page, context="thread timeline")
    # A mark on this very document: a reload would lose it.
    page.evaluate("window.kestrelWatched = true")

    # An agent asks for a write the policy allows: it appears, queued, without a reload.
    action = action_request(
        actor=world.agent,
        thread=world.thread,
        tool="fs.write",
        args={"path": "src/main.py", "content": "print('hi')\n"},
    )
    assert action.state == ActionState.QUEUED and sent, "the command was not sent"
    card = page.locator(f"#action-{action.public_id}")
    expect(card).to_be_visible(timeout=LIVE_TIMEOUT_MS)
    expect(card.locator(".badge.state")).to_have_text("queued", timeout=LIVE_TIMEOUT_MS)
    expect(card.locator(".decision")).to_have_text("allow")

    # The runner says it started, then that it finished: the page follows.
    started = signed_report(
        action, runner, key, event="started", outcome=None, result=None, finished_at=None
    )
    assert report_ingest(started) == "started"
    expect(card.locator(".badge.state")).to_have_text("running", timeout=LIVE_TIMEOUT_MS)
    assert report_ingest(signed_report(action, runner, key)) == ActionState.SUCCEEDED
    expect(card.locator(".badge.state")).to_have_text("succeeded", timeout=LIVE_TIMEOUT_MS)
    expect(card.locator(".receipt-outcome")).to_have_text("succeeded")
    expect(page.locator("ol.events li").last).to_contain_text("action.finished")
    assert page.evaluate("window.kestrelWatched === true"), "the page was reloaded"

    check_accessibility(browser_page, context="thread timeline after the action ran")
    screenshot(browser_page, "dashboard-timeline")

    # Readable on a narrow screen too (the layout collapses at 760 px).
    page.set_viewport_size({"width": 390, "height": 844})
    expect(card.locator(".badge.state")).to_be_visible()
    check_accessibility(browser_page, context="thread timeline, narrow screen")
    screenshot(browser_page, "dashboard-timeline-narrow")
