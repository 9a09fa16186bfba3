"""Per-request facts that audit records carry: the request id and the source address."""

from __future__ import annotations

from contextvars import ContextVar

request_id: ContextVar[str | None] = ContextVar("kestrel_request_id", default=None)
source_address: ContextVar[str | None] = ContextVar("kestrel_source_address", default=None)
