"""Control-plane Celery tasks: thin wrappers that call one service each."""

from __future__ import annotations

import structlog
from django.db import OperationalError
from django.utils import timezone

from kestrel_one.accounts.services import sign_in_attempts_expire
from kestrel_one.celery import app
from kestrel_one.common.errors import KestrelError
from kestrel_one.execution.broker_users import runner_broker_users_reconcile
from kestrel_one.execution.heartbeats import RunnerNoticeRefused, runner_heartbeat_record
from kestrel_one.execution.inventory import runner_workspaces_reconcile
from kestrel_one.execution.retention import retention_sweep
from kestrel_one.execution.services import ReportRefused, calls_sweep, report_ingest
from kestrel_one.oauth.services import authorization_codes_trim

logger = structlog.get_logger(__name__)


@app.task(
    name="control.ingest_result",
    acks_late=True,
    autoretry_for=(OperationalError,),
    retry_backoff=True,
    max_retries=10,
    time_limit=60,
)
def ingest_result(token: str) -> None:
    """Record a runner's signed report. Refused reports are logged, never retried."""
    try:
        outcome = report_ingest(token)
    except ReportRefused as refused:
        logger.warning("runner report refused", code=refused.code, reason=str(refused))
        return
    logger.info("runner report recorded", outcome=outcome)


@app.task(name="control.sweep", time_limit=120)
def sweep() -> None:
    ended = calls_sweep()
    if any(ended.values()):
        logger.info("sweep ended silent calls", **ended)
    # A revocation the broker missed (it did not answer then), or users a restart lost.
    try:
        users = runner_broker_users_reconcile()
    except KestrelError as error:
        logger.warning("runner broker users not reconciled", reason=error.message)
    else:
        if any(users.values()):
            logger.info("runner broker users reconciled", **users)


@app.task(
    name="control.runner_heartbeat",
    autoretry_for=(OperationalError,),
    max_retries=2,
    time_limit=30,
)
def runner_heartbeat(token: str) -> None:
    """Record a runner's signed heartbeat. A refused one is logged, never retried."""
    try:
        runner = runner_heartbeat_record(token)
    except RunnerNoticeRefused as refused:
        logger.warning("runner heartbeat refused", code=refused.code, reason=str(refused))
        return
    logger.debug("runner heartbeat", runner=runner.public_id, sandbox=runner.sandbox)


@app.task(
    name="control.runner_workspaces",
    autoretry_for=(OperationalError,),
    max_retries=2,
    time_limit=60,
)
def runner_workspaces(token: str) -> None:
    """Answer a runner's signed workspace inventory: ``project.delete`` again for each
    deleted project it still keeps. A refused one is logged, never retried."""
    try:
        outcome = runner_workspaces_reconcile(token)
    except RunnerNoticeRefused as refused:
        logger.warning("runner workspace inventory refused", code=refused.code, reason=str(refused))
        return
    if outcome.resent:
        logger.info(
            "deleted projects' workspaces found on a runner; project.delete sent again",
            runner=outcome.runner,
            projects=list(outcome.resent),
        )


@app.task(name="control.retention", time_limit=1800, soft_time_limit=1700)
def retention() -> None:
    """Delete what each organization's retention no longer keeps (beat, hourly by default).

    Not retried: the next scheduled sweep picks up whatever this one did not finish, and each
    organization's sweep is its own transaction.
    """
    swept = retention_sweep()
    for slug, counts in swept.items():
        if any(counts.values()):
            logger.info("retention sweep deleted expired records", organization=slug, **counts)
    # Not an organization's data: failed console sign-ins, kept only while they can lock out.
    attempts = sign_in_attempts_expire()
    if attempts:
        logger.info("retention sweep deleted expired sign-in attempts", count=attempts)
    # Nor OAuth codes, kept a day past their expiry so that a replay still revokes.
    codes = authorization_codes_trim(now=timezone.now())
    if codes:
        logger.info("retention sweep deleted expired OAuth codes", count=codes)
