"""The control tier's adapter task: thin, on the ``adapters`` queue."""

from __future__ import annotations

import structlog

from kestrel_one.adapters.services import adapter_invoke_run
from kestrel_one.celery import app
from runners.contract.names import ADAPTERS_QUEUE, CONTROL_TIER_TASKS

logger = structlog.get_logger(__name__)


@app.task(
    name=CONTROL_TIER_TASKS["adapter.invoke"],
    queue=ADAPTERS_QUEUE,
    # Not retried: a call whose worker died is handed back by the broker (acks late), and
    # its idempotency record decides what may be done again.
    acks_late=True,
    time_limit=300,
)
def adapter_invoke(action_id: str) -> None:
    outcome = adapter_invoke_run(action_id=action_id)
    logger.info("adapter call", action=action_id, outcome=outcome)
