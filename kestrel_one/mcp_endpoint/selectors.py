"""Reads of the MCP endpoint's sessions, for the console's project page."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db.models import QuerySet
from django.utils import timezone

from kestrel_one.mcp_endpoint.models import McpSession


def open_sessions(project) -> QuerySet[McpSession]:
    """The project's sessions a client can still use (not ended, not idle past the limit),
    most recently used first."""
    idle = timedelta(seconds=settings.KESTREL_MCP_SESSION_IDLE_SECONDS)
    return (
        McpSession.objects.filter(
            project=project, ended_at__isnull=True, last_seen_at__gte=timezone.now() - idle
        )
        .select_related("thread")
        .order_by("-last_seen_at", "-pk")
    )
