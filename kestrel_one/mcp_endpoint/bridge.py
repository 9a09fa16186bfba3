"""One Django request answered by the MCP SDK's Streamable HTTP transport.

The web server is WSGI (gunicorn's threads); the SDK's transport is ASGI. For each request
the view calls ``answer``, which runs the SDK's session manager, in stateless JSON mode,
under ``asgiref.async_to_sync``: an event loop of its own for this one request, while the
request's thread waits. ``sync_to_async(thread_sensitive=True)`` in the handlers then runs
Django's work back in that waiting thread, with the request's database connection, so no
connection or transaction ever crosses threads.

Stateless means that no web process holds anything between requests: the session a client
names is a database row (``McpSession``), looked up by the view, not by the SDK.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio
from asgiref.sync import async_to_sync
from mcp.server.lowlevel import Server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings


@dataclass
class Answer:
    status: int = 500
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""


def asgi_scope(request) -> dict:
    """The ASGI HTTP scope of a Django request (headers as the client sent them)."""
    headers = []
    for key, value in request.META.items():
        if key.startswith("HTTP_"):
            name = key[5:].replace("_", "-").lower()
        elif key in {"CONTENT_TYPE", "CONTENT_LENGTH"}:
            name = key.replace("_", "-").lower()
        else:
            continue
        headers.append((name.encode("latin-1"), str(value).encode("latin-1")))
    # The host Django has already held to ALLOWED_HOSTS (a request may carry none: HTTP/1.0).
    host = request.get_host()
    if "HTTP_HOST" not in request.META:
        headers.append((b"host", host.encode("latin-1")))
    name, _, port = host.rpartition(":") if ":" in host else (host, "", "")
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": request.scheme,
        "path": request.path,
        "raw_path": request.path.encode(),
        "query_string": request.META.get("QUERY_STRING", "").encode("latin-1"),
        "root_path": "",
        "headers": headers,
        "client": (request.META.get("REMOTE_ADDR", ""), 0),
        "server": (name, int(port) if port.isdigit() else 0),
    }


async def _answer(
    server: Server, scope: dict, body: bytes, security: TransportSecuritySettings, limit: int
) -> Answer:
    answer = Answer()
    finished = anyio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        # The client stays until the whole answer is written.
        await finished.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            answer.status = message["status"]
            answer.headers = [
                (key.decode("latin-1"), value.decode("latin-1"))
                for key, value in message.get("headers", [])
            ]
        elif message["type"] == "http.response.body":
            answer.body += message.get("body", b"")
            if not message.get("more_body", False):
                finished.set()

    manager = StreamableHTTPSessionManager(
        app=server,
        json_response=True,
        stateless=True,
        security_settings=security,
        max_request_body_size=limit,
    )
    try:
        async with manager.run():
            await manager.handle_request(scope, receive, send)
    finally:
        finished.set()
    return answer


def answer(
    request, server: Server, *, body: bytes, security: TransportSecuritySettings, limit: int
) -> Answer:
    """The SDK's answer to ``request`` (whose body the caller has read: ``body``)."""
    return async_to_sync(_answer)(server, asgi_scope(request), body, security, limit)
