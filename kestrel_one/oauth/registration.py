"""Dynamic client registration (RFC 7591) for MCP clients: public clients only.

A registration is a name and redirect URIs; it grants nothing. Redirect URIs are https, or
http on a loopback address (RFC 8252), never with a fragment, userinfo or whitespace.
Registrations are bounded per address and overall per hour, and the body is bounded.
"""

from __future__ import annotations

import unicodedata
from datetime import timedelta
from urllib.parse import urlsplit

from django.conf import settings
from django.http import JsonResponse
from django.utils import timezone

from kestrel_one.common.jsontext import json_loads
from kestrel_one.oauth import services

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
MAX_REDIRECT_URIS = 10
MAX_REDIRECT_URI_LENGTH = 2000
MAX_CLIENT_NAME = 100
MAX_BODY_BYTES = 16 * 1024
DEFAULT_CLIENT_NAME = "Unnamed MCP client"


class RegistrationRefused(Exception):
    def __init__(self, error: str, description: str, status: int = 400):
        super().__init__(description)
        self.error = error
        self.description = description
        self.status = status

    def response(self) -> JsonResponse:
        body = {"error": self.error, "error_description": self.description}
        response = JsonResponse(body, status=self.status)
        response["Cache-Control"] = "no-store"
        if self.status == 429:
            response["Retry-After"] = "3600"
        return response


def redirect_uri_problem(uri: str) -> str | None:
    """Why this redirect URI is refused, or None."""
    if len(uri) > MAX_REDIRECT_URI_LENGTH:
        return f"is longer than {MAX_REDIRECT_URI_LENGTH} characters"
    if any(c.isspace() or unicodedata.category(c).startswith("C") for c in uri):
        return "contains whitespace or control characters"
    if "#" in uri:
        return "has a fragment (RFC 6749 section 3.1.2)"
    try:
        parts = urlsplit(uri)
        parts.port  # noqa: B018 - raises on a malformed port
    except ValueError:
        return "is not a valid URL"
    if parts.username is not None or parts.password is not None:
        return "carries a user name or password"
    if not parts.hostname:
        return "has no host"
    if parts.scheme == "https":
        return None
    if parts.scheme == "http":
        if parts.hostname in LOOPBACK_HOSTS:
            return None
        return "uses http on a host other than 127.0.0.1, localhost or [::1]; use https"
    return "must use https (or http on 127.0.0.1, localhost or [::1])"


def _client_name(value) -> str:
    if value is None:
        return DEFAULT_CLIENT_NAME
    if not isinstance(value, str):
        raise RegistrationRefused("invalid_client_metadata", "client_name must be a string.")
    name = " ".join(value.split())
    if any(unicodedata.category(c).startswith("C") for c in name):
        raise RegistrationRefused(
            "invalid_client_metadata", "client_name must not contain control characters."
        )
    if len(name) > MAX_CLIENT_NAME:
        raise RegistrationRefused(
            "invalid_client_metadata", f"client_name is longer than {MAX_CLIENT_NAME} characters."
        )
    return name or DEFAULT_CLIENT_NAME


def _string_list(data: dict, field: str, default: list[str]) -> list[str]:
    value = data.get(field, default)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RegistrationRefused(
            "invalid_client_metadata", f"{field} must be an array of strings."
        )
    return value


def parse_registration(body: bytes) -> tuple[str, list[str], list[str]]:
    """(client name, redirect URIs, scopes) from an RFC 7591 request, or RegistrationRefused."""
    if len(body) > MAX_BODY_BYTES:
        raise RegistrationRefused(
            "invalid_client_metadata", f"The request is larger than {MAX_BODY_BYTES} bytes.", 413
        )
    try:
        data = json_loads(body)
    except (ValueError, UnicodeDecodeError):
        raise RegistrationRefused("invalid_client_metadata", "The body must be JSON.") from None
    if not isinstance(data, dict):
        raise RegistrationRefused("invalid_client_metadata", "The body must be a JSON object.")
    redirect_uris = _string_list(data, "redirect_uris", [])
    if not redirect_uris:
        raise RegistrationRefused("invalid_redirect_uri", "redirect_uris must name at least one.")
    if len(redirect_uris) > MAX_REDIRECT_URIS:
        raise RegistrationRefused(
            "invalid_redirect_uri", f"At most {MAX_REDIRECT_URIS} redirect_uris."
        )
    for uri in redirect_uris:
        problem = redirect_uri_problem(uri)
        if problem is not None:
            raise RegistrationRefused("invalid_redirect_uri", f"{uri[:200]!r} {problem}.")
    method = data.get("token_endpoint_auth_method", "none")
    if method != "none":
        raise RegistrationRefused(
            "invalid_client_metadata",
            "Only public clients are registered: token_endpoint_auth_method must be 'none' "
            "(the client proves itself with PKCE, not a secret).",
        )
    grant_types = _string_list(data, "grant_types", ["authorization_code", "refresh_token"])
    if "authorization_code" not in grant_types or not set(grant_types) <= {
        "authorization_code",
        "refresh_token",
    }:
        raise RegistrationRefused(
            "invalid_client_metadata",
            "grant_types must be authorization_code (and may add refresh_token).",
        )
    if _string_list(data, "response_types", ["code"]) != ["code"]:
        raise RegistrationRefused("invalid_client_metadata", "response_types must be ['code'].")
    scope = data.get("scope", " ".join(services.OAUTH_SCOPES))
    if not isinstance(scope, str) or not set(scope.split()) <= set(services.OAUTH_SCOPES):
        raise RegistrationRefused(
            "invalid_client_metadata",
            f"scope may name only {', '.join(services.OAUTH_SCOPES)}.",
        )
    return _client_name(data.get("client_name")), redirect_uris, scope.split()


def check_rate(remote_addr: str | None) -> None:
    since = timezone.now() - timedelta(hours=1)
    here, everywhere = services.registrations_since(since=since, remote_addr=remote_addr)
    if (
        here >= settings.KESTREL_OAUTH_REGISTRATIONS_PER_ADDRESS_HOUR
        or everywhere >= settings.KESTREL_OAUTH_REGISTRATIONS_PER_HOUR
    ):
        raise RegistrationRefused(
            "temporarily_unavailable",
            "Too many clients were registered in the last hour; try again later.",
            429,
        )
