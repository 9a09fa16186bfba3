"""Waking long polls when an action changes, instead of re-reading it on a timer.

Every change of an action appends a thread event; after that transaction commits, a notice
goes out on the action's Redis channel. A request waiting with ``?wait=`` subscribes first,
then re-reads the action, so no notice can slip between the read and the wait. Notices carry
nothing but the fact that something changed: the database stays the only source of truth,
and a lost notice costs at most the fallback poll interval.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from functools import lru_cache

import redis
import structlog
from django.conf import settings
from django.db import transaction

from kestrel_one.common.broker import broker_status
from runners.contract.broker import redis_client_url

logger = structlog.get_logger(__name__)

# Without a notice (lost, or no Redis), a waiting request still re-reads this often.
FALLBACK_POLL_SECONDS = 1.0
_NO_REDIS_POLL_SECONDS = 0.1


def _channel(action_public_id: str) -> str:
    return f"kestrel:action:{action_public_id}"


@lru_cache(maxsize=1)
def _client() -> redis.Redis | None:
    url = settings.REDIS_URL
    if not url:
        return None
    # A broker that does not answer costs a waiting request a second, not the whole wait.
    return redis.Redis.from_url(redis_client_url(url), socket_timeout=5, socket_connect_timeout=1)


def action_changed(action_public_id: str) -> None:
    """Announce, once the current transaction commits, that this action changed."""
    transaction.on_commit(lambda: _publish(action_public_id))


def _publish(action_public_id: str) -> None:
    client = _client()
    if client is None:
        return
    try:
        client.publish(_channel(action_public_id), b"changed")
    except redis.RedisError as error:
        # Waiters fall back to polling; the change itself is already committed.
        logger.warning("action notice not sent", action=action_public_id, error=str(error))


@contextlib.contextmanager
def action_watch(action_public_id: str) -> Iterator[Callable[[float], bool]]:
    """Subscribe to an action's notices; yields ``wait(seconds)``, which returns True on a
    notice, or False after ``seconds`` (at most the fallback interval) without one."""
    client = _client()
    pubsub = None
    if client is not None and broker_status().reachable:
        try:
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            pubsub.subscribe(_channel(action_public_id))
        except redis.RedisError:
            pubsub = None

    def wait(seconds: float) -> bool:
        if pubsub is None:
            time.sleep(min(seconds, _NO_REDIS_POLL_SECONDS))
            return False
        deadline = time.monotonic() + min(seconds, FALLBACK_POLL_SECONDS)
        # get_message also returns None when it consumed an ignored subscribe confirmation,
        # so keep reading until a notice arrives or the time is up.
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                if pubsub.get_message(timeout=remaining) is not None:
                    return True
            except redis.RedisError:
                time.sleep(min(remaining, _NO_REDIS_POLL_SECONDS))
                return False
        return False

    try:
        yield wait
    finally:
        if pubsub is not None:
            with contextlib.suppress(redis.RedisError):
                pubsub.close()
