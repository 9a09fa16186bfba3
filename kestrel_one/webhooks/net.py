"""Outbound safety for webhook deliveries: where a POST may go, and sending it there only.

A consumer URL is chosen by a tenant, so it must never become a way into the service's own
network (cloud metadata, databases, the broker). Every address the host resolves to is
checked; the request then connects to a checked address itself, with the URL's host name sent
in ``Host`` and used for SNI and certificate verification, so DNS cannot answer differently
between the check and the connection. Redirects are never followed; timeouts and the size of
the answer read are bounded.

This check complements network egress policy for the control workers; it does not replace it.
"""

from __future__ import annotations

import ipaddress
import socket
import ssl
import time
from dataclasses import dataclass
from functools import lru_cache
from urllib.parse import urlsplit

import urllib3
from django.conf import settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")
USER_AGENT = "KestrelOne-Webhooks/1"


class DestinationRefused(Exception):
    """The URL or an address it resolves to may not receive webhooks."""


class SendFailed(Exception):
    """The request could not be completed (connection, TLS, timeout)."""


@dataclass(frozen=True)
class Destination:
    scheme: str
    host: str  # ASCII (IDNA) host name or IP literal, without brackets
    port: int
    target: str  # path and query, as sent in the request line

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"


@dataclass(frozen=True)
class Answer:
    status: int
    body_preview: bytes


def destination_parse(url: str) -> Destination:
    """Check a URL's form: https in hosted mode, no credentials, a host, a valid port.

    Literal IP hosts are checked against the refused ranges here too; names are checked when
    they are resolved, at every delivery.
    """
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise DestinationRefused(f"not a valid URL: {exc}") from None
    allowed = {"https"} if settings.HOSTED else {"https", "http"}
    if parts.scheme not in allowed:
        raise DestinationRefused(
            "only https URLs are accepted" if settings.HOSTED else "only http(s) URLs are accepted"
        )
    if parts.username is not None or parts.password is not None:
        raise DestinationRefused("URLs with credentials are not accepted; use the signature")
    if not parts.hostname:
        raise DestinationRefused("the URL has no host")
    try:
        host = parts.hostname.encode("idna").decode("ascii")
    except UnicodeError:
        raise DestinationRefused("the URL's host is not a valid name") from None
    literal = _ip_literal(host)
    if literal is not None:
        reason = address_refusal(literal)
        if reason:
            raise DestinationRefused(f"{literal} is {reason}")
    target = parts.path or "/"
    if parts.query:
        target += f"?{parts.query}"
    return Destination(
        scheme=parts.scheme,
        host=host,
        port=port or (443 if parts.scheme == "https" else 80),
        target=target,
    )


def _ip_literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


