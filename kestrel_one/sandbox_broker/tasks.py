"""The control plane's task for a brokered adapter request (thin: one service each)."""

from __future__ import annotations

import structlog
from django.db import OperationalError

from kestrel_one.celery import app
from kestrel_one.sandbox_broker.answers import answer_push
from kestrel_one.sandbox_broker.services import (
    BrokeredRequestRefused,
    ParentNotRunningYet,
    brokered_request_accept,
    brokered_request_verify,
)
from runners.contract.names import ADAPTER_REQUEST_TASK

logger = structlog.get_logger(__name__)

# The call's "started" report goes out just before its first request, on the same queue;
# with several reports workers it may be recorded a moment after the request is taken.
NOT_RUNNING_RETRIES = 20
NOT_RUNNING_RETRY_SECONDS = 0.25


@app.task(
    bind=True,
    name=ADAPTER_REQUEST_TASK,
    acks_late=True,
    autoretry_for=(OperationalError,),
    retry_backoff=True,
    max_retries=NOT_RUNNING_RETRIES,
    time_limit=60,
)
def adapter_request(self, token: str) -> None:
    """A workload's signed adapter request from a runner's broker (runners.adapter_broker):
    verified, then its child action requested; a refusal is answered when it can be."""
    try:
        runner, request = brokered_request_verify(token)
    except BrokeredRequestRefused as refused:
        logger.warning(
            "brokered adapter request refused", code=refused.code, reason=refused.message
        )
        return
    try:
        brokered = brokered_request_accept(runner=runner, request=request)
    except ParentNotRunningYet:
        if self.request.retries < NOT_RUNNING_RETRIES:
            raise self.retry(countdown=NOT_RUNNING_RETRY_SECONDS) from None
        # Its "started" report never came: the call is not running as far as we know.
        _refusal_push(runner, request, "call_not_running", "the call has not started")
        return
    except BrokeredRequestRefused as refused:
        logger.warning(
            "brokered adapter request refused",
            code=refused.code,
            reason=refused.message,
            runner=runner.public_id,
            call=request.call_id,
        )
        if refused.answer:
            _refusal_push(runner, request, refused.code, refused.message[:1000])
        return
    except OperationalError:
        raise  # the database is away: retried (autoretry_for)
    except Exception:
        # Not a refusal: a fault here. The workload is told at once rather than left to
        # wait out its timeout; nothing was recorded (the transaction rolled back).
        logger.exception("brokered adapter request failed", request=request.request_id)
        _refusal_push(runner, request, "internal_error", "the control plane failed")
        return
    if brokered.child is None:
        logger.info("brokered adapter request refused", request=brokered.request_id,
                    code=brokered.error["code"])  # fmt: skip
        answer_push(
            pool=brokered.pool,
            request_id=brokered.request_id,
            call_id=request.call_id,
            action=None,
            outcome="refused",
            result=None,
            error=brokered.error,
        )
        return
    # The child's answer goes out when it ends (answers.answer_on_end), which may be now: a
    # child denied at request ended in the transaction that recorded it.
    logger.info(
        "brokered adapter request accepted",
        request=brokered.request_id,
        child=brokered.child.public_id,
    )


def _refusal_push(runner, request, code: str, message: str) -> None:
    """Answer the waiting broker that its request was refused before any child existed."""
    answer_push(
        pool=runner.pool,
        request_id=request.request_id,
        call_id=request.call_id,
        action=None,
        outcome="refused",
        result=None,
        error={"code": code, "message": message},
    )
