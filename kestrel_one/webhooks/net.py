"""Outbound safety for webhook deliveries: where a POST may go, and sending it there only.

A consumer URL is chosen by a tenant, so it must never become a way into the service's own
network (cloud metadata, databases, the broker). Delivery goes through the one egress client
(kestrel_one/common/egress.py): every address the host resolves to is checked, the request
connects to a checked address itself with the URL's host name in ``Host``, SNI and
certificate verification, redirects are never followed, and time and bytes are bounded.

What is the webhooks' own: plain http outside hosted mode, the development allowlist
(``KESTREL_WEBHOOK_ALLOW_ADDRESSES``), the extra CA (``KESTREL_WEBHOOK_CA_BUNDLE``), the
timeouts, and that an answer is read only so far (its status is what counts; a longer body
is left unread, not an error) and a redirect is an answer like any other non-2xx.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from functools import lru_cache

from django.conf import settings

from kestrel_one.common import egress
from kestrel_one.common.egress import Destination, IPAddress, IPNetwork

USER_AGENT = "KestrelOne-Webhooks/1"
PREVIEW_BYTES = 512

# The names delivery code catches: the egress client's own exceptions.
DestinationRefused = egress.EgressRefused
SendFailed = egress.EgressFailed

__all__ = [
    "Answer",
    "Destination",
    "DestinationRefused",
    "SendFailed",
    "address_refusal",
    "destination_addresses",
    "destination_parse",
    "post",
]


@dataclass(frozen=True)
class Answer:
    status: int
    body_preview: bytes


@lru_cache(maxsize=8)
def _allowlist(entries: tuple[str, ...]) -> tuple[IPNetwork, ...]:
    return tuple(ipaddress.ip_network(entry, strict=False) for entry in entries)


def _allowed_networks() -> tuple[IPNetwork, ...]:
    """The development allowlist; in hosted mode nothing, unless the operator enabled
    development settings there explicitly (``KESTREL_EGRESS_OVERRIDES_IN_HOSTED``): it opens
    refused ranges to URLs that tenants choose. Settings refuse to start otherwise; this is
    the same rule for a process whose settings changed after startup."""
    if settings.HOSTED and not getattr(settings, "KESTREL_EGRESS_OVERRIDES_IN_HOSTED", False):
        return ()
    return _allowlist(tuple(settings.KESTREL_WEBHOOK_ALLOW_ADDRESSES))


def address_refusal(address: IPAddress) -> str | None:
    """Why a POST may not go to this address (None when it may), the allowlist applied."""
    return egress.address_refusal(address, allow=_allowed_networks())


def destination_parse(url: str) -> Destination:
    """Check a URL's form (https in hosted mode, no credentials, a host, a valid port) and a
    literal IP host against the refused ranges; names are checked at every delivery."""
    destination = egress.destination_parse(url, allow_http=not settings.HOSTED)
    try:
        literal = ipaddress.ip_address(destination.host)
    except ValueError:
        return destination
    reason = address_refusal(literal)
    if reason:
        raise DestinationRefused(f"{literal} is {reason}")
    return destination


def destination_addresses(destination: Destination) -> list[IPAddress]:
    """Resolve once and check every answer; one refused address refuses the destination."""
    pairs = egress.destination_addresses(destination, allow=_allowed_networks())
    return [address for address, _ in pairs]


def post(url: str, *, body: bytes, headers: dict[str, str]) -> Answer:
    """POST ``body`` to ``url`` through the egress client; the answer's status and first
    bytes. A redirect is answered, never followed.

    Raises DestinationRefused (nothing was sent) or SendFailed.
    """
    destination_parse(url)
    limit = settings.KESTREL_WEBHOOK_MAX_RESPONSE_BYTES
    request_headers = {
        **headers,
        "User-Agent": USER_AGENT,
        "Content-Type": "application/json",
    }
    try:
        with egress.egress_stream(
            method="POST",
            url=url,
            headers=request_headers,
            body=body,
            timeout_s=float(settings.KESTREL_WEBHOOK_TIMEOUT_SECONDS),
            connect_timeout_s=float(settings.KESTREL_WEBHOOK_CONNECT_TIMEOUT_SECONDS),
            # Never refused for its size: at most ``limit`` bytes are read, the rest left.
            max_bytes=2**62,
            allow_http=not settings.HOSTED,
            allow_addresses=_allowed_networks(),
            ca_bundles=[settings.KESTREL_WEBHOOK_CA_BUNDLE or ""],
        ) as stream:
            return Answer(status=stream.status, body_preview=_read_bounded(stream, limit))
    except SendFailed as failed:
        if failed.code == "redirect_refused" and failed.status is not None:
            return Answer(status=failed.status, body_preview=b"")
        raise


def _read_bounded(stream: egress.EgressStream, limit: int) -> bytes:
    """At most ``limit`` bytes, within the deadline; the status line is what counts, so a
    broken or slow body does not change the outcome."""
    chunks: list[bytes] = []
    size = 0
    try:
        for chunk in stream.chunks():
            chunks.append(chunk)
            size += len(chunk)
            if size >= limit:
                break
    except SendFailed:
        pass
    return b"".join(chunks)[:PREVIEW_BYTES]
