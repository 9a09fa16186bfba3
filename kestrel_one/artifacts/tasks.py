"""Control-plane Celery task for retention: a thin wrapper around the sweep service."""

from __future__ import annotations

import structlog

from kestrel_one.accounts.services import sign_in_attempts_expire
from kestrel_one.artifacts.services import retention_sweep
from kestrel_one.celery import app

logger = structlog.get_logger(__name__)


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
