"""Browser tests of the console: Playwright driving Debian's chromium against a live server.

Playwright's own browser downloads are not reachable here, so the browser is
``/usr/bin/chromium`` (``make browser`` installs it) launched through ``executable_path``.
Every page a test visits can be checked with axe-core (npm, ``node_modules``): serious or
critical violations fail the test. The browser's console is watched too: a refused script
or style (a Content-Security-Policy violation) or a JavaScript error fails the test.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
AXE = ROOT / "node_modules" / "axe-core" / "axe.min.js"
PASSWORD = "correct horse battery staple"  # tests.factories.UserFactory's
# Screenshots for docs/console.md land here (git-ignored); docs/img/console holds the ones
# the docs show, copied from a run.
SCREENSHOTS = Path(os.environ.get("KESTREL_SCREENSHOT_DIR", ROOT / "var" / "screenshots"))
# Without these, chromium keeps trying to reach Google's hosts, which this network refuses.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def chromium(monkeypatch_module):
    if not Path(CHROMIUM).exists():
        pytest.fail("chromium is missing: run `make browser`", pytrace=False)
    if not AXE.exists():
        pytest.fail("axe-core is missing from node_modules: run `make browser`", pytrace=False)
    # Playwright's sync API runs an event loop in this thread; the ORM calls the tests make
    # between page actions are still synchronous. Only for the browser tests' module: a
    # process started later (manage.py check --deploy) must not inherit it.
    monkeypatch_module.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


class Watched:
    """A page whose console errors (CSP violations among them) are collected."""

    def __init__(self, page, base_url: str):
        self.page = page
        self.base_url = base_url
        self.errors: list[str] = []
        page.on("console", self._console)
        page.on("pageerror", lambda error: self.errors.append(f"page error: {error}"))

    def _console(self, message) -> None:
        if message.type == "error":
            text = message.text
            # A page answered with an error status logs a network error; that is what a test
            # of a refusal expects, not a script fault.
            if "Failed to load resource" in text:
                return
            self.errors.append(text)

    def goto(self, path: str):
        response = self.page.goto(self.base_url + path)
        return response

    def assert_clean(self) -> None:
        assert not self.errors, f"the browser logged errors: {self.errors}"


@pytest.fixture
def browser_page(chromium, live_server):
    context = chromium.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    watched = Watched(page, live_server.url)
    yield watched
    context.close()
    watched.assert_clean()


def sign_in(watched: Watched, user, *, next_path: str = "") -> None:
    """Sign in through the form, as a person would (which also starts sudo mode)."""
    page = watched.page
    watched.goto("/login" + (f"?next={next_path}" if next_path else ""))
    page.get_by_label("Email").fill(user.email)
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_load_state()
    assert "/login" not in page.url, f"sign-in failed for {user.email}: {page.url}"


def check_accessibility(watched: Watched, *, context: str = "") -> None:
    """axe-core on the page as it is now: no serious or critical violation.

    The script goes in through the DevTools protocol (``evaluate``), which a page's CSP does
    not govern, so the page keeps its real policy while it is checked."""
    page = watched.page
    page.evaluate(AXE.read_text())
    results = page.evaluate("async () => await axe.run(document, {resultTypes: ['violations']})")
    serious = [
        {
            "id": violation["id"],
            "impact": violation["impact"],
            "help": violation["help"],
            "nodes": [node["target"] for node in violation["nodes"]][:5],
        }
        for violation in results["violations"]
        if violation["impact"] in {"serious", "critical"}
    ]
    assert not serious, f"axe-core on {context or page.url}: {json.dumps(serious, indent=1)}"


def screenshot(watched: Watched, name: str, *, full_page: bool = True) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    watched.page.screenshot(path=str(path), full_page=full_page)
    return path
