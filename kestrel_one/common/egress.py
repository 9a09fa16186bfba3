"""The one egress client: every request the control plane makes to the outside world.

Host adapters (a provider's API with a tenant's credential) and webhook deliveries (a URL a
tenant chose) both go through here, so the rules hold for both:

- the host name is resolved **once** and every address it resolves to is checked; one refused
  address refuses the destination (loopback, private, link-local and cloud metadata, CGNAT,
  multicast, reserved, unspecified, and the IPv6 forms that carry a refused IPv4 address);
- the connection goes to a checked address itself, with the original host name in ``Host``,
  in SNI and in certificate verification, so a DNS answer that changes between the check and
  the connection cannot move the request elsewhere;
- TLS is verified (system CAs, plus the operator's extra bundle); a 3xx answer is refused,
  never followed; the time of the whole exchange and the bytes read are bounded (over the
  bound fails, it does not truncate);
- messages of the exceptions raised here name the origin (scheme, host, port), never a path,
  a query, a request header or a body (a webhook URL's path often carries a consumer's
  token, and an adapter's headers carry a credential), nor the address a refused name
  resolves to (the operator's log has it): a tenant learns no internal address by naming it.

Operator settings (docs/operations.md): ``KESTREL_EGRESS_HOST_OVERRIDES`` points an exact host
name at a test address (which is then allowed even on loopback) and
``KESTREL_EGRESS_CA_BUNDLE`` adds a CA; both are refused in hosted mode unless
``KESTREL_EGRESS_OVERRIDES_IN_HOSTED`` is set, at startup and again here at every request.

This check complements network egress policy for the control workers; it does not replace it.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
import ssl
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any
from urllib.parse import urlsplit

import urllib3
from django.conf import settings

__all__ = [
    "EGRESS_FAILURE_CODES",
    "Destination",
    "EgressAnswer",
    "EgressFailed",
    "EgressRefused",
    "EgressStream",
    "address_refusal",
    "destination_addresses",
    "destination_parse",
    "egress_request",
    "egress_stream",
    "host_overrides_parse",
]

logger = logging.getLogger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")
USER_AGENT = "KestrelOne/1"
_READ_SIZE = 64 * 1024

EGRESS_FAILURE_CODES = frozenset(
    {
        "redirect_refused",
        "tls_failed",
        "connect_failed",
        "timeout",
        "response_too_large",
        "protocol_error",
    }
)


class EgressRefused(Exception):
    """The destination may not be reached; nothing was sent."""

    code = "destination_refused"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class EgressFailed(Exception):
    """The request was attempted and did not complete; ``code`` says how.

    ``status`` is the answer's status when there was one (a refused redirect).
    """

    def __init__(self, code: str, message: str, *, status: int | None = None):
        if code not in EGRESS_FAILURE_CODES:
            raise ValueError(f"unknown egress failure code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status


@dataclass(frozen=True)
class EgressAnswer:
    """A complete answer: its status, its headers (lower-case names) and its whole body."""

    status: int
    headers: Mapping[str, str]
    body: bytes


@dataclass(frozen=True)
class Destination:
    """Where a URL points: its scheme, host (ASCII, lower case, no brackets), port and the
    path and query sent in the request line."""

    scheme: str
    host: str
    port: int
    target: str

    @property
    def default_port(self) -> int:
        return 443 if self.scheme == "https" else 80

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == self.default_port else f"{host}:{self.port}"

    @property
    def origin(self) -> str:
        """What messages may name: never the path or the query."""
        return f"{self.scheme}://{self.host_header}"


# Addresses and ranges ----------------------------------------------------------------------


def _ip_literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 form carries (mapped, compatible, 6to4, Teredo, NAT64)."""
    if not isinstance(address, ipaddress.IPv6Address):
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
    if address.version == 6 and address.is_site_local:
        # fec0::/10: deprecated, but routed inside some networks, and "global" to ipaddress.
        return "site-local"
    if not address.is_global:
        return "not globally routable"
    return None


def _allowed(address: IPAddress, allow: Sequence[IPNetwork]) -> bool:
    return any(address.version == net.version and address in net for net in allow)


