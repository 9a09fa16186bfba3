"""Each runner's own broker user: a Redis ACL user made at enrollment, removed at revocation.

A runner logs in to the broker as the ACL user named by its runner id, with a password made
at enrollment and shown once. The user reaches only its pool's queue, state and control
channel (``runners.contract.broker_access``), so a runner of one pool cannot read another
pool's commands, and revoking it (``runner_broker_user_remove``) disables the user, ends its
connections (``CLIENT KILL USER``) and deletes it: the revoked runner can take nothing more,
whatever its process does. Only the password's SHA-256 is kept (``Runner.
broker_password_sha256``), so the users can be recreated after a broker restart
(``runner_broker_users_reconcile``, run by the sweep and by ``serve``) but nobody can log in
with what the database holds.

The control plane's own connection (``REDIS_URL``) must be allowed ``ACL SETUSER``, ``ACL
DELUSER``, ``ACL GETUSER``, ``ACL USERS`` and ``CLIENT KILL`` (Redis's ``default`` user
is). A broker without ACLs (Redis before 6) or a ``REDIS_URL`` user without those rights
makes enrollment fail with ``broker_acl_unavailable``: runners are never enrolled on a
credential that cannot be taken back. ``KESTREL_RUNNER_BROKER_USERS=0`` (single-host only)
turns the users off.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import kombu
import kombu.exceptions
import redis
from django.conf import settings

from kestrel_one.common.errors import Unavailable
from kestrel_one.execution.models import Runner
from runners.contract.broker import redis_client_url
from runners.contract.broker_access import runner_acl_rules
from runners.contract.names import REPORT_QUEUE

__all__ = [
    "BrokerAclUnavailable",
    "broker_users_enabled",
    "runner_broker_url",
    "runner_broker_user_apply",
    "runner_broker_user_issue",
    "runner_broker_user_remove",
    "runner_broker_users_reconcile",
]

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_SECONDS = 5.0
# Runner ids are the user names; the reconcile touches no user outside this prefix.
RUNNER_USER_PREFIX = "run_"


class BrokerAclUnavailable(Unavailable):
    """The broker cannot give this runner a credential of its own (or take one back)."""

    code = "broker_acl_unavailable"


def broker_users_enabled() -> bool:
    return bool(settings.KESTREL_RUNNER_BROKER_USERS)


def _admin_client() -> redis.Redis:
    if not settings.REDIS_URL:
        raise BrokerAclUnavailable(
            "No broker is configured (REDIS_URL), so a runner cannot get a broker user."
        )
    return redis.Redis.from_url(
        redis_client_url(settings.REDIS_URL),
        socket_connect_timeout=CONNECT_TIMEOUT_SECONDS,
        socket_timeout=CONNECT_TIMEOUT_SECONDS,
    )


def _broker_db() -> int:
    """The database the control plane (and so every runner) uses on the broker."""
    url = redis_client_url(settings.REDIS_URL)
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    if "db" in query:
        return int(query["db"])
    path = parts.path.strip("/") if parts.scheme in ("redis", "rediss") else ""
    return int(path or 0)


def runner_broker_url() -> str:
    """Where a runner finds the broker: the control plane's ``REDIS_URL`` without the
    control plane's credentials (the runner adds its own, KESTREL_BROKER_PASSWORD_FILE)."""
    parts = urlsplit(settings.CELERY_BROKER_URL or "")
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def _refused(error: Exception) -> BrokerAclUnavailable:
    if isinstance(error, redis.ConnectionError | redis.TimeoutError | OSError):
        return BrokerAclUnavailable(
            "The broker at REDIS_URL does not answer, so the runner's broker user could not "
            "be changed. Start the broker and try again."
        )
    return BrokerAclUnavailable(
        "The broker at REDIS_URL cannot manage per-runner users (Redis 6 or later with ACLs "
        "is needed, and REDIS_URL's user must be allowed ACL SETUSER, DELUSER, GETUSER, USERS "
        f"and CLIENT KILL): {str(error)[:200]}. Runners are not enrolled on a broker "
        "credential that cannot be revoked."
    )


