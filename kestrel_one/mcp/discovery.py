"""A stand-in for discovery_start until part C2's discovery lands.

h4 replaces this: the real module signs the request and sends it to the organization's pool
on commit, ingests the runner's report and sweeps past-deadline discoveries. This one only
records the pending discovery, so the API (part C1) can be built and tested beside it.
"""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from kestrel_one.execution.enrollment import call_pool_for
from kestrel_one.mcp.models import McpDiscovery, McpServer
from kestrel_one.mcp.profiles import server_profile
from runners.contract.mcp import profile_digest


def discovery_start(*, server: McpServer, requested_by=None) -> McpDiscovery:
    """A pending discovery of ``server`` (inside the caller's transaction)."""
    return McpDiscovery.objects.create(
        organization=server.organization,
        server=server,
        profile_sha256=profile_digest(server_profile(server)),
        pool=call_pool_for(server.organization),
        requested_by=requested_by,
        deadline_at=timezone.now() + timedelta(minutes=5),
    )