def address_refusal(address: IPAddress, *, allow: Sequence[IPNetwork] = ()) -> str | None:
    """Why a request may not go to this address, or None when it may.

    An IPv6 form that carries an IPv4 address is judged by both; ``allow`` (a caller's
    development allowlist, e.g. webhooks') admits an address or the IPv4 address it carries.
    """
    embedded = _embedded_ipv4(address)
    if _allowed(address, allow) or (embedded is not None and _allowed(embedded, allow)):
        return None
    if embedded is not None:
        inner = _range_refusal(embedded)
        if inner:
            return f"an IPv6 form of a {inner} IPv4 address"
    return _range_refusal(address)


# URLs, resolution and the operator's overrides ----------------------------------------------


def destination_parse(url: str, *, allow_http: bool = False) -> Destination:
    """Check a URL's form: https (http only when the caller allows it), no credentials in it,
    a host, a valid port. An IP literal host is checked against the refused ranges at once
    (unless an override names it); a name is checked when it is resolved, at every request."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise EgressRefused("not a valid URL") from None
    schemes = {"https", "http"} if allow_http else {"https"}
    if parts.scheme not in schemes:
        raise EgressRefused(
            "only http(s) URLs are accepted" if allow_http else "only https URLs are accepted"
        )
    if parts.username is not None or parts.password is not None:
        raise EgressRefused("URLs with credentials in them are not accepted")
    if not parts.hostname:
        raise EgressRefused("the URL has no host")
    try:
        host = parts.hostname.encode("idna").decode("ascii").lower()
    except UnicodeError:
        raise EgressRefused("the URL's host is not a valid name") from None
    target = parts.path or "/"
    if parts.query:
        target += f"?{parts.query}"
    return Destination(
        scheme=parts.scheme,
        host=host,
        port=port or (443 if parts.scheme == "https" else 80),
        target=target,
    )


def host_overrides_parse(
    raw: str | None, *, name: str = "KESTREL_EGRESS_HOST_OVERRIDES"
) -> dict[str, tuple[str, int | None]]:
    """``"host=addr:port,host2=addr"`` as ``{host: (addr, port or None)}``.

    The address must be an IP literal (``[::1]:8443`` for IPv6): an override never resolves.
    Raises ValueError naming ``name`` on a malformed entry (settings turn it into
    ImproperlyConfigured)."""
    overrides: dict[str, tuple[str, int | None]] = {}
    for entry in (raw or "").split(","):
        entry = entry.strip()
        if not entry:
            continue
        host, sep, target = entry.partition("=")
        host = host.strip().lower().rstrip(".")
        target = target.strip()
        if not sep or not host or not target or "/" in host or ":" in host:
            raise ValueError(f"{name}: {entry!r} is not host=address[:port]")
        address, port = _split_address(target, name=name, entry=entry)
        overrides[host] = (address, port)
    return overrides


def _split_address(target: str, *, name: str, entry: str) -> tuple[str, int | None]:
    if target.startswith("["):
        address, _, rest = target[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ("" if not rest else None)
    elif target.count(":") == 1:
        address, port_text = target.split(":")
    else:
        address, port_text = target, ""
    if port_text is None or _ip_literal(address) is None:
        raise ValueError(f"{name}: {entry!r} must point at an IP address, optionally :port")
    if port_text == "":
        return address, None
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"{name}: {entry!r} has an invalid port")
    return address, int(port_text)


def _overrides() -> Mapping[str, tuple[str, int | None]]:
    value = getattr(settings, "KESTREL_EGRESS_HOST_OVERRIDES", None) or {}
    if isinstance(value, str):  # set as the environment's string form (tests, shells)
        return host_overrides_parse(value)
    return value


def _ca_bundles(extra: Iterable[str]) -> tuple[str, ...]:
    bundle = getattr(settings, "KESTREL_EGRESS_CA_BUNDLE", None)
    return tuple(path for path in (bundle, *extra) if path)


def _operator_settings_refusal() -> str | None:
    """Overrides and an extra CA are for development and tests; in hosted mode only when the
    operator said so explicitly (settings refuse to start otherwise; this is the same rule
    for a process whose settings were changed after startup)."""
    if not settings.HOSTED or getattr(settings, "KESTREL_EGRESS_OVERRIDES_IN_HOSTED", False):
        return None
    for name in ("KESTREL_EGRESS_HOST_OVERRIDES", "KESTREL_EGRESS_CA_BUNDLE"):
        if getattr(settings, name, None):
            return f"{name} is refused in hosted mode unless KESTREL_EGRESS_OVERRIDES_IN_HOSTED=1"
    return None


def resolve(host: str, port: int) -> list[IPAddress]:
    """Every address the host resolves to, in the resolver's order, without duplicates.
    A name that does not resolve is a refused destination (nothing can be sent)."""
    literal = _ip_literal(host)
    if literal is not None:
        return [literal]
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        raise EgressRefused(f"{host} does not resolve") from None
    addresses: list[IPAddress] = []
    for info in infos:
        address = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        if address not in addresses:
            addresses.append(address)
    return addresses


def destination_addresses(
    destination: Destination, *, allow: Sequence[IPNetwork] = ()
) -> list[tuple[IPAddress, int]]:
    """The checked (address, port) pairs to connect to, in order.

    An operator override for exactly this host name is the only answer (no lookup, any
    address). Otherwise the name is resolved once and every answer is checked: one refused
    address refuses the destination, so a name cannot mix a public address with an internal
    one."""
    refusal = _operator_settings_refusal()
    if refusal:
        raise EgressRefused(refusal)
    override = _overrides().get(destination.host)
    if override is not None:
        override_address, override_port = override
        return [(ipaddress.ip_address(override_address), override_port or destination.port)]
    addresses = resolve(destination.host, destination.port)
    if not addresses:
        raise EgressRefused(f"{destination.host} resolves to no address")
    for address in addresses:
        reason = address_refusal(address, allow=allow)
        if reason and _ip_literal(destination.host) is not None:
            raise EgressRefused(f"{address} is {reason}")
        if reason:
            # Not the address: whoever chose the name (a tenant's webhook URL, an adapter's
            # host) would learn what an internal name resolves to. The operator's log has it.
            logger.warning(
                "egress refused",
                extra={"host": destination.host, "address": str(address), "reason": reason},
            )
            raise EgressRefused(f"{destination.host} resolves to an address that is {reason}")
    return [(address, destination.port) for address in addresses]


# TLS and connections ------------------------------------------------------------------------


def _file_stamp(path: str) -> tuple[str, float]:
    try:
        return path, os.stat(path).st_mtime
    except OSError:
        return path, -1.0


@lru_cache(maxsize=16)
def _ssl_context_cached(bundles: tuple[tuple[str, float], ...]) -> ssl.SSLContext:
    # Loading the system CAs costs milliseconds; one context per set of bundles (and their
    # modification times) is reused. Hostname checking stays the ssl module's own, against
    # the server_hostname given at each connection: urllib3 never changes this context.
    context = ssl.create_default_context()
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    for path, _ in bundles:
        context.load_verify_locations(cafile=path)
    return context


def _ssl_context(bundles: tuple[str, ...]) -> ssl.SSLContext:
    try:
        return _ssl_context_cached(tuple(_file_stamp(path) for path in bundles))
    except (OSError, ssl.SSLError):
        raise EgressFailed("tls_failed", "an extra CA bundle could not be loaded") from None


def _pool(
    destination: Destination,
    address: IPAddress,
    port: int,
    timeout: urllib3.Timeout,
    bundles: tuple[str, ...],
) -> urllib3.HTTPConnectionPool:
    """A pool of one connection to the checked address that presents the URL's host name for
    SNI, and has the certificate verified against that name (not against the address)."""
    if destination.scheme == "https":
        return urllib3.HTTPSConnectionPool(
            host=str(address),
            port=port,
            timeout=timeout,
            maxsize=1,
            retries=False,
            ssl_context=_ssl_context(bundles),
            server_hostname=destination.host,
            cert_reqs="CERT_REQUIRED",
        )
    return urllib3.HTTPConnectionPool(
        host=str(address), port=port, timeout=timeout, maxsize=1, retries=False
    )


def _failure(exc: BaseException, where: str) -> EgressFailed:
    """A urllib3 failure as an EgressFailed whose message names only ``where``."""
    if isinstance(exc, urllib3.exceptions.SSLError):
        return EgressFailed("tls_failed", f"TLS with {where} failed{_ssl_reason(exc)}")
    # NewConnectionError is a ConnectTimeoutError in urllib3 2: it is asked first.
    if isinstance(exc, urllib3.exceptions.NewConnectionError):
        return EgressFailed("connect_failed", f"could not connect to {where}")
    if isinstance(exc, urllib3.exceptions.TimeoutError | TimeoutError):
        return EgressFailed("timeout", f"{where} did not answer in time")
    return EgressFailed(
        "protocol_error", f"the exchange with {where} broke off ({type(exc).__name__})"
    )


def _ssl_reason(exc: BaseException) -> str:
    """The certificate check's own reason (issuer unknown, name mismatch): it names the
    certificate, never the request."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ssl.SSLCertVerificationError):
            return f": {current.verify_message}"[:200]
        if isinstance(current, ssl.SSLError) and current.reason:
            return f": {current.reason}"[:200]
        current = current.__cause__ or current.__context__ or _first_arg_exception(current)
    return ""


