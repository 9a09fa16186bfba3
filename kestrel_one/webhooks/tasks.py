"""Webhook Celery tasks: thin, primitive ids, one service each."""

from __future__ import annotations

import structlog
from django.conf import settings
from django.db import OperationalError

from kestrel_one.celery import app
from kestrel_one.webhooks.services import DELIVER_TASK, deliveries_sweep, delivery_attempt

logger = structlog.get_logger(__name__)


@app.task(
    name=DELIVER_TASK,
    acks_late=True,
    # Only the database being unreachable retries here; HTTP outcomes are scheduled by the
    # delivery row itself (backoff, lease, sweep), never by Celery's retry.
    autoretry_for=(OperationalError,),
    retry_backoff=True,
    max_retries=5,
    time_limit=settings.KESTREL_WEBHOOK_TIMEOUT_SECONDS + 30,
)
def deliver(delivery_id: int) -> None:
    outcome = delivery_attempt(delivery_id=delivery_id)
    logger.info("webhook delivery attempt", delivery=delivery_id, outcome=outcome)


@app.task(name="control.webhooks.sweep", time_limit=120)
def sweep() -> None:
    queued = deliveries_sweep()
    if queued:
        logger.info("webhook sweep queued overdue deliveries", count=queued)