@lru_cache(maxsize=8)
def _allowlist(entries: tuple[str, ...]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    return tuple(ipaddress.ip_network(entry, strict=False) for entry in entries)


def _allowlisted(address: IPAddress) -> bool:
    networks = _allowlist(tuple(settings.KESTREL_WEBHOOK_ALLOW_ADDRESSES))
    return any(address.version == net.version and address in net for net in networks)


def _embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 form carries (mapped, compatible, 6to4, Teredo, NAT64)."""
    if address.version != 6:
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    if address in _NAT64 or (address in _IPV4_COMPATIBLE and int(address) > 1):
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def _range_refusal(address: IPAddress) -> str | None:
    if address.is_unspecified:
        return "unspecified"
    if address.is_loopback:
        return "loopback"
    if address.is_link_local:
        return "link-local (cloud metadata lives here)"
    if address.version == 4 and address in _CGNAT:
        return "shared address space (CGNAT)"
    if address.is_multicast:
        return "multicast"
    if address.is_reserved:
        return "reserved"
    if address.is_private:
        return "private"
    if not address.is_global:
        return "not globally routable"
    return None


def address_refusal(address: IPAddress) -> str | None:
    """Why a POST may not go to this address, or None when it may.

    An IPv6 form that carries an IPv4 address is judged by both; the operator allowlist
    (development and tests only) admits an address or the IPv4 address it carries.
    """
    embedded = _embedded_ipv4(address)
    if _allowlisted(address) or (embedded is not None and _allowlisted(embedded)):
        return None
    if embedded is not None:
        inner = _range_refusal(embedded)
        if inner:
            return f"an IPv6 form of a {inner} IPv4 address"
    return _range_refusal(address)


def resolve(host: str, port: int) -> list[IPAddress]:
    """Every address the host resolves to, in the resolver's order, without duplicates."""
    literal = _ip_literal(host)
    if literal is not None:
        return [literal]
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise DestinationRefused(f"{host} does not resolve: {exc}") from None
    addresses: list[IPAddress] = []
    for info in infos:
        address = ipaddress.ip_address(info[4][0].split("%", 1)[0])
        if address not in addresses:
            addresses.append(address)
    return addresses


def destination_addresses(destination: Destination) -> list[IPAddress]:
    """Resolve once and check every answer: one refused address refuses the destination,
    so a name cannot mix a public address with an internal one."""
    addresses = resolve(destination.host, destination.port)
    if not addresses:
        raise DestinationRefused(f"{destination.host} resolves to no address")
    for address in addresses:
        reason = address_refusal(address)
        if reason:
            raise DestinationRefused(f"{destination.host} resolves to {address}, which is {reason}")
    return addresses


def _ssl_context() -> ssl.SSLContext:
    context = ssl.create_default_context()
    if settings.KESTREL_WEBHOOK_CA_BUNDLE:
        context.load_verify_locations(cafile=settings.KESTREL_WEBHOOK_CA_BUNDLE)
    return context


def _pool(destination: Destination, address: IPAddress, timeout: urllib3.Timeout):
    """A connection pool to the checked address that presents the URL's host name for SNI
    and verifies the certificate against that name, not against the address."""
    common = {"host": str(address), "port": destination.port, "timeout": timeout, "maxsize": 1}
    if destination.scheme == "https":
        return urllib3.HTTPSConnectionPool(
            **common,
            ssl_context=_ssl_context(),
            server_hostname=destination.host,
            assert_hostname=destination.host,
            cert_reqs="CERT_REQUIRED",
        )
    return urllib3.HTTPConnectionPool(**common)


def post(url: str, *, body: bytes, headers: dict[str, str]) -> Answer:
    """POST ``body`` to ``url`` after the checks above; the answer's status and first bytes.

    Raises DestinationRefused (nothing was sent) or SendFailed.
    """
    destination = destination_parse(url)
    addresses = destination_addresses(destination)
    total = float(settings.KESTREL_WEBHOOK_TIMEOUT_SECONDS)
    timeout = urllib3.Timeout(
        connect=min(float(settings.KESTREL_WEBHOOK_CONNECT_TIMEOUT_SECONDS), total),
        read=total,
        total=total,
    )
    request_headers = {
        **headers,
        "Host": destination.host_header,
        "User-Agent": USER_AGENT,
        "Content-Type": "application/json",
    }
    last_error: Exception | None = None
    for address in addresses:
        pool = _pool(destination, address, timeout)
        try:
            response = pool.urlopen(
                "POST",
                destination.target,
                body=body,
                headers=request_headers,
                redirect=False,
                retries=False,
                preload_content=False,
                assert_same_host=False,
            )
        except urllib3.exceptions.NewConnectionError as exc:
            last_error = exc  # this address refused the connection; try the next checked one
            pool.close()
            continue
        except urllib3.exceptions.HTTPError as exc:
            pool.close()
            raise SendFailed(_describe(exc)) from None
        try:
            preview = _read_bounded(response, deadline=time.monotonic() + total)
        finally:
            response.close()
            pool.close()
        return Answer(status=response.status, body_preview=preview)
    raise SendFailed(_describe(last_error) if last_error else "no address to connect to")


def _read_bounded(response, *, deadline: float) -> bytes:
    """Read at most the configured number of bytes, and stop at the deadline; the rest of an
    answer is never read."""
    limit = settings.KESTREL_WEBHOOK_MAX_RESPONSE_BYTES
    chunks: list[bytes] = []
    size = 0
    try:
        while size < limit and time.monotonic() < deadline:
            chunk = response.read(min(8192, limit - size), decode_content=False)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except urllib3.exceptions.HTTPError:
        pass  # the status line is what counts; a broken body does not change it
    return b"".join(chunks)[:512]


def _describe(exc: Exception) -> str:
    text = str(exc.__class__.__name__)
    reason = getattr(exc, "reason", None) or exc
    return f"{text}: {reason}"[:400]
