"""Control-plane Celery task for the audit chain: a thin wrapper around the sweep service."""

from __future__ import annotations

import structlog

from kestrel_one.audit.services import audit_chain_sweep
from kestrel_one.celery import app

logger = structlog.get_logger(__name__)


@app.task(name="control.audit.chain", time_limit=300, soft_time_limit=270)
def chain_pending() -> None:
    """Chain records that no settle after their commit picked up (beat, every few seconds).

    Normally each commit chains its own records at once; this catches a process that died
    between its commit and that settle, and the tail of a burst longer than one settle takes.
    """
    for slug, chained in audit_chain_sweep().items():
        if chained:
            logger.info("audit records chained by the sweep", organization=slug, chained=chained)
