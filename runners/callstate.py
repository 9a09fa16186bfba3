"""Per-call state in Redis that makes a call id single use across every runner of a pool.

Celery with ``acks_late`` delivers a command *at least* once: after a worker dies, the
broker hands the same message to another worker, and anyone with broker access could push
a copy. What makes that safe is two keys per call id (the command's ``jti``):

- ``kestrel:call:<jti>``, a *lease*: who claimed the call (with ``SET NX``, so exactly one
  worker wins), for which command token (its digest), when it was first accepted, and
  ``lease_until``, pushed forward by a heartbeat while the tool runs. A lease whose
  ``lease_until`` has passed belongs to a worker that died mid-call.
- ``kestrel:result:<jti>``, the signed *finished* report, stored before it is sent, so a
  redelivered command gets the same report again instead of a second run. The report
  carries the call's output, so it is kept only until it is handed on: once the broker took
  it for the reports queue (acknowledged late there, so it survives a reports worker
  that dies), it is replaced by ``reported:<digest>``, which says the call ended and its
  report went out, and holds nothing of the output (``mark_reported``). A report that could
  not be sent is kept at most ``RESULT_RETENTION_SECONDS``, its own lifetime: the control
  plane refuses it after that anyway.

The lease and the ``reported`` marker are kept ``RETENTION_SECONDS``: longer than any command
token can be valid (``MAX_COMMAND_LIFETIME_SECONDS``), so no copy of a command can find the
call id unclaimed while it could still verify. A redelivered copy arriving after that is
refused as expired, and the control plane's sweep ends the call. Leases compare wall clocks
across hosts; keep runners on NTP.

Two more keys are not about a call: ``kestrel:thread-ended:<prj>:<thr>``, set when a
verified ``thread.end`` control message arrives, and ``kestrel:project-deleted:<prj>``, set
on a ``project.delete`` (every thread of a deleted project has ended), so that every worker
process of every host of the pool (not only the one that received the message) stops
keeping those threads' sandboxes and servers warm. They are cache hints, kept
``THREAD_ENDED_SECONDS``; authority stays with the control plane, which refuses new calls on
an ended thread or a deleted project. ``kestrel:risk-ended:<rsk>``, set on an
``mcp.risk.end``, is not a hint: a command signed before the acceptance ended (queued, or
in flight when the notice came) names it in its bridged profile, and no server is started
with a network under an acceptance any runner of the pool heard had ended.

A runner keeps these keys under its pool's namespace (``kestrel:pool:<pool>:call:<jti>``
and so on, ``runners.contract.broker_access``): its broker user reaches no other pool's
leases or results, which hold other organizations' calls.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import asdict, dataclass, replace
from typing import Any

import redis

from runners.contract.canonical import token_digest
from runners.contract.tokens import (
    LEEWAY_SECONDS,
    MAX_COMMAND_LIFETIME_SECONDS,
    RESULT_LIFETIME_SECONDS,
)

__all__ = [
    "HEARTBEAT_SECONDS",
    "LEASE_SECONDS",
    "REPORTED_PREFIX",
    "RESULT_RETENTION_SECONDS",
    "RETENTION_SECONDS",
    "THREAD_ENDED_SECONDS",
    "CallState",
    "Lease",
    "LeaseKeeper",
]

# A live worker refreshes its lease every HEARTBEAT_SECONDS; a lease not refreshed for
# LEASE_SECONDS is dead. LEASE_SECONDS must stay well below the Celery visibility margin
# (60 s, see runners.worker), so that a command redelivered after a crash finds the dead
# worker's lease already expired and is recovered rather than dropped.
HEARTBEAT_SECONDS = 2.0
LEASE_SECONDS = 15.0
RETENTION_SECONDS = MAX_COMMAND_LIFETIME_SECONDS + 2 * LEEWAY_SECONDS + 60
RESULT_RETENTION_SECONDS = RESULT_LIFETIME_SECONDS
REPORTED_PREFIX = "reported:"
# Longer than any call of the thread that was already queued could still arrive (command
# lifetime plus a crash redelivery) and than any warm container could idle.
THREAD_ENDED_SECONDS = 24 * 3600

# Under the CallState's namespace: "kestrel:" by default, the pool's own on a runner
# (runners.contract.broker_access.pool_namespace), where its broker user may reach them.
DEFAULT_NAMESPACE = "kestrel:"
_CALL_KEY = "call:{}"
_RESULT_KEY = "result:{}"
_THREAD_ENDED_KEY = "thread-ended:{}:{}"
_PROJECT_DELETED_KEY = "project-deleted:{}"
_RISK_ENDED_KEY = "risk-ended:{}"

# Replace the value only if it is still exactly what the caller last saw: a heartbeat or a
# take-over can never overwrite a lease that someone else has since claimed.
_COMPARE_AND_SET = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
  return 1
end
return 0
"""


