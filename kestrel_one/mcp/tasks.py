"""MCP Celery tasks: thin wrappers that call one service each."""

from __future__ import annotations

import structlog
from django.db import OperationalError

from kestrel_one.celery import app
from kestrel_one.mcp.discovery import DiscoveryRefused, discovery_ingest, mcp_sweep
from runners.contract.names import MCP_DISCOVERED_TASK

logger = structlog.get_logger(__name__)


@app.task(
    name=MCP_DISCOVERED_TASK,  # routed to the reports queue (a runner sends it)
    acks_late=True,
    autoretry_for=(OperationalError,),
    retry_backoff=True,
    max_retries=10,
    time_limit=60,
)
def mcp_discovered(token: str) -> None:
    """Record a runner's signed discovery report. Refused reports are logged, never retried."""
    try:
        outcome = discovery_ingest(token)
    except DiscoveryRefused as refused:
        logger.warning("mcp discovery report refused", code=refused.code, reason=str(refused))
        return
    logger.info("mcp discovery report recorded", outcome=outcome)


@app.task(name="control.mcp.sweep", time_limit=120)
def sweep() -> None:
    """Discoveries nobody answered, risk acceptances that expired (beat)."""
    swept = mcp_sweep()
    if any(swept.values()):
        logger.info("mcp sweep", **swept)
