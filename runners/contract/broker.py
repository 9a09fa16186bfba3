"""The broker's address in the two spellings its two kinds of client want, and a safe label.

One Redis serves as the Celery broker (kombu), the runners' call state and the long-poll
notices (redis-py). The two libraries spell a Redis on a Unix socket differently:

- redis-py: ``unix:///path/to/redis.sock?db=N``
- kombu:    ``redis+socket:///path/to/redis.sock?virtual_host=N``

TCP Redis is ``redis://`` (or ``rediss://``) for both. Everything that takes a broker
address (``REDIS_URL``, ``KESTREL_BROKER_URL``, ``KESTREL_RUNNER_STATE_URL``) accepts any of
these spellings, and converts it here, so the embedded single-host broker (a Unix socket)
and a hosted Redis take exactly the same code path with only the address differing.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit

__all__ = ["broker_label", "is_redis_url", "kombu_url", "redis_client_url"]

_TCP_SCHEMES = ("redis", "rediss")
_SOCKET_SCHEMES = ("unix", "redis+socket")


def is_redis_url(url: str) -> bool:
    """Whether ``url`` names a Redis, over TCP or a Unix socket, in either spelling."""
    return urlsplit(url).scheme in _TCP_SCHEMES + _SOCKET_SCHEMES and _has_target(url)


def redis_client_url(url: str) -> str:
    """``url`` as redis-py's ``Redis.from_url`` reads it."""
    return _respell(url, scheme=("redis+socket", "unix"), database=("virtual_host", "db"))


def kombu_url(url: str) -> str:
    """``url`` as kombu's Redis transport reads it (Celery's ``broker_url``)."""
    return _respell(url, scheme=("unix", "redis+socket"), database=("db", "virtual_host"))


def _respell(url: str, *, scheme: tuple[str, str], database: tuple[str, str]) -> str:
    """A socket URL in the other client's spelling: its scheme and the name of the query
    parameter that picks the database, each ``(from, to)``; any other URL unchanged."""
    parts = urlsplit(url)
    if parts.scheme != scheme[0]:
        return url
    query = dict(parse_qsl(parts.query))
    db = query.pop(database[0], None)
    if db is not None:
        query[database[1]] = db
    return _unparse(scheme[1], parts.netloc, parts.path, query)


def broker_label(url: str | None) -> str:
    """Where the broker is, for people: host, port and database, or the socket's path.

    Never the password or user name a URL may carry, so the label can go into logs, the
    startup output and the health answer.
    """
    if not url:
        return "none"
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    if parts.scheme in _SOCKET_SCHEMES:
        db = query.get("db", query.get("virtual_host", "0"))
        return f"unix socket {parts.path} (db {db})"
    if parts.scheme in _TCP_SCHEMES:
        db = parts.path.strip("/") or "0"
        try:
            port = parts.port or 6379
        except ValueError:
            return f"{parts.scheme} (unreadable address)"
        return f"{parts.scheme}://{parts.hostname}:{port}/{db}"
    return f"{parts.scheme or 'unknown'} (not a Redis address)"


def _has_target(url: str) -> bool:
    parts = urlsplit(url)
    if parts.scheme in _SOCKET_SCHEMES:
        return len(parts.path) > 1
    return True


def _unparse(scheme: str, netloc: str, path: str, query: dict[str, str]) -> str:
    tail = f"?{urlencode(query)}" if query else ""
    return f"{scheme}://{netloc}{path}{tail}"