def _first_arg_exception(exc: BaseException) -> BaseException | None:
    return next((arg for arg in exc.args if isinstance(arg, BaseException)), None)


_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_HEADER_VALUE = re.compile(r"^[\t\x20-\x7e\x80-\xff]*$")


def _request_headers(destination: Destination, headers: Mapping[str, str]) -> dict[str, str]:
    """The caller's headers, with ``Host`` always the URL's own (a caller cannot send one for
    another name) and a User-Agent unless the caller names one.

    A malformed name or value (a line break would start another header) is refused here:
    http.client's own error would quote the value, and a value may be a credential."""
    for name, value in headers.items():
        if not isinstance(name, str) or not _TOKEN.match(name):
            raise EgressRefused("a request header has a malformed name")
        if not isinstance(value, str) or not _HEADER_VALUE.match(value):
            raise EgressRefused(f"the request header {name[:64]} has a malformed value")
    sent = {name: value for name, value in headers.items() if name.lower() != "host"}
    sent["Host"] = destination.host_header
    if not any(name.lower() == "user-agent" for name in sent):
        sent["User-Agent"] = USER_AGENT
    return sent


def _answer_headers(response: urllib3.BaseHTTPResponse) -> dict[str, str]:
    headers: dict[str, str] = {}
    for name, value in response.headers.items():
        key = name.lower()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return headers


