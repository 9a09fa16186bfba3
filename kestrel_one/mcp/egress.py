"""An MCP server's egress allowlist, parsed strictly (MCP-2).

An admin authors exact ``{"host", "port", "protocol"}`` entries. Nothing is inferred,
normalized or widened: a value that is not already in its one exact form is refused with
the form to use, and every problem of every entry is reported at its own path
(``egress[2].port``), so one answer says everything to fix.

What an entry can say is what a future egress gateway can enforce for one destination:

- ``host``: one DNS name, lower case ASCII (an internationalized name in its ``xn--`` form,
  checked to be valid IDNA), at least two labels, no trailing dot. No wildcard (``*``), no
  IP literal (v4 or v6, bracketed or not: an address says nothing about who answers it and
  cannot be checked against a certificate), no port, scheme, path, user or space inside.
  A last label that is a number (decimal, or hex as ``0x1``) is refused too: a resolver
  reads such a name as an IPv4 address in one of its old forms (``127.0.0.0x1`` and
  ``0x7f.0x1`` are 127.0.0.1 to ``inet_aton``), and URL parsers treat it so (WHATWG's
  "ends in a number").
- ``port``: one integer 1..65535; no string, no boolean, no range.
- ``protocol``: ``https`` (TLS to ``host:port``: the gateway checks the SNI and the server's
  certificate against ``host``) or ``tcp`` (a byte stream: the gateway resolves ``host``
  itself and connects only to what it resolved). Plain ``http`` is refused (anything on
  the path can rewrite it), as are ``udp`` and anything else: the gateway cannot tie them
  to a name.

At most ``MAX_EGRESS_ENTRIES`` entries, no entry twice. Until a trusted gateway exists an
allowlist never opens the network (kestrel_one.mcp.profiles.egress_status, MCP-3).
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

import idna

from kestrel_one.common.errors import ValidationFailed, echo

__all__ = [
    "EGRESS_FIELDS",
    "EGRESS_PROTOCOLS",
    "MAX_EGRESS_ENTRIES",
    "EgressInvalid",
    "egress_parse",
]

EGRESS_FIELDS = ("host", "port", "protocol")
EGRESS_PROTOCOLS = ("https", "tcp")
MAX_EGRESS_ENTRIES = 64
MAX_HOST_CHARS = 253
_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
# A label a resolver or URL parser reads as a number: decimal (octal with a leading 0) or hex.
_NUMERIC_LABEL = re.compile(r"[0-9]+|0x[0-9a-f]*")


class EgressInvalid(ValidationFailed):
    """The allowlist as authored is refused; ``details`` maps each path to its problems."""


def _looks_like_ip(host: str) -> bool:
    candidate = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ipaddress.ip_address(candidate)
    except ValueError:
        return False
    return True


def _host_problem(host: Any) -> str | None:
    """Why ``host`` is not one exact, lower case DNS name (None when it is)."""
    if not isinstance(host, str):
        return "must be a string: a DNS name such as api.example.com"
    if not host:
        return "must not be empty"
    if host != host.strip() or any(ch.isspace() for ch in host):
        return "must not contain spaces"
    if "*" in host:
        return "must be an exact name: wildcards are not allowed, list each host"
    if "://" in host:
        return "must be a host name only, without a scheme such as https://"
    if any(ch in host for ch in "/?#@\\"):
        return "must be a host name only, without a path, query, user or backslash"
    if _looks_like_ip(host):
        return "must be a DNS name: IP addresses are not allowed"
    if ":" in host:
        return "must not carry a port: put it in 'port'"
    if host.endswith("."):
        return f"must not end with a dot: use '{echo(host.rstrip('.'))}'"
    if not host.isascii():
        try:
            ascii_form = idna.encode(host, uts46=True).decode("ascii")
        except idna.IDNAError:
            return "must be a valid internationalized name, written in its ASCII (xn--) form"
        return f"must be ASCII: write it in its IDNA form '{echo(ascii_form)}'"
    if host != host.lower():
        return f"must be lower case: use '{echo(host.lower())}'"
    if len(host) > MAX_HOST_CHARS:
        return f"must be at most {MAX_HOST_CHARS} characters"
    labels = host.split(".")
    if len(labels) < 2:
        return "must be a fully qualified name with at least two labels, such as example.com"
    for label in labels:
        if not label:
            return "must not contain an empty label (two dots in a row, or a leading dot)"
        if not _LABEL.fullmatch(label):
            return (
                f"label '{echo(label)}' must be 1 to 63 letters, digits or hyphens, "
                "not starting or ending with a hyphen"
            )
    if _NUMERIC_LABEL.fullmatch(labels[-1]):
        return (
            "must not end with a numeric label: a resolver reads such a name as an IP "
            "address (127.0.0.0x1 is 127.0.0.1), and IP addresses are not allowed"
        )
    for label in labels:
        if label.startswith("xn--"):
            # An xn-- label must be the punycode of a valid IDNA label; every other label is
            # plain letters, digits and hyphens, checked above.
            try:
                idna.decode(label)
            except (idna.IDNAError, UnicodeError) as error:
                return f"label '{echo(label)}' is not valid IDNA ({echo(error)})"
    return None


def _port_problem(port: Any) -> str | None:
    if isinstance(port, bool) or not isinstance(port, int):
        return "must be an integer from 1 to 65535 (not a string, a range or a list)"
    if not 1 <= port <= 65535:
        return "must be an integer from 1 to 65535"
    return None


def _protocol_problem(protocol: Any) -> str | None:
    if protocol in EGRESS_PROTOCOLS:
        return None
    allowed = ", ".join(EGRESS_PROTOCOLS)
    if protocol == "http":
        return f"plain http is not allowed (it can be rewritten in transit); use one of: {allowed}"
    if isinstance(protocol, str) and protocol.lower() in EGRESS_PROTOCOLS:
        return f"must be lower case: use '{protocol.lower()}'"
    return f"must be one of: {allowed}"


def egress_parse(raw: Any, *, field: str = "egress") -> list[dict]:
    """The allowlist ``raw`` as exact entries, in the order given, or ``EgressInvalid``
    naming every problem at its path (``egress[1].host``)."""
    problems: dict[str, list[str]] = {}

    def refuse(path: str, message: str) -> None:
        problems.setdefault(path, []).append(message)

    if not isinstance(raw, list):
        refuse(field, "must be a list of {host, port, protocol} entries")
    elif len(raw) > MAX_EGRESS_ENTRIES:
        refuse(field, f"must hold at most {MAX_EGRESS_ENTRIES} entries")
    else:
        seen: dict[tuple, int] = {}
        for index, entry in enumerate(raw):
            at = f"{field}[{index}]"
            if not isinstance(entry, dict):
                refuse(at, "must be an object with exactly: host, port, protocol")
                continue
            unknown = sorted(set(entry) - set(EGRESS_FIELDS), key=str)
            for key in unknown:
                refuse(
                    f"{at}.{echo(key)}", "unknown field; an entry has exactly: host, port, protocol"
                )
            valid = not unknown
            for key, check in (
                ("host", _host_problem),
                ("port", _port_problem),
                ("protocol", _protocol_problem),
            ):
                if key not in entry:
                    refuse(f"{at}.{key}", "required")
                    valid = False
                    continue
                problem = check(entry[key])
                if problem is not None:
                    refuse(f"{at}.{key}", problem)
                    valid = False
            if valid:
                identity = (entry["host"], entry["port"], entry["protocol"])
                if identity in seen:
                    refuse(at, f"duplicates {field}[{seen[identity]}]")
                else:
                    seen[identity] = index
    if problems:
        summary = " ".join(f"{path}: {messages[0]}" for path, messages in problems.items())
        if len(summary) > 1000:
            summary = summary[:997] + "..."
        raise EgressInvalid(summary, details=problems)
    return [
        {"host": entry["host"], "port": entry["port"], "protocol": entry["protocol"]}
        for entry in raw
    ]
