"""The console walker: every organization page of the console, probed by every kind of
person, the way the API's cross-tenant walker probes every endpoint.

For each route in the URL resolver under ``/console/<org>/``: someone not signed in is sent
to sign in; an outsider gets the same 404 page (same bytes) as for a missing organization,
and no write of theirs changes anything; objects of another organization put in the URL are
a 404 for everyone; each member gets what the page catalogue (pages.py) says, and a viewer's
write is refused without a change. A route without a catalogue entry fails here.
"""

from __future__ import annotations

import pytest
from django.test import Client

from kestrel_one.console.sudo import SESSION_KEY as SUDO_SESSION_KEY
from kestrel_one.console.sudo import sudo_stamp
from tests.api.routes import console_org_routes, database_fingerprint
from tests.api.test_cross_tenant import foreign_markers
from tests.console.pages import MEMBERS, PAGES


def _url(route, world, kwargs: dict[str, str], org: str = "acme") -> str:
    url = route.pattern.replace("<slug:org>", org)
    for name, value in kwargs.items():
        for converter in ("str", "slug", "path"):
            url = url.replace(f"<{converter}:{name}>", value)
    assert "<" not in url, f"{route.name}: the catalogue does not fill {url}"
    return "/" + url.lstrip("/")


def _signed_in(user, *, sudo: bool = True) -> Client:
    client = Client()
    client.force_login(user)
    session = client.session
    if sudo:
        # The same stamp a fresh sign-in leaves (sudo.sudo_stamp), for pages that need it.
        request = type("Request", (), {"session": session})()
        sudo_stamp(request)
    else:
        # force_login signs in, which stamps the session too: an old session has no stamp.
        session.pop(SUDO_SESSION_KEY, None)
    session.save()
    return client


def test_every_console_route_has_a_catalogue_entry():
    routes = console_org_routes()
    assert routes, "the resolver returned no console organization pages"
    missing = sorted(route.name for route in routes if route.name not in PAGES)
    assert not missing, f"add these console routes to tests/console/pages.py: {missing}"
    stale = sorted(set(PAGES) - {route.name for route in routes})
    assert not stale, f"catalogue entries without a route: {stale}"


@pytest.mark.spec("TEN-1", "TEN-4", "SURF-4")
def test_every_console_page_is_scoped_like_the_api(world):
    for route in console_org_routes():
        page = PAGES[route.name]
        url = _url(route, world, page.fill(world))
        missing_url = _url(route, world, page.fill(world), org="no-such-org")

        anonymous = Client().get(url)
        assert anonymous.status_code == 302, route.name
        assert anonymous["Location"].startswith("/login"), route.name

        outsider = _signed_in(world["outsider"].user)
        method = outsider.post if page.post_only else outsider.get
        foreign, missing = method(url), method(missing_url)
        assert foreign.status_code == missing.status_code == 404, route.name
        assert foreign.content == missing.content, route.name
        assert not [m for m in foreign_markers(world) if m in foreign.content.decode()]
        for post in page.posts:
            before = database_fingerprint()
            assert outsider.post(url, post.body(world)).status_code == 404, route.name
            assert database_fingerprint() == before, f"{route.name}: an outsider's POST wrote"

        if page.foreign is not None:
            foreign_url = _url(route, world, page.foreign(world))
            owner = _signed_in(world["owner"].user)
            seen = owner.post(foreign_url) if page.post_only else owner.get(foreign_url)
            assert seen.status_code == 404, f"{route.name}: another org's object was served"
            assert seen.content == missing.content, route.name

        if not page.post_only:
            for name in MEMBERS:
                response = _signed_in(world[name].user).get(url)
                expected = page.get[name]
                assert response.status_code == expected, (route.name, name, response.status_code)
                if expected == 200 and name == "viewer" and not response.streaming:
                    # (A download streams its bytes: no page, so no form either.)
                    _no_write_forms_for_a_viewer(route.name, response.content.decode(), page)

        for post in page.posts:
            for name, expected in post.expect.items():
                # Signed in first: signing in records last_login, which is not the write.
                client = _signed_in(world[name].user)
                before = database_fingerprint()
                response = client.post(url, post.body(world))
                assert response.status_code == expected, (route.name, name, response.status_code)
                if expected >= 400:
                    assert database_fingerprint() == before, f"{route.name}: refused but wrote"


def _no_write_forms_for_a_viewer(name: str, html: str, page) -> None:
    """A viewer sees no form that posts to a page whose writes the catalogue refuses them."""
    refused = [post for post in page.posts if post.expect.get("viewer", 200) >= 400]
    if refused:
        assert 'method="post"' not in html.replace("/logout", "").split("</header>", 1)[-1], (
            f"{name}: a viewer is shown a write form"
        )


@pytest.mark.spec("SURF-4")
def test_a_sensitive_write_without_a_recent_sign_in_changes_nothing(world):
    """Sudo mode: an old session is sent to confirm who it is, and nothing changes."""
    for route in console_org_routes():
        page = PAGES[route.name]
        url = _url(route, world, page.fill(world))
        for post in page.posts:
            if not post.sudo:
                continue
            stale = _signed_in(world["owner"].user, sudo=False)
            before = database_fingerprint()
            response = stale.post(url, post.body(world))
            assert response.status_code == 303, route.name
            assert response["Location"].startswith("/console/sudo?"), route.name
            assert database_fingerprint() == before, f"{route.name}: wrote without sudo mode"