def _set_user(client: redis.Redis, runner: Runner) -> None:
    rules = runner_acl_rules(runner.pool, db=_broker_db())
    client.execute_command(
        "ACL", "SETUSER", runner.public_id, "reset", "on", f"#{runner.broker_password_sha256}",
        *rules,
    )  # fmt: skip


def runner_broker_user_issue(*, runner: Runner) -> str | None:
    """Make ``runner`` a broker user with a new password; return the password (shown once).

    None when broker users are off. Raises ``BrokerAclUnavailable`` when the broker cannot.
    """
    if not broker_users_enabled():
        return None
    password = secrets.token_hex(32)
    runner.broker_password_sha256 = hashlib.sha256(password.encode()).hexdigest()
    Runner.objects.filter(pk=runner.pk).update(broker_password_sha256=runner.broker_password_sha256)
    runner_broker_user_apply(runner=runner)
    return password


def runner_broker_user_apply(*, runner: Runner) -> None:
    """(Re)create ``runner``'s broker user from the stored password hash."""
    if not broker_users_enabled() or not runner.broker_password_sha256:
        return
    client = _admin_client()
    try:
        _set_user(client, runner)
        _save(client)
        _declare_reports_queue()
    except (redis.RedisError, kombu.exceptions.OperationalError) as error:
        raise _refused(error) from None
    finally:
        client.close()


def _declare_reports_queue() -> None:
    """Bind the reports queue as Celery does: a runner reads that binding to send a report
    but may not write it, so the control plane makes sure it exists before any runner."""
    exchange = kombu.Exchange(REPORT_QUEUE, type="direct")
    with kombu.Connection(
        settings.CELERY_BROKER_URL, connect_timeout=CONNECT_TIMEOUT_SECONDS
    ) as conn:
        kombu.Queue(REPORT_QUEUE, exchange, routing_key=REPORT_QUEUE)(
            conn.default_channel
        ).declare()


def runner_broker_user_remove(*, runner_id: str) -> None:
    """Take the broker away from ``runner_id``: no command on its open connections, those
    connections ended, the user deleted (so it can log in no more)."""
    if not broker_users_enabled():
        return
    client = _admin_client()
    try:
        _remove(client, runner_id)
        _save(client)
    except redis.RedisError as error:
        raise _refused(error) from None
    finally:
        client.close()


def _remove(client: redis.Redis, runner_id: str) -> None:
    if not client.execute_command("ACL", "GETUSER", runner_id):
        return
    # First no permission at all: a connection between here and the kill can do nothing.
    client.execute_command("ACL", "SETUSER", runner_id, "reset")
    client.execute_command("CLIENT", "KILL", "USER", runner_id)
    client.execute_command("ACL", "DELUSER", runner_id)


def _save(client: redis.Redis) -> None:
    """Persist the users where the broker keeps an ACL file; a broker without one has them
    in memory only, and the reconcile recreates them after a restart."""
    try:
        client.execute_command("ACL", "SAVE")
    except redis.ResponseError:
        pass


def runner_broker_users_reconcile() -> dict[str, int]:
    """Make the broker's runner users match the enrolled runners: create each active
    runner's user that is missing (a broker restart loses them), delete every runner user
    whose runner is revoked or gone (a revocation the broker missed)."""
    if not broker_users_enabled():
        return {"created": 0, "removed": 0}
    client = _admin_client()
    try:
        existing = {
            name.decode() if isinstance(name, bytes) else name
            for name in client.execute_command("ACL", "USERS")
        }
        present = {name for name in existing if name.startswith(RUNNER_USER_PREFIX)}
        active = {
            runner.public_id: runner
            for runner in Runner.objects.filter(revoked_at__isnull=True).exclude(
                broker_password_sha256=""
            )
        }
        created = 0
        for runner_id, runner in active.items():
            if runner_id not in present:
                _set_user(client, runner)
                created += 1
        stale = present - set(active)
        for runner_id in sorted(stale):
            _remove(client, runner_id)
        if created or stale:
            _save(client)
    except redis.RedisError as error:
        raise _refused(error) from None
    finally:
        client.close()
    return {"created": created, "removed": len(stale)}
