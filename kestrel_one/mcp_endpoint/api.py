"""The MCP endpoint's HTTP view: ``/api/v1/orgs/{org}/projects/{prj}/mcp``.

Everything a REST request meets happens here first, with the REST API's own machinery:
token authentication (and the single-host loopback rule), the organization and Project
resolved through the principal (another organization's is the same 404), the scope, the
rate bound. Then the checks of this transport (Origin against DNS rebinding, body size,
the session the client names), and only then the SDK (``bridge``) speaks MCP.
"""

from __future__ import annotations

import json
from datetime import timedelta
from urllib.parse import urlsplit

from django.conf import settings
from django.db.models import Q
from django.http import HttpResponse
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from mcp.server.transport_security import TransportSecuritySettings
from rest_framework.exceptions import NotFound
from rest_framework.negotiation import BaseContentNegotiation

from kestrel_one.accounts.models import AUDIENCE_MCP
from kestrel_one.accounts.principal import missing_scope_message
from kestrel_one.api.base import ProjectScopedViewSet
from kestrel_one.common.addresses import public_origin
from kestrel_one.common.errors import KestrelError
from kestrel_one.common.jsontext import json_loads
from kestrel_one.common.throttling import SharedRateThrottle
from kestrel_one.governance.selectors import parse_mode
from kestrel_one.mcp_endpoint import bridge
from kestrel_one.mcp_endpoint.models import McpSession
from kestrel_one.mcp_endpoint.selectors import open_sessions
from kestrel_one.mcp_endpoint.server import Caller, build_server
from kestrel_one.threads.models import Thread
from policies import Mode

SESSION_HEADER = "Mcp-Session-Id"
SEEN_RESOLUTION = timedelta(minutes=1)


class PayloadTooLarge(KestrelError):
    status = 413
    code = "payload_too_large"


class OriginRefused(KestrelError):
    status = 403
    code = "origin_refused"


class McpRateThrottle(SharedRateThrottle):
    """At most ``KESTREL_MCP_RATE`` requests per caller, counted in the shared cache (every
    web process sees the same count).

    The caller is whoever holds the authority, not the token in hand (``holder_id``): an
    OAuth client's refreshed token, or a freshly minted one, counts with the ones before it.
    """

    scope = "mcp"
    rate_setting = "KESTREL_MCP_RATE"

    def get_cache_key(self, request, view):
        principal = request.auth
        ident = principal.holder_id if principal is not None else self.get_ident(request)
        return self.cache_format % {"scope": self.scope, "ident": ident}


class JsonErrors(BaseContentNegotiation):
    """Kestrel's own answers (errors) are JSON whatever the Accept header says: an MCP
    client accepts application/json and text/event-stream, and the transport, not DRF,
    negotiates what the SDK answers."""

    def select_parser(self, request, parsers):
        return parsers[0]

    def select_renderer(self, request, renderers, format_suffix=None):
        return renderers[0], renderers[0].media_type


def _resource_metadata_url(request) -> str:
    return f"{public_origin(request)}/.well-known/oauth-protected-resource{request.path}"


def _security(request) -> TransportSecuritySettings:
    """The SDK's DNS-rebinding check, given what this service already allows: Django has
    held the Host to ALLOWED_HOSTS; an Origin must be this service's own or a listed one."""
    origins = {public_origin(request), f"{request.scheme}://{request.get_host()}"}
    origins.update(settings.KESTREL_MCP_ALLOWED_ORIGINS)
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=[request.get_host()],
        allowed_origins=sorted(origins),
    )


def _json_rpc_message(body: bytes):
    """The decoded message, or None for a body that is no JSON (the SDK answers it with its
    parse error), nested too deeply included (``json_loads``)."""
    try:
        return json_loads(body)
    except ValueError:
        return None


