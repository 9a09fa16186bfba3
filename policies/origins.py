"""Network origins for net.http: exact ``scheme://host:port`` entries and request URLs.

An entry names one origin exactly. There are no wildcards, paths or userinfo, and the port
is always written out, so an entry means the same thing to whoever reads it and to the
engine. IP literals are refused unless the document sets ``allow_ip_literals: true``,
because an address bypasses the DNS names an administrator reviews (and numeric forms such
as ``127.1`` or ``0x7f000001`` are easy to slip past a reader).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

SCHEMES = ("http", "https")
_DEFAULT_PORTS = {"http": 80, "https": 443}
_DNS_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
# Anything made only of numeric-looking labels is an IP address to some resolver.
_NUMERIC_HOST = re.compile(r"(?:0x[0-9a-f]*|[0-9]+)(?:\.(?:0x[0-9a-f]*|[0-9]*))*")
_ENTRY = re.compile(r"(?P<scheme>[a-z]+)://(?P<host>\[[^\]]*\]|[^:/]*)(?::(?P<port>[^/]*))?")


@dataclass(frozen=True, order=True)
class Origin:
    """One exact network origin."""

    scheme: str
    # Lower-case DNS name, canonical dotted IPv4, or compressed IPv6 without brackets.
    host: str
    port: int

    @property
    def is_ip_literal(self) -> bool:
        return _is_ip(self.host)

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _host_problem(host: str) -> str | None:
    """Why ``host`` (as written in an entry, brackets kept) is not acceptable, or None."""
    if host.startswith("["):
        inner = host[1:-1] if host.endswith("]") else ""
        try:
            address = ipaddress.IPv6Address(inner)
        except ValueError:
            return f"'{host}' is not a valid IPv6 literal"
        if str(address) != inner:
            return f"IPv6 literal must be written in compressed form: [{address}]"
        return None
    if host == "":
        return "has no host"
    if host != host.lower():
        return "host must be lower case"
    if host.endswith("."):
        return "host must not end with '.'"
    if _NUMERIC_HOST.fullmatch(host):
        try:
            ipv4 = ipaddress.IPv4Address(host)
        except ValueError:
            return f"'{host}' is not a canonical dotted IPv4 address"
        if str(ipv4) != host:
            return f"'{host}' is not a canonical dotted IPv4 address"
        return None
    if len(host) > 253:
        return "host is longer than 253 characters"
    for label in host.split("."):
        if not _DNS_LABEL.fullmatch(label):
            return f"host label '{label}' is not a valid DNS label"
    if host.rsplit(".", 1)[-1].isdigit():
        return "host's last label must not be numeric"
    return None


def parse_origin(text: str, *, allow_ip_literals: bool) -> Origin:
    """Parse one net.http entry; raises ValueError saying exactly what is wrong."""
    if "*" in text:
        raise ValueError("wildcards are not allowed; name each origin exactly")
    if "://" not in text:
        raise ValueError("must look like 'https://host:port'")
    scheme, rest = text.split("://", 1)
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {list(SCHEMES)}, not '{scheme}'")
    if "@" in rest:
        raise ValueError("userinfo ('user@') is not allowed")
    if any(char in rest for char in "/?#"):
        raise ValueError("paths, queries and fragments are not allowed; use 'scheme://host:port'")
    match = _ENTRY.fullmatch(text)
    if match is None:
        raise ValueError("must look like 'https://host:port'")
    host, port_text = match["host"], match["port"]
    problem = _host_problem(host)
    if problem:
        raise ValueError(problem)
    if port_text is None:
        raise ValueError(f"port is required, e.g. '{scheme}://{host}:{_DEFAULT_PORTS[scheme]}'")
    ascii_number = port_text.isascii() and port_text.isdigit()  # no fullwidth or superscript digits
    if not ascii_number or port_text.startswith("0") or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"port '{port_text}' is not a number from 1 to 65535")
    origin = Origin(scheme, host.strip("[]"), int(port_text))
    if origin.is_ip_literal and not allow_ip_literals:
        raise ValueError("IP literals need 'allow_ip_literals': true on net.http")
    return origin


def origin_of_url(url: str) -> Origin:
    """The origin a request URL reaches; raises ValueError for URLs the engine refuses.

    Default ports are filled in, because entries always carry one. URLs with userinfo are
    refused outright: the engine cannot tell what the credentials would reach.
    """
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as error:
        raise ValueError(f"URL '{url}' cannot be parsed: {error}") from None
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise ValueError(f"URL '{url}' does not use http or https")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"URL '{url}' carries userinfo")
    host = parts.hostname or ""
    if not host:
        raise ValueError(f"URL '{url}' has no host")
    if ":" in host:
        try:
            host = str(ipaddress.IPv6Address(host))
        except ValueError:
            raise ValueError(f"URL '{url}' has an invalid IPv6 host") from None
    return Origin(scheme, host, port if port is not None else _DEFAULT_PORTS[scheme])