class _Deadline:
    def __init__(self, seconds: float):
        self.at = time.monotonic() + seconds

    def remaining(self) -> float:
        return self.at - time.monotonic()


class EgressStream:
    """An answer being read: ``status`` and ``headers`` at once, the body from ``chunks()``
    as it arrives (server-sent events stay incremental), within the time and byte bounds."""

    def __init__(
        self,
        *,
        response: urllib3.BaseHTTPResponse,
        where: str,
        deadline: _Deadline,
        max_bytes: int,
    ):
        self.status = response.status
        self.headers: Mapping[str, str] = _answer_headers(response)
        self._response = response
        self._where = where
        self._deadline = deadline
        self._max_bytes = max_bytes
        self._read = 0
        length = self.headers.get("content-length", "")
        if length.isdigit() and int(length) > max_bytes:
            raise EgressFailed(
                "response_too_large",
                f"{where} announced {int(length)} bytes, more than the {max_bytes} allowed",
            )
        encoding = self.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in {"", "identity"}:
            # Only identity is asked for; a compressed body would be unbounded once inflated.
            raise EgressFailed("protocol_error", f"{where} answered with an unasked encoding")

    @property
    def bytes_read(self) -> int:
        return self._read

    def chunks(self) -> Iterator[bytes]:
        """The body's bytes as they arrive; over ``max_bytes`` or past the deadline fails."""
        while True:
            remaining = self._deadline.remaining()
            if remaining <= 0:
                raise EgressFailed("timeout", f"{self._where} did not finish answering in time")
            _set_read_timeout(self._response, remaining)
            try:
                chunk = self._response.read1(_READ_SIZE, decode_content=False)
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                raise _failure(exc, self._where) from None
            if not chunk:
                return
            self._read += len(chunk)
            if self._read > self._max_bytes:
                raise EgressFailed(
                    "response_too_large",
                    f"{self._where} answered more than {self._max_bytes} bytes",
                )
            yield chunk

    def read(self) -> bytes:
        return b"".join(self.chunks())


