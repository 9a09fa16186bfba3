"""The MCP Python SDK's own OAuth client (``OAuthClientProvider``) against the live server:
it meets the endpoint's 401, discovers, registers, sends the person to the consent page
(here: a signed-in browser session pressing Allow), exchanges the code and lists tools."""

from __future__ import annotations

import asyncio
import re
from urllib.parse import parse_qs, urlsplit

import httpx2
import pytest
from django.conf import settings
from django.test import Client
from mcp import ClientSession
from mcp.client.auth import OAuthClientProvider
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.auth import (
    AuthorizationCodeResult,
    OAuthClientInformationFull,
    OAuthClientMetadata,
    OAuthToken,
)

from kestrel_one.accounts.models import ApiToken
from kestrel_one.oauth.models import OAuthGrant
from tests.oauth.flow import REDIRECT_URI, mcp_path

pytestmark = pytest.mark.django_db(transaction=True)


class MemoryStorage:
    def __init__(self):
        self.tokens: OAuthToken | None = None
        self.client_info: OAuthClientInformationFull | None = None

    async def get_tokens(self):
        return self.tokens

    async def set_tokens(self, tokens):
        self.tokens = tokens

    async def get_client_info(self):
        return self.client_info

    async def set_client_info(self, client_info):
        self.client_info = client_info


class SignedInBrowser:
    """Plays the person: opens the authorization URL with their session and presses Allow."""

    def __init__(self, session_cookie: str):
        self.session_cookie = session_cookie
        self.result: AuthorizationCodeResult | None = None
        self.pages: list[str] = []

    async def redirect_handler(self, authorization_url: str) -> None:
        async with httpx2.AsyncClient(follow_redirects=False, timeout=30) as browser:
            browser.cookies.set(settings.SESSION_COOKIE_NAME, self.session_cookie)
            page = await browser.get(authorization_url)
            assert page.status_code == 200, page.text
            self.pages.append(page.text)
            csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)[1]
            answer = await browser.post(
                authorization_url, data={"csrfmiddlewaretoken": csrf, "decision": "allow"}
            )
            assert answer.status_code == 302, answer.text
            params = parse_qs(urlsplit(answer.headers["location"]).query)
            # What the client's callback page receives, iss included (RFC 9207; the SDK
            # checks it against the issuer the metadata named).
            self.result = AuthorizationCodeResult(
                code=params["code"][0], state=params["state"][0], iss=params["iss"][0]
            )

    async def callback_handler(self) -> AuthorizationCodeResult:
        assert self.result is not None
        return self.result


@pytest.mark.spec("API-1")
def test_the_mcp_sdk_oauth_client_connects_after_consent(live_server, world):
    signed_in = Client()
    signed_in.force_login(world["member"].user)
    person = SignedInBrowser(signed_in.cookies[settings.SESSION_COOKIE_NAME].value)
    endpoint = live_server.url + mcp_path(world.project)
    storage = MemoryStorage()
    provider = OAuthClientProvider(
        server_url=endpoint,
        client_metadata=OAuthClientMetadata(
            client_name="MCP SDK test client",
            redirect_uris=[REDIRECT_URI],
            grant_types=["authorization_code", "refresh_token"],
            response_types=["code"],
            token_endpoint_auth_method="none",
        ),
        storage=storage,
        redirect_handler=person.redirect_handler,
        callback_handler=person.callback_handler,
    )

    async def connect():
        async with httpx2.AsyncClient(auth=provider, timeout=60) as http:
            async with streamable_http_client(endpoint, http_client=http) as streams:
                read, write = streams[0], streams[1]
                async with ClientSession(read, write) as session:
                    await session.initialize()
                    return await session.list_tools()

    tools = asyncio.run(connect())
    names = {tool.name for tool in tools.tools}
    assert "kestrel.outcome" in names
    assert "MCP SDK test client" in person.pages[0]
    assert storage.tokens is not None and storage.tokens.access_token.startswith("kst_")
    token = ApiToken.objects.get(key_id=storage.tokens.access_token.split("_")[1])
    assert token.user == world["member"].user
    assert list(token.projects.all()) == [world.project]
    assert OAuthGrant.objects.get(api_token=token).resource == endpoint
