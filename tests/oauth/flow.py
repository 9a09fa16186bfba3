"""The OAuth flow as an MCP client drives it, over real HTTP against Django's live server:
a person's signed-in browser session (cookies, the consent form with its CSRF token) and the
client's own requests (registration, token, revocation, API calls)."""

from __future__ import annotations

import base64
import hashlib
import re
import secrets
from dataclasses import dataclass
from urllib.parse import parse_qs, urlencode, urlsplit

import httpx2
from django.conf import settings
from django.test import Client

REDIRECT_URI = "http://127.0.0.1:8765/callback"


@dataclass
class Pkce:
    verifier: str
    challenge: str

    @classmethod
    def make(cls) -> Pkce:
        verifier = secrets.token_urlsafe(48)
        digest = hashlib.sha256(verifier.encode()).digest()
        return cls(verifier, base64.urlsafe_b64encode(digest).rstrip(b"=").decode())


def http(base_url: str) -> httpx2.Client:
    return httpx2.Client(base_url=base_url, follow_redirects=False, timeout=30)


def browser(base_url: str, user) -> httpx2.Client:
    """A browser signed in as ``user``: the session cookie Django's sign-in would set."""
    signed_in = Client()
    signed_in.force_login(user)
    client = http(base_url)
    client.cookies.set(
        settings.SESSION_COOKIE_NAME, signed_in.cookies[settings.SESSION_COOKIE_NAME].value
    )
    return client


def mcp_path(project) -> str:
    return f"/api/v1/orgs/{project.organization.slug}/projects/{project.public_id}/mcp"


def register(client: httpx2.Client, **metadata) -> str:
    body = {
        "client_name": "Test MCP client",
        "redirect_uris": [REDIRECT_URI],
        "token_endpoint_auth_method": "none",
        "grant_types": ["authorization_code", "refresh_token"],
        "response_types": ["code"],
        **metadata,
    }
    response = client.post("/oauth/register", json=body)
    assert response.status_code == 201, response.text
    return response.json()["client_id"]


def authorize_path(
    client_id: str,
    resource: str,
    pkce: Pkce | None,
    *,
    method: str | None = "S256",
    redirect_uri: str = REDIRECT_URI,
    scope: str = "projects:read projects:write",
    state: str = "st-123",
) -> str:
    params = {
        "response_type": "code",
        "client_id": client_id,
        "redirect_uri": redirect_uri,
        "scope": scope,
        "state": state,
        "resource": resource,
    }
    if pkce is not None:
        params["code_challenge"] = pkce.challenge
        if method is not None:
            params["code_challenge_method"] = method
    return "/console/oauth/authorize?" + urlencode(params)


def consent(person: httpx2.Client, path: str, decision: str = "allow") -> httpx2.Response:
    """Open the consent page as the person and press Allow (or Deny)."""
    page = person.get(path)
    assert page.status_code == 200, page.text
    csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
    assert csrf, page.text
    return person.post(path, data={"csrfmiddlewaretoken": csrf[1], "decision": decision})


def redirect_params(response: httpx2.Response) -> dict[str, str]:
    assert response.status_code == 302, response.text
    location = response.headers["location"]
    assert location.startswith(REDIRECT_URI.split("?")[0]) or "callback" in location, location
    return {k: v[0] for k, v in parse_qs(urlsplit(location).query).items()}


def exchange(client: httpx2.Client, client_id: str, code: str, verifier: str, **extra):
    data = {
        "grant_type": "authorization_code",
        "code": code,
        "redirect_uri": REDIRECT_URI,
        "client_id": client_id,
        "code_verifier": verifier,
        **extra,
    }
    return client.post("/oauth/token", data=data)


def refresh(client: httpx2.Client, client_id: str, refresh_token: str) -> httpx2.Response:
    data = {"grant_type": "refresh_token", "refresh_token": refresh_token, "client_id": client_id}
    return client.post("/oauth/token", data=data)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}
