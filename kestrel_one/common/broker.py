"""Whether the broker answers, asked with a short timeout and remembered for a moment.

A call that would execute is refused with a 503 at once when nobody answers at
``REDIS_URL`` (``action_request``), instead of being recorded as queued where no runner
will ever see it, or of a request hanging on a connection for the whole ``?wait=``. The
answer is kept ``REACHABLE_CACHE_SECONDS`` (``UNREACHABLE_CACHE_SECONDS`` when nobody
answered) per process, so a busy service asks the broker a few times a minute at most.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import redis
from django.conf import settings

from runners.contract.broker import broker_label, redis_client_url

__all__ = ["BrokerStatus", "broker_check", "broker_status", "broker_unavailable_message"]

CONNECT_TIMEOUT_SECONDS = 1.0
REACHABLE_CACHE_SECONDS = 5.0
UNREACHABLE_CACHE_SECONDS = 2.0


@dataclass(frozen=True)
class BrokerStatus:
    """What the last check found; ``label`` is the broker's address without credentials."""

    configured: bool
    reachable: bool
    label: str
    embedded: bool


def broker_check(url: str | None, *, timeout: float = CONNECT_TIMEOUT_SECONDS) -> bool:
    """Ask the Redis at ``url`` for a PING, now."""
    if not url:
        return False
    client = redis.Redis.from_url(
        redis_client_url(url), socket_connect_timeout=timeout, socket_timeout=timeout
    )
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


_lock = threading.Lock()
_last: tuple[float, str | None, BrokerStatus] | None = None


def broker_status(*, fresh: bool = False) -> BrokerStatus:
    """The broker's status, checked at most every few seconds (``fresh`` checks now)."""
    global _last
    url = settings.REDIS_URL
    with _lock:
        now = time.monotonic()
        if not fresh and _last is not None:
            checked_at, checked_url, status = _last
            ttl = REACHABLE_CACHE_SECONDS if status.reachable else UNREACHABLE_CACHE_SECONDS
            if checked_url == url and now - checked_at < ttl:
                return status
        status = BrokerStatus(
            configured=bool(url),
            reachable=broker_check(url),
            label=broker_label(url),
            embedded=bool(getattr(settings, "KESTREL_EMBEDDED_BROKER", False)),
        )
        _last = (time.monotonic(), url, status)
        return status


def broker_unavailable_message(status: BrokerStatus) -> str:
    """Why a call that would execute is refused, and what to do about it."""
    if not status.configured:
        return (
            "Execution is off: no broker is configured. Set REDIS_URL (for example "
            "redis://127.0.0.1:6379/0) and restart the service."
        )
    if status.embedded:
        return (
            "Execution is off: the embedded broker is not running (it starts with `make run` "
            "or `manage.py serve`; see the service's startup output for why it did not)."
        )
    return (
        f"Execution is off: the broker at {status.label} does not answer. Start it or fix "
        "REDIS_URL; the call was not recorded, so send it again then."
    )
