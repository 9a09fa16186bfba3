"""Runner heartbeats: which runners are up, and with which sandbox backend.

Every runner sends a signed heartbeat when it starts and every 30 s (``runners.heartbeat``),
by the same queue as its reports. It is verified against the runner's enrolled key like a
report, and recorded on the runner's row (``last_seen_at``, ``sandbox``); a runner silent
for ``SILENT_AFTER`` is no longer counted as up. This is what ``GET /api/v1/health`` reports
and the runner list shows, on one host and on many. It is never a permission: every call is
probed again by the runner that takes it (RUN-5).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django.utils import timezone

from kestrel_one.common.broker import broker_status
from kestrel_one.execution.models import Runner
from runners.contract.tokens import (
    HEARTBEAT_INTERVAL_SECONDS,
    ProtocolError,
    unverified_runner_id,
    verify_heartbeat,
)

__all__ = [
    "SILENT_AFTER",
    "RunnerNoticeRefused",
    "execution_health",
    "runner_heartbeat_record",
    "runner_notice_verified",
    "runners_up",
]

# Three missed beats.
SILENT_AFTER = timedelta(seconds=3 * HEARTBEAT_INTERVAL_SECONDS)
# Best first: what the health answer names when several runners are up.
_SANDBOX_PREFERENCE = ("docker", "bubblewrap")


class RunnerNoticeRefused(Exception):
    """A runner's heartbeat or workspace inventory that is not taken (``code`` says why)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code


def runner_notice_verified(token: str, verify: Callable[..., Any]) -> tuple[Runner, Any]:
    """The enrolled, unrevoked runner that signed ``token`` and what ``verify`` (a contract
    verifier: ``verify_heartbeat``, ``verify_workspace_inventory``) made of it; refused
    (``RunnerNoticeRefused``) unless its key checks out and it names the runner's own pool."""
    try:
        runner_id = unverified_runner_id(token)
    except ProtocolError as refused:
        raise RunnerNoticeRefused(refused.code, str(refused)) from None
    runner = Runner.objects.filter(public_id=runner_id, revoked_at__isnull=True).first()
    if runner is None:
        raise RunnerNoticeRefused(
            "unknown_runner", f"{runner_id} is not an enrolled, active runner"
        )
    try:
        notice = verify(token, runner_public_key=runner.public_key, runner_id=runner_id)
    except ProtocolError as refused:
        raise RunnerNoticeRefused(refused.code, str(refused)) from None
    if notice.pool != runner.pool:
        raise RunnerNoticeRefused("wrong_pool", f"{runner_id} is enrolled for another pool")
    return runner, notice


def runner_heartbeat_record(token: str) -> Runner:
    """Verify a runner's heartbeat and record it; raises ``RunnerNoticeRefused``."""
    runner, heartbeat = runner_notice_verified(token, verify_heartbeat)
    Runner.objects.filter(pk=runner.pk, revoked_at__isnull=True).update(
        last_seen_at=timezone.now(), sandbox=heartbeat.sandbox
    )
    runner.refresh_from_db()
    return runner


def runners_up(*, now=None):
    """Enrolled, unrevoked runners heard from within ``SILENT_AFTER``."""
    now = now or timezone.now()
    return Runner.objects.filter(revoked_at__isnull=True, last_seen_at__gte=now - SILENT_AFTER)


def execution_health() -> dict:
    """What ``GET /api/v1/health`` says about execution: broker, runners, sandbox.

    Reveals no address, credential or organization: only whether each part works.
    """
    broker = broker_status()
    sandboxes = set(runners_up().values_list("sandbox", flat=True))
    sandbox = next((name for name in _SANDBOX_PREFERENCE if name in sandboxes), "none")
    missing: list[str] = []
    messages: list[str] = []
    if not broker.reachable:
        missing.append("broker")
        messages.append("The broker does not answer: calls that would execute are refused (503).")
    if not sandboxes:
        missing.append("runner")
        messages.append(
            "No runner has sent a heartbeat in the last "
            f"{int(SILENT_AFTER.total_seconds())} s: allowed calls wait in the queue."
        )
    elif sandbox == "none":
        missing.append("sandbox")
        messages.append(
            "No runner found a working sandbox backend (Docker with the tool image, or "
            "bubblewrap): shell.exec and code.python calls fail closed."
        )
    return {
        "status": "degraded" if missing else "ok",
        "broker": "ok" if broker.reachable else "unreachable",
        "runner": "ok" if sandboxes else "none",
        "sandbox": sandbox,
        "missing": missing,
        "message": " ".join(messages) or "Calls can execute.",
    }