def _set_read_timeout(response: urllib3.BaseHTTPResponse, seconds: float) -> None:
    """Each read waits at most the time left, so a server dripping bytes cannot stretch the
    exchange past its bound."""
    connection: Any = getattr(response, "connection", None)
    sock = getattr(connection, "sock", None)
    if sock is not None:
        sock.settimeout(max(seconds, 0.001))


@contextmanager
def egress_stream(
    *,
    method: str,
    url: str,
    headers: Mapping[str, str],
    body: bytes | None,
    timeout_s: float,
    max_bytes: int,
    connect_timeout_s: float | None = None,
    allow_http: bool = False,
    allow_addresses: Sequence[IPNetwork] = (),
    ca_bundles: Sequence[str] = (),
) -> Iterator[EgressStream]:
    """Send one request under the rules above and yield its answer as a stream.

    Raises EgressRefused (nothing was sent) or EgressFailed (``code`` says how). A 3xx
    answer is ``redirect_refused`` (its ``status`` kept). ``timeout_s`` bounds the whole
    exchange, body included; ``connect_timeout_s`` (at most that) bounds each connection.
    ``allow_http``, ``allow_addresses`` and ``ca_bundles`` are for callers with settings of
    their own (webhooks).
    """
    if not _TOKEN.match(method or ""):
        raise EgressRefused("the request method is malformed")
    destination = destination_parse(url, allow_http=allow_http)
    sent = _request_headers(destination, headers)
    targets = destination_addresses(destination, allow=allow_addresses)
    bundles = _ca_bundles(ca_bundles)
    deadline = _Deadline(timeout_s)
    connect = min(connect_timeout_s or timeout_s, timeout_s)
    response = None
    pool = None
    failure: EgressFailed | None = None
    for address, port in targets:
        where = f"{destination.origin} at {_address_text(address, port)}"
        remaining = deadline.remaining()
        if remaining <= 0:
            failure = EgressFailed("timeout", f"{destination.origin} did not answer in time")
            break
        timeout = urllib3.Timeout(connect=min(connect, remaining), read=remaining, total=remaining)
        pool = _pool(destination, address, port, timeout, bundles)
        try:
            response = pool.urlopen(
                method,
                destination.target,
                body=body,
                headers=sent,
                redirect=False,
                retries=False,
                preload_content=False,
                assert_same_host=False,
                release_conn=False,
            )
            break
        except urllib3.exceptions.NewConnectionError as exc:
            # This checked address refused the connection: the next checked one may take it.
            failure = _failure(exc, where)
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            failure = _failure(exc, where)
            pool.close()
            pool = None
            break
        pool.close()
        pool = None
    if response is None or pool is None:
        raise failure or EgressFailed("connect_failed", f"no address of {destination.origin}")
    try:
        where = destination.origin
        if 300 <= response.status < 400:
            raise EgressFailed(
                "redirect_refused",
                f"{where} answered {response.status}; redirects are not followed",
                status=response.status,
            )
        yield EgressStream(response=response, where=where, deadline=deadline, max_bytes=max_bytes)
    finally:
        response.close()
        pool.close()


def _address_text(address: IPAddress, port: int) -> str:
    return f"[{address}]:{port}" if address.version == 6 else f"{address}:{port}"


def egress_request(
    *,
    method: str,
    url: str,
    headers: Mapping[str, str],
    body: bytes | None,
    timeout_s: float,
    max_bytes: int,
    connect_timeout_s: float | None = None,
    allow_http: bool = False,
    allow_addresses: Sequence[IPNetwork] = (),
    ca_bundles: Sequence[str] = (),
) -> EgressAnswer:
    """Send one request under the rules above and read its whole answer (see egress_stream)."""
    with egress_stream(
        method=method,
        url=url,
        headers=headers,
        body=body,
        timeout_s=timeout_s,
        max_bytes=max_bytes,
        connect_timeout_s=connect_timeout_s,
        allow_http=allow_http,
        allow_addresses=allow_addresses,
        ca_bundles=ca_bundles,
    ) as stream:
        body_read = stream.read()
        return EgressAnswer(status=stream.status, headers=stream.headers, body=body_read)
