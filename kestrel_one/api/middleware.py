"""Request ids and source addresses for logs and audit records."""

from __future__ import annotations

import re
import uuid

import structlog

from kestrel_one.common import context

_SAFE_REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{8,64}$")


class RequestIdMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        supplied = request.META.get("HTTP_X_REQUEST_ID", "")
        # A caller's id is kept for correlation only when it is plainly shaped.
        request_id = supplied if _SAFE_REQUEST_ID.match(supplied) else uuid.uuid4().hex
        request.request_id = request_id
        tokens = (
            context.request_id.set(request_id),
            context.source_address.set(request.META.get("REMOTE_ADDR", "")),
        )
        structlog.contextvars.bind_contextvars(request_id=request_id)
        try:
            response = self.get_response(request)
        finally:
            structlog.contextvars.unbind_contextvars("request_id")
            context.request_id.reset(tokens[0])
            context.source_address.reset(tokens[1])
        response["X-Request-Id"] = request_id
        return response
