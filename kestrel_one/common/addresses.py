"""The public addresses Kestrel One gives out: where people and clients reach it, and the
MCP endpoint of a Project (docs/mcp-endpoint.md)."""

from __future__ import annotations

from django.conf import settings


def public_origin(request) -> str:
    """Scheme and host people and clients reach Kestrel at, without a trailing slash:
    KESTREL_PUBLIC_URL when set, else the request's own (its Host held to ALLOWED_HOSTS)."""
    if settings.KESTREL_PUBLIC_URL:
        return settings.KESTREL_PUBLIC_URL
    return f"{request.scheme}://{request.get_host()}"


def mcp_endpoint_url(origin: str, org: str, prj: str) -> str:
    """A Project's MCP endpoint (kestrel_one/api/urls.py ``mcp-endpoint``)."""
    return f"{origin}/api/v1/orgs/{org}/projects/{prj}/mcp"