@dataclass(frozen=True)
class Lease:
    """One worker's claim on a call, as stored under ``kestrel:call:<jti>``."""

    call_id: str
    holder: str  # unique per claim: "<worker>#<random>"
    worker: str
    attempt: int
    command_digest: str
    accepted_at: float  # when a runner first accepted this call; survives take-overs
    lease_until: float

    def expired(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) >= self.lease_until

    def encode(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def decode(cls, value: bytes | str) -> Lease:
        return cls(**json.loads(value))


class CallState:
    """Claims, leases and stored results for call ids, shared by all workers of a pool."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        worker: str,
        lease_seconds: float = LEASE_SECONDS,
        retention_seconds: int = RETENTION_SECONDS,
        namespace: str = DEFAULT_NAMESPACE,
        result_retention_seconds: int = RESULT_RETENTION_SECONDS,
    ) -> None:
        self.client = client
        self.namespace = namespace
        self.worker = worker
        self.lease_seconds = lease_seconds
        self.retention_seconds = retention_seconds
        self.result_retention_seconds = result_retention_seconds
        self._compare_and_set = client.register_script(_COMPARE_AND_SET)

    def lease(self, call_id: str) -> Lease | None:
        """The current lease on ``call_id``, live or expired, if anyone ever claimed it."""
        value = self.client.get(self._key(_CALL_KEY, call_id))
        return None if value is None else Lease.decode(value)

    def stored_result(self, call_id: str) -> str | None:
        """The signed finished report of ``call_id``, if the call already ended; once that
        report went out, ``reported:<digest>`` instead (``is_reported``)."""
        value = self.client.get(self._key(_RESULT_KEY, call_id))
        return None if value is None else value.decode("ascii")

    def claim(self, call_id: str, *, attempt: int, command_digest: str) -> Lease | None:
        """Claim a call nobody has claimed yet; None when someone has (``SET NX``)."""
        now = time.time()
        lease = Lease(
            call_id=call_id,
            holder=self._new_holder(),
            worker=self.worker,
            attempt=attempt,
            command_digest=command_digest,
            accepted_at=now,
            lease_until=now + self.lease_seconds,
        )
        claimed = self.client.set(
            self._key(_CALL_KEY, call_id), lease.encode(), nx=True, ex=self.retention_seconds
        )
        return lease if claimed else None

    def take_over(self, stale: Lease, *, attempt: int, command_digest: str) -> Lease | None:
        """Replace the expired lease ``stale`` with our own; None if it changed meanwhile."""
        now = time.time()
        lease = replace(
            stale,
            holder=self._new_holder(),
            worker=self.worker,
            attempt=attempt,
            command_digest=command_digest,
            lease_until=now + self.lease_seconds,
        )
        return lease if self._swap(stale, lease) else None

    def heartbeat(self, lease: Lease) -> Lease | None:
        """Push ``lease`` forward; None if it is no longer ours (it was taken over)."""
        renewed = replace(lease, lease_until=time.time() + self.lease_seconds)
        return renewed if self._swap(lease, renewed) else None

    def store_result(self, call_id: str, token: str) -> str:
        """Keep the finished report and return the one kept: the first stored wins.

        From then on every delivery of the call gets that same report back. Only a worker
        that stalled past its lease (and was taken over) can arrive second; its report is
        discarded so the call still has exactly one.
        """
        key = self._key(_RESULT_KEY, call_id)
        if self.client.set(key, token, nx=True, ex=self.result_retention_seconds):
            return token
        return self.stored_result(call_id) or token

    def mark_reported(self, call_id: str, token: str) -> None:
        """The finished report ``token`` went out: keep that, not the report (its output).

        Only the report stored for the call is replaced (compare and set), and the marker
        lives as long as the lease, so a later copy of the command still runs nothing.
        """
        key = self._key(_RESULT_KEY, call_id)
        self._compare_and_set(
            keys=[key], args=[token, REPORTED_PREFIX + token_digest(token), self.retention_seconds]
        )

    def mark_thread_ended(self, project: str, thread: str) -> None:
        """Record that ``thread`` ended (from a verified control message)."""
        self.client.set(self._key(_THREAD_ENDED_KEY, project, thread), "1", ex=THREAD_ENDED_SECONDS)

    def mark_project_deleted(self, project: str) -> None:
        """Record that ``project`` was deleted (from a verified control message): each of its
        threads has ended."""
        self.client.set(self._key(_PROJECT_DELETED_KEY, project), "1", ex=THREAD_ENDED_SECONDS)

    def mark_risk_ended(self, acceptance: str) -> None:
        """Record that MCP risk acceptance ``acceptance`` ended (from a verified control
        message), for longer than any command signed under it stays valid."""
        self.client.set(self._key(_RISK_ENDED_KEY, acceptance), "1", ex=THREAD_ENDED_SECONDS)

    def risk_ended(self, acceptance: str) -> bool:
        """Whether an ``mcp.risk.end`` for ``acceptance`` reached any runner of the pool."""
        return bool(self.client.exists(self._key(_RISK_ENDED_KEY, acceptance)))

    def thread_ended(self, project: str, thread: str) -> bool:
        """Whether a ``thread.end`` for this thread, or a ``project.delete`` for its project,
        reached any runner of the pool (one round trip for both)."""
        return bool(
            self.client.exists(
                self._key(_THREAD_ENDED_KEY, project, thread),
                self._key(_PROJECT_DELETED_KEY, project),
            )
        )

    def _swap(self, expected: Lease, new: Lease) -> bool:
        key = self._key(_CALL_KEY, expected.call_id)
        args = [expected.encode(), new.encode(), self.retention_seconds]
        return bool(self._compare_and_set(keys=[key], args=args))

    def _key(self, template: str, *parts: str) -> str:
        return self.namespace + template.format(*parts)

    def _new_holder(self) -> str:
        return f"{self.worker}#{uuid.uuid4().hex[:12]}"


class LeaseKeeper:
    """Refreshes a lease from a background thread while the call runs (context manager).

    The tool runs in the foreground and may block for minutes inside Docker; the heartbeat
    must not depend on it. If the lease is lost (only possible after a long stall, when
    another worker took it over) the keeper stops and says so through ``lost``.
    """

    def __init__(
        self, state: CallState, lease: Lease, *, interval: float = HEARTBEAT_SECONDS
    ) -> None:
        self.state = state
        self.lease = lease
        self.interval = interval
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._beat, name=f"lease-{lease.call_id}", daemon=True
        )

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                renewed = self.state.heartbeat(self.lease)
            except redis.RedisError:
                continue  # try again next beat; the lease has LEASE_SECONDS of slack
            if renewed is None:
                self.lost = True
                return
            self.lease = renewed


def is_reported(stored: str) -> bool:
    """Whether a stored result is the marker of a report that already went out."""
    return stored.startswith(REPORTED_PREFIX)
