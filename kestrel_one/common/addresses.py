"""The public addresses Kestrel One gives out (where people and clients reach it, and the
MCP endpoint of a Project: docs/mcp-endpoint.md), and the one way a client's address is
counted in a limit."""

from __future__ import annotations

import ipaddress

from django.conf import settings

# An IPv6 client usually holds a whole /64 (one site's subnet): counted per address, it would
# pick a fresh one for every attempt.
IPV6_CLIENT_PREFIX = 64


def client_ip(address: str | None) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``address`` (REMOTE_ADDR) as an IP address, an IPv4-mapped IPv6 one as its IPv4 and
    without a zone; None for no address or one that does not parse."""
    if not address:
        return None
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def client_network(address: str | None) -> str | None:
    """What a per-client limit counts ``address`` as: an IPv4 address itself, an IPv6 one as
    the first address of its /64, None for none (``client_ip``)."""
    ip = client_ip(address)
    if isinstance(ip, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((ip, IPV6_CLIENT_PREFIX), strict=False).network_address)
    return None if ip is None else str(ip)


def public_origin(request) -> str:
    """Scheme and host people and clients reach Kestrel at, without a trailing slash:
    KESTREL_PUBLIC_URL when set, else the request's own (its Host held to ALLOWED_HOSTS)."""
    if settings.KESTREL_PUBLIC_URL:
        return settings.KESTREL_PUBLIC_URL
    return f"{request.scheme}://{request.get_host()}"


def mcp_endpoint_url(origin: str, org: str, prj: str) -> str:
    """A Project's MCP endpoint (kestrel_one/api/urls.py ``mcp-endpoint``)."""
    return f"{origin}/api/v1/orgs/{org}/projects/{prj}/mcp"
