"""The signed answer to a waiting broker: pushed when the child action ends (CRED-3).

Connected to ``execution.signals.action_ended``, which every terminal transition sends
after its transaction commits: succeeded, failed, denied at request, denied by a person,
expired, cancelled. The answer is signed with the control key and pushed onto the request's
reply list in the runner's pool namespace, where the broker waits (BRPOP) until its call's
timeout. It carries the child's outcome and result as recorded (redacted as every record
is), never a credential: the control-tier worker that used one returns none.
"""

from __future__ import annotations

import logging
import os

import redis
from django.conf import settings
from django.db import connection
from django.db.models import Q
from django.dispatch import receiver
from django.utils import timezone

from kestrel_one.execution.keys import control_private_key
from kestrel_one.execution.models import Action, ActionState
from kestrel_one.execution.services import end_action
from kestrel_one.execution.signals import action_ended
from kestrel_one.sandbox_broker.models import BrokeredRequest
from runners.contract.adapter_broker import MAX_ANSWER_BYTES, reply_key, sign_adapter_answer
from runners.contract.broker import redis_client_url

logger = logging.getLogger(__name__)

# An answer nobody took (its call ended meanwhile) does not outstay this in Redis.
REPLY_TTL_SECONDS = 300
PARENT_ENDED = (
    "parent_call_ended",
    "The call that asked for this adapter operation ended before anyone decided; nothing "
    "waits for its answer any more.",
)


@receiver(action_ended, dispatch_uid="sandbox-broker-answer")
def answer_on_end(sender, action_id: int, state: str, **kwargs) -> None:
    """An action ended: answer the broker waiting for it, if it is a brokered child; and if
    it is a parent, cancel its children still waiting for a person (nobody waits for them)."""
    # Every action ends here, and nearly none is brokered: a plain probe first (nothing to
    # compile; the ORM query below joins five tables), then both questions in one query.
    if not _brokered(action_id):
        return
    requests = BrokeredRequest.objects.select_related(
        "parent", "child__thread", "child__organization"
    ).filter(
        Q(child_id=action_id, answered_at__isnull=True)
        | Q(parent_id=action_id, child__state=ActionState.AWAITING_APPROVAL)
    )
    for brokered in requests:
        if brokered.child_id == action_id:
            brokered_answer(brokered)
        else:
            end_action(
                brokered.child, ActionState.AWAITING_APPROVAL, ActionState.CANCELLED, *PARENT_ENDED
            )


_BROKERED_SQL = (
    "SELECT EXISTS (SELECT 1 FROM sandbox_broker_brokeredrequest "
    "WHERE child_id = %s OR parent_id = %s)"
)


def _brokered(action_id: int) -> bool:
    """Whether the action is a brokered request's child or parent, answered or not."""
    with connection.cursor() as cursor:
        cursor.execute(_BROKERED_SQL, [action_id, action_id])
        return cursor.fetchone()[0]


def brokered_answer(brokered: BrokeredRequest) -> bool:
    """Push the child's outcome to the broker, once; True if this call pushed it."""
    child = brokered.child
    if child is None:
        return False
    claimed = BrokeredRequest.objects.filter(pk=brokered.pk, answered_at__isnull=True).update(
        answered_at=timezone.now(), outcome=child.state
    )
    if not claimed:
        return False
    outcome, result, error = _outcome_of(child)
    return answer_push(
        pool=brokered.pool,
        request_id=brokered.request_id,
        call_id=brokered.parent.public_id,
        action=child.public_id,
        outcome=outcome,
        result=result,
        error=error,
    )


def _outcome_of(child: Action) -> tuple[str, object, dict | None]:
    if child.state == ActionState.SUCCEEDED:
        return "succeeded", child.result, None
    error = child.error if isinstance(child.error, dict) else None
    if child.state == ActionState.DENIED and not error:
        # A person's denial leaves no error on the action; the approval row says it.
        approval = getattr(child, "approval", None)
        if approval is not None and approval.decision == "denied":
            error = {"code": "approval_denied", "message": "A person denied this action."}
        else:
            reasons = "; ".join((child.decision or {}).get("reasons", [])) or "the policy denies it"
            error = {"code": "policy_denied", "message": reasons[:1000]}
    error = error or {"code": child.state, "message": f"The action ended {child.state}."}
    shown = {"code": str(error.get("code")), "message": str(error.get("message"))}
    # A failed call may still carry the upstream's answer (an HTTP 4xx body): the workload
    # gets it as recorded, beside the error.
    return str(child.state), child.result if child.state == ActionState.FAILED else None, shown


_clients: dict[int, redis.Redis] = {}


def _redis() -> redis.Redis:
    """This process's client of the broker's Redis (a forked worker makes its own)."""
    client = _clients.get(os.getpid())
    if client is None:
        client = redis.Redis.from_url(
            redis_client_url(settings.REDIS_URL), socket_timeout=5, socket_connect_timeout=5
        )
        _clients.clear()
        _clients[os.getpid()] = client
    return client


def answer_push(
    *,
    pool: str,
    request_id: str,
    call_id: str,
    action: str | None,
    outcome: str,
    result: object,
    error: dict | None,
) -> bool:
    """Sign an answer and push it onto the request's reply list; never raises (the broker's
    wait is bounded by its call's timeout, so a lost answer ends as a timeout there)."""
    try:
        token = sign_adapter_answer(
            pool=pool,
            request_id=request_id,
            call_id=call_id,
            action=action,
            outcome=outcome,
            result=result,
            error=error,
            private_key=control_private_key(),
            ttl=REPLY_TTL_SECONDS,
        )
        if len(token) > MAX_ANSWER_BYTES:
            token = sign_adapter_answer(
                pool=pool,
                request_id=request_id,
                call_id=call_id,
                action=action,
                outcome="failed",
                result=None,
                error={
                    "code": "answer_too_large",
                    "message": f"the result does not fit in an answer of {MAX_ANSWER_BYTES} "
                    f"bytes; it is on the action {action}",
                },
                private_key=control_private_key(),
                ttl=REPLY_TTL_SECONDS,
            )
        key = reply_key(pool, request_id)
        with _redis().pipeline(transaction=True) as pipe:
            pipe.lpush(key, token)
            pipe.expire(key, REPLY_TTL_SECONDS)
            pipe.execute()
    except Exception as error:
        logger.warning(
            "answer to brokered request %s not pushed (%s)", request_id, type(error).__name__
        )
        return False
    return True
