"""The model gateway's Celery tasks: thin, each calls one service."""

from __future__ import annotations

import structlog
from django.db import OperationalError

from kestrel_one.celery import app
from kestrel_one.gateway.invoke import model_invoke_run
from kestrel_one.gateway.services import usage_reservations_expire

logger = structlog.get_logger(__name__)

# runners.contract.names.CONTROL_TIER_TASKS["model.invoke"] and ADAPTERS_QUEUE.
MODEL_INVOKE_TASK = "control.model_invoke"
ADAPTERS_QUEUE = "adapters"


@app.task(
    name=MODEL_INVOKE_TASK,
    queue=ADAPTERS_QUEUE,
    # Not retried: a call whose worker died is handed back by the broker (acks late) and
    # finds its action no longer queued; its reservation expires and is charged.
    acks_late=True,
    time_limit=300,
)
def model_invoke(action_id: str) -> None:
    outcome = model_invoke_run(action_id=action_id)
    logger.info("model call", action=action_id, outcome=outcome)


@app.task(
    name="control.gateway.expire_reservations",
    autoretry_for=(OperationalError,),
    max_retries=2,
    time_limit=120,
)
def expire_reservations() -> None:
    expired = usage_reservations_expire()
    if expired:
        logger.info("model reservations expired", count=expired)
