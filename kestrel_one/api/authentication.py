"""REST API authentication: tokens only, plus the single-host loopback rule.

Session cookies are deliberately not accepted here (a browser session is not an API bearer
token), so CSRF on the API cannot arise. A request that presents a token which does not
verify gets 401 and never falls back to the anonymous loopback rule.

The anonymous loopback rule itself is ambient authority, as a cookie is: a web page of any
site open in a browser on the same machine can send requests to 127.0.0.1 (a form, or a
``fetch`` with no body, needs no preflight). So a loopback request that a browser marks as
sent from another origin (``Sec-Fetch-Site``, ``Origin``) is never the local agent, nor is
one a reverse proxy on the same machine relayed (``Forwarded``, ``X-Forwarded-For``): its
address is loopback, its client is anyone.
"""

from __future__ import annotations

import hmac

from django.conf import settings
from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication

from kestrel_one.accounts.backends import is_server_token, local_owner
from kestrel_one.accounts.principal import Principal, PrincipalKind
from kestrel_one.accounts.services import audit_authentication_failure, token_authenticate
from kestrel_one.common.addresses import client_ip

TOKEN_HEADER = "HTTP_X_KESTREL_TOKEN"  # noqa: S105 - a header name


def presented_token(request) -> str | None:
    """The token the request carries, from either header; '' when a header is present but empty.

    Both headers may be sent only with the same token: which of two credentials a request
    acts with is never guessed.
    """
    authorization = request.META.get("HTTP_AUTHORIZATION")
    header = request.META.get(TOKEN_HEADER)
    bearer = None
    if authorization is not None:
        scheme, _, credentials = authorization.partition(" ")
        if scheme.lower() != "bearer":
            raise exceptions.AuthenticationFailed("Use 'Authorization: Bearer TOKEN'.")
        bearer = credentials.strip()
    if header is not None:
        header = header.strip()
        if bearer is not None and not hmac.compare_digest(bearer.encode(), header.encode()):
            raise exceptions.AuthenticationFailed(
                "Authorization and X-Kestrel-Token carry different tokens; send one."
            )
    return bearer if bearer is not None else header


def is_loopback(address: str | None) -> bool:
    """True for 127.0.0.0/8, ::1 and IPv4-mapped loopback. Only REMOTE_ADDR counts."""
    ip = client_ip(address)
    return ip is not None and ip.is_loopback


# Headers a reverse proxy adds for the client it relays (RFC 7239 and the common ones).
PROXY_HEADERS = {
    "HTTP_FORWARDED": "Forwarded",
    "HTTP_X_FORWARDED_FOR": "X-Forwarded-For",
    "HTTP_X_REAL_IP": "X-Real-IP",
}


def proxied_for(request) -> str | None:
    """The header showing that a proxy on this machine relayed ``request`` for another client,
    or None. A local process calls directly and sends none of them."""
    for meta, header in PROXY_HEADERS.items():
        if meta in request.META:
            return header
    return None


def cross_origin_sender(request) -> str | None:
    """What shows that a browser sent ``request`` from a page of another origin, or None.

    Browsers mark every request: ``Sec-Fetch-Site`` (``same-origin`` from this server's own
    pages, ``none`` when the person typed the address), and ``Origin`` on a cross-origin
    ``fetch`` and on every form POST. Another port on localhost is another origin. A local
    process (curl, an agent, an MCP client) sends neither.
    """
    fetch_site = request.META.get("HTTP_SEC_FETCH_SITE")
    if fetch_site is not None and fetch_site not in ("same-origin", "none"):
        return f"Sec-Fetch-Site: {fetch_site}"
    origin = request.META.get("HTTP_ORIGIN")
    if origin is not None and origin != f"{request.scheme}://{request.get_host()}":
        return f"Origin: {origin}"
    return None


def local_agent(*, anonymous: bool) -> Principal:
    """Single-host mode: the loopback caller without a person's token. It addresses what the
    local owner may address, with LOCAL_AGENT_SCOPES only, and is never a person."""
    owner = local_owner()
    if owner is None:
        raise exceptions.AuthenticationFailed(
            "No local owner exists yet; run 'python manage.py bootstrap'."
        )
    return Principal(PrincipalKind.LOCAL_AGENT, acting_for=owner, anonymous=anonymous)


class KestrelTokenAuthentication(BaseAuthentication):
    def authenticate(self, request):
        token_value = presented_token(request)
        if token_value is not None:
            return self._authenticate_token(token_value, request)
        if settings.SINGLE_HOST and not settings.KESTREL_SERVER_TOKEN:
            if is_loopback(request.META.get("REMOTE_ADDR")):
                sent_by = cross_origin_sender(request)
                if sent_by is not None:
                    raise exceptions.AuthenticationFailed(
                        f"A web page of another origin ({sent_by}) sent this request, so it "
                        "is not the local agent: a local process calls without a browser, "
                        "and anything else sends a token (Authorization: Bearer)."
                    )
                relayed = proxied_for(request)
                if relayed is not None:
                    raise exceptions.AuthenticationFailed(
                        f"A proxy relayed this request for another client ({relayed}), so it "
                        "is not the local agent: only a process on this machine calling it "
                        "directly is. Send a token (Authorization: Bearer), or set "
                        "KESTREL_SERVER_TOKEN when the server is reachable through a proxy."
                    )
                return None, local_agent(anonymous=True)
        return None

    def _authenticate_token(self, value: str, request):
        if not value:
            raise exceptions.AuthenticationFailed("The token is empty.")
        if is_server_token(value):
            # The server token only opens the door to callers that are not on loopback; what
            # they may do is the local agent's. A person's authority needs a person's token.
            return None, local_agent(anonymous=False)
        token = token_authenticate(value)
        if token is None:
            # A revoked or expired token of a known organization is worth an audit row there.
            audit_authentication_failure(value)
            raise exceptions.AuthenticationFailed("The token is invalid, expired or revoked.")
        if token.audience:
            # A token for one resource (an MCP client's, through OAuth) works only on the
            # views that serve it, never on the rest of the API (RFC 8707 audience).
            view = (getattr(request, "parser_context", None) or {}).get("view")
            if token.audience not in getattr(view, "token_audiences", ()):
                raise exceptions.AuthenticationFailed(
                    f"This token is for the {token.audience} endpoint of its Project only "
                    "(an MCP client got it through OAuth); the rest of the API takes a token "
                    "made on the console's Tokens page."
                )
        return token.user, Principal(PrincipalKind.TOKEN, user=token.user, token=token)

    def authenticate_header(self, request) -> str:
        # Makes DRF answer 401 (not 403) to unauthenticated requests.
        return 'Bearer realm="kestrel"'