class McpEndpointViewSet(ProjectScopedViewSet):
    """Streamable HTTP (MCP 2025-11-25 and 2026-07-28) for one Project's governed tools."""

    scope_map = {"POST": "projects:read", "GET": "projects:read", "DELETE": "projects:read"}
    # Besides the API's own tokens, the ones MCP clients get through OAuth, which work here
    # only (ApiToken.audience).
    token_audiences = (AUDIENCE_MCP,)
    throttle_classes = [McpRateThrottle]
    content_negotiation_class = JsonErrors

    def get_authenticate_header(self, request):
        # Where an OAuth client learns how to get a token (RFC 9728, docs/mcp-endpoint.md).
        return f'Bearer resource_metadata="{_resource_metadata_url(request)}"'

    def _check_origin(self, request) -> None:
        origin = request.headers.get("Origin")
        if origin is None:
            return
        allowed = _security(request).allowed_origins
        parts = urlsplit(origin)
        if origin not in allowed or parts.path not in {"", "/"}:
            raise OriginRefused(
                f"Requests from the web origin {origin[:100]!r} are refused (DNS rebinding "
                "protection). A browser client's origin must be listed in "
                "KESTREL_MCP_ALLOWED_ORIGINS.",
                details={"Origin": ["not allowed"]},
            )

    def _body(self, request) -> bytes:
        limit = settings.KESTREL_MCP_MAX_REQUEST_BYTES
        length = request.META.get("CONTENT_LENGTH") or "0"
        if not length.isdigit() or int(length) > limit:
            raise PayloadTooLarge(
                f"An MCP request may be at most {limit} bytes.",
                details={"Content-Length": [f"at most {limit}"]},
            )
        body = request._request.body
        if len(body) > limit:
            raise PayloadTooLarge(
                f"An MCP request may be at most {limit} bytes.",
                details={"Content-Length": [f"at most {limit}"]},
            )
        return body

    def _session(self, request) -> McpSession | None:
        session_id = request.headers.get(SESSION_HEADER)
        if session_id is None:
            return None
        session = (
            open_sessions(self.project)
            .filter(public_id=session_id[:40], agent_id=self.principal.agent_id)
            .first()
        )
        if session is None:
            # The MCP spec's answer to an unknown or ended session: start a new one.
            raise NotFound()
        return session

    def _named_thread(self, request) -> Thread | None:
        thread_id = request.query_params.get("thread")
        if thread_id is None:
            return None
        thread = Thread.objects.filter(public_id=thread_id[:40], project=self.project).first()
        if thread is None:
            raise NotFound()
        thread.project = self.project
        return thread

    def _caller(self, request, session: McpSession | None) -> Caller:
        mode = parse_mode(request.query_params.get("mode"))
        if session is not None:
            mode = Mode(session.mode)
        return Caller(
            principal=self.principal,
            organization=self.organization,
            project=self.project,
            mode=mode,
            session=session,
            thread=self._named_thread(request),
            base_url=public_origin(request),
            call_wait_s=settings.KESTREL_MCP_CALL_WAIT_SECONDS,
            write_refused=(
                None
                if "projects:write" in self.principal.scopes_in(self.organization)
                else missing_scope_message(self.principal, "projects:write", self.organization)
            ),
        )

    @extend_schema(request=OpenApiTypes.OBJECT, responses={200: OpenApiTypes.OBJECT})
    def exchange(self, request, *args, **kwargs):
        """One JSON-RPC message (MCP Streamable HTTP POST)."""
        self._check_origin(request)
        body = self._body(request)
        session = self._session(request)
        caller = self._caller(request, session)
        message = _json_rpc_message(body)
        answer = bridge.answer(
            request,
            build_server(caller),
            body=body,
            security=_security(request),
            limit=settings.KESTREL_MCP_MAX_REQUEST_BYTES,
        )
        response = HttpResponse(answer.body, status=answer.status)
        for key, value in answer.headers:
            if key.lower() not in {"content-length", "mcp-session-id"}:
                response[key] = value
        if session is not None:
            # Marked used at most once a minute: the idle limit is hours, and a write per
            # request would cost every call.
            now = timezone.now()
            if session.last_seen_at < now - SEEN_RESOLUTION:
                McpSession.objects.filter(pk=session.pk).update(last_seen_at=now)
            response[SESSION_HEADER] = session.public_id
        elif (
            isinstance(message, dict)
            and message.get("method") == "initialize"
            and answer.status == 200
        ):
            response[SESSION_HEADER] = self._open_session(caller, message).public_id
        return response

    def _open_session(self, caller: Caller, message: dict) -> McpSession:
        params = message.get("params") if isinstance(message.get("params"), dict) else {}
        client = params.get("clientInfo") if isinstance(params.get("clientInfo"), dict) else {}
        name = client.get("name") if isinstance(client.get("name"), str) else ""
        version = params.get("protocolVersion")
        holder = self.principal.holder_id
        self._make_room(holder)
        return McpSession.objects.create(
            organization=self.organization,
            project=self.project,
            actor_id=self.principal.actor_id,
            agent_id=self.principal.agent_id,
            holder_id=holder,
            mode=caller.mode.value,
            thread=caller.thread,
            client_name=name[:200],
            protocol_version=version[:32] if isinstance(version, str) else "",
        )

    def _make_room(self, holder: str) -> None:
        """Before a new session of ``holder``: theirs that can no longer be used (ended, idle
        past the limit) go, and of the rest only the most recently used
        ``KESTREL_MCP_SESSIONS_PER_CALLER`` - 1 stay. A client that opens a session per
        connection, or a caller that opens them on purpose, leaves no more rows than that,
        however many tokens it holds; a session pushed out answers 404 and its client starts
        a new one, as after the idle limit."""
        mine = McpSession.objects.filter(organization=self.organization, holder_id=holder)
        idle = timezone.now() - timedelta(seconds=settings.KESTREL_MCP_SESSION_IDLE_SECONDS)
        mine.filter(Q(ended_at__isnull=False) | Q(last_seen_at__lt=idle)).delete()
        kept = mine.order_by("-last_seen_at", "-pk").values("pk")[
            : settings.KESTREL_MCP_SESSIONS_PER_CALLER - 1
        ]
        mine.exclude(pk__in=kept).delete()

    @extend_schema(responses={405: OpenApiTypes.OBJECT})
    def stream(self, request, *args, **kwargs):
        """No server-to-client stream: every answer comes in the POST's response."""
        self._check_origin(request)
        response = HttpResponse(
            json.dumps(
                {
                    "error": {
                        "code": "method_not_allowed",
                        "message": "This MCP endpoint answers each request in its POST "
                        "response and offers no GET stream.",
                        "details": None,
                    }
                }
            ),
            status=405,
            content_type="application/json",
        )
        response["Allow"] = "POST, DELETE"
        return response

    @extend_schema(responses={204: None})
    def end(self, request, *args, **kwargs):
        """End the session the client names (its thread stays, with its history)."""
        self._check_origin(request)
        session = self._session(request)
        if session is None:
            raise NotFound()
        McpSession.objects.filter(pk=session.pk).update(ended_at=timezone.now())
        return HttpResponse(status=204)
