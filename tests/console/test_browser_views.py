"""An outsider's and a viewer's view of the console in a real browser, over every page of the
catalogue (pages.py): the outsider gets the console's 404 page for each of acme's pages, the
same as for an organization that does not exist; the viewer gets each page without a write
they cannot make. axe-core runs on every page, and two pages are checked on a phone-sized
screen for horizontal overflow.
"""

from __future__ import annotations

import pytest

from tests.console.browser import check_accessibility, screenshot, sign_in
from tests.console.surface import NOT_FOUND, catalogue_pages

WRITES = (
    "main form[method=post i], main [hx-post], main [hx-put], main [hx-patch], main [hx-delete]"
)


@pytest.mark.spec("SURF-4", "TEN-1")
def test_an_outsider_gets_the_console_404_page_for_every_page(world, browser_page):
    page = browser_page.page
    sign_in(browser_page, world["outsider"].user)
    missing = browser_page.goto(NOT_FOUND)
    assert missing.status == 404
    expected = page.locator("main").inner_text()
    check_accessibility(browser_page, context="the 404 page")
    pages = [entry for entry in catalogue_pages(world) if not entry.page.post_only]
    assert pages
    for entry in pages:
        response = browser_page.goto(entry.url)
        assert response.status == 404, (entry.name, response.status)
        assert page.locator("main").inner_text() == expected, entry.name
        assert "Acme" not in page.content(), entry.name
        # The outsider's own organization is not named in the navigation of a page it is
        # refused either: the 404 page has no organization around it.
        assert page.locator("nav.side").count() == 0, entry.name
        check_accessibility(browser_page, context=f"outsider on {entry.name}")


@pytest.mark.spec("SURF-4", "TEN-1")
def test_a_viewer_sees_every_page_without_writes_they_cannot_make(world, browser_page):
    page = browser_page.page
    sign_in(browser_page, world["viewer"].user)
    checked = 0
    for entry in catalogue_pages(world):
        if entry.page.post_only or entry.page.download:
            continue  # (a download is a file, not a page: the walker checks who gets it)
        response = browser_page.goto(entry.url)
        expected = entry.page.get["viewer"]
        assert response.status == expected, (entry.name, response.status)
        refused = [post for post in entry.page.posts if post.expect.get("viewer", 200) >= 400]
        if expected == 200 and refused:
            writes = page.locator(WRITES)
            assert writes.count() == 0, f"{entry.name}: a viewer is shown {writes.count()} writes"
        if expected == 403:
            assert page.get_by_role("heading", level=1).inner_text() == "Not allowed"
        check_accessibility(browser_page, context=f"viewer on {entry.name}")
        checked += 1
    assert checked


@pytest.mark.spec("SURF-4")
def test_pages_fit_a_narrow_screen(world, browser_page):
    page = browser_page.page
    sign_in(browser_page, world["member"].user)
    page.set_viewport_size({"width": 390, "height": 844})
    others = [
        entry.url
        for entry in catalogue_pages(world)
        if not entry.page.post_only and entry.name != "console_overview"
    ]
    for path in ("/console/acme/", others[0]):
        browser_page.goto(path)
        width = page.evaluate("document.scrollingElement.scrollWidth")
        inner = page.evaluate("window.innerWidth")
        assert width <= inner, f"{path} overflows a 390 px screen: {width} px wide"
        check_accessibility(browser_page, context=f"{path} at 390 px")
        if path == "/console/acme/":
            screenshot(browser_page, "overview-narrow")
