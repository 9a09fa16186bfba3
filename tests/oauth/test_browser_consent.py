"""The consent page in a real browser: Allow reaches the client.

The consent form posts to this server, which answers with a redirect to the client's
callback. Chromium holds that redirect to the page's CSP ``form-action`` as well, so the
page must allow the client's origin, or the person presses Allow and nothing happens.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest
from playwright.sync_api import expect

from kestrel_one.oauth.services import redirect_origin
from tests.console.browser import browser_page, chromium, monkeypatch_module, sign_in
from tests.oauth.flow import Pkce, authorize_path, exchange, http, mcp_path, register

__all__ = ["browser_page", "chromium", "monkeypatch_module"]


class _Callback(BaseHTTPRequestHandler):
    """The MCP client's loopback callback (RFC 8252): it records what it was sent."""

    received: list[str]

    def do_GET(self) -> None:
        self.received.append(self.path)
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.end_headers()
        self.wfile.write(b"<!doctype html><title>Signed in</title><h1>You may close this tab</h1>")

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def callback() -> Iterator[tuple[str, list[str]]]:
    received: list[str] = []
    handler = type("Callback", (_Callback,), {"received": received})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/callback", received
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.spec("API-1", "SURF-2")
def test_allow_in_a_browser_takes_the_person_back_to_the_client_with_a_code(
    world, live_server, browser_page, callback
):
    redirect_uri, received = callback
    client = http(live_server.url)
    client_id = register(client, redirect_uris=[redirect_uri])
    pkce = Pkce.make()
    resource = live_server.url + mcp_path(world.project)
    page = browser_page.page

    sign_in(browser_page, world["member"].user)
    browser_page.goto(authorize_path(client_id, resource, pkce, redirect_uri=redirect_uri))
    page.get_by_role("button", name="Allow").click()
    expect(page.get_by_role("heading", name="You may close this tab")).to_be_visible()

    callbacks = [path for path in received if path.startswith("/callback?")]
    assert len(callbacks) == 1, received
    query = parse_qs(urlsplit(callbacks[0]).query)
    assert query["state"] == ["st-123"]
    tokens = exchange(
        client,
        client_id,
        query["code"][0],
        pkce.verifier,
        resource=resource,
        redirect_uri=redirect_uri,
    )
    assert tokens.status_code == 200, tokens.text
    # browser_page fails the test at teardown on any console error, a CSP refusal among them.


def test_only_a_plain_client_origin_joins_the_consent_pages_form_action():
    assert redirect_origin("http://127.0.0.1:8765/callback?x=1") == "http://127.0.0.1:8765"
    assert redirect_origin("https://app.example.com/cb") == "https://app.example.com"
    assert redirect_origin("http://[::1]:9000/cb") == "http://[::1]:9000"
    # Nothing that could end the directive or name another scheme gets in.
    assert redirect_origin("http://a.example;script-src/cb") is None
    assert redirect_origin("javascript:alert(1)") is None
    assert redirect_origin("http://127.0.0.1:99999/cb") is None
