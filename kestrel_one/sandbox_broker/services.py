"""A workload's brokered adapter request becomes a child action of its call (CRED-3).

The runner's broker signs what the workload asked (``runners.adapter_broker``); here it is
verified (the runner's enrolled key, its signature, the exact claims), the call it names
must be running on that very runner under that very command, and the request becomes an
``adapter.invoke`` action in the call's thread, requested as the call's own requester: the
same policy, the same token scope, the same approvals (an external operation waits for a
person). Its outcome goes back, signed with the control key, when it ends
(``kestrel_one.sandbox_broker.answers``). Nothing here sees a credential: the child's
control-tier worker releases it for that one invocation.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from django.db import transaction
from django.utils import timezone

from kestrel_one.accounts.principal import (
    Principal,
    runner_principal,
)
from kestrel_one.audit.services import audit_record, audit_refusal_record
from kestrel_one.common.errors import KestrelError
from kestrel_one.execution.models import Action, ActionState, Runner
from kestrel_one.execution.requesters import REQUESTER_INACTIVE, requester_now
from kestrel_one.execution.services import action_request
from kestrel_one.governance.selectors import policy_versions_lock
from kestrel_one.sandbox_broker.models import BrokeredRequest
from kestrel_one.tenancy.models import Project
from runners.contract.adapter_broker import (
    AdapterBrokerRefused,
    AdapterRequest,
    unverified_request_runner_id,
    verify_adapter_request,
)
from runners.contract.registry import get_tool

logger = logging.getLogger(__name__)

ADAPTER_TOOL = "adapter.invoke"


class BrokeredRequestRefused(Exception):
    """A brokered request the control plane takes no action for. ``answer`` says whether
    the waiting broker is told (only for a request whose runner signature verified: an
    unverified one names nobody we could answer). ``parent`` is the call it named, if any."""

    def __init__(self, code: str, message: str, *, answer: bool = False) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.answer = answer
        self.parent: Action | None = None


class ParentNotRunningYet(Exception):
    """The call's "started" report, sent just before the request, is not recorded yet."""


def brokered_request_verify(token: str) -> tuple[Runner, AdapterRequest]:
    """The enrolled, active runner that signed ``token``, and the request it carries."""
    try:
        runner_id = unverified_request_runner_id(token)
    except AdapterBrokerRefused as refused:
        raise BrokeredRequestRefused(refused.code, refused.message) from None
    runner = Runner.objects.filter(public_id=runner_id, revoked_at__isnull=True).first()
    if runner is None:
        raise BrokeredRequestRefused("unknown_runner", f"{runner_id} is not an enrolled runner")
    try:
        request = verify_adapter_request(
            token, runner_public_key=runner.public_key, runner_id=runner_id
        )
    except AdapterBrokerRefused as refused:
        raise BrokeredRequestRefused(refused.code, refused.message) from None
    return runner, request


def brokered_request_accept(*, runner: Runner, request: AdapterRequest) -> BrokeredRequest:
    """Record the request and request its child action, or refuse it.

    Refused (``BrokeredRequestRefused``, answered unless a replay): the call is not running
    on this runner under this command, the request id was used already, or the call's
    requester can no longer act. A child that could not even be requested (an unknown
    adapter, bad arguments, a credential the requester may not use...) is recorded without
    a child, with its ``error``, answered at once by the caller. ``ParentNotRunningYet``
    when the call's "started" report is not recorded yet (the caller tries again shortly).
    """
    try:
        return _accept(runner=runner, request=request)
    except BrokeredRequestRefused as refused:
        _audit_refusal(runner, refused)
        raise


@transaction.atomic
def _accept(*, runner: Runner, request: AdapterRequest) -> BrokeredRequest:
    # The policy locks before the call's row, in the order every other writer takes them
    # (action_request takes them again for the child). The call's row is locked so that it
    # cannot end between this check and its child's creation: its ending then sees the
    # child (answers.answer_on_end cancels one still waiting for a person).
    project_id = (
        Action.objects.filter(public_id=request.call_id)
        .values_list("project_id", flat=True)
        .first()
    )
    if project_id is not None:
        policy_versions_lock(Project.objects.get(pk=project_id))
    parent = (
        Action.objects.select_for_update(of=("self",))
        .select_related("organization", "thread", "project", "requested_by_token")
        .filter(public_id=request.call_id)
        .first()
    )
    if parent is None or parent.command_digest != request.command_digest:
        raise _refused(runner, parent, "call_not_running", "no such call was sent")
    if parent.pool != runner.pool or runner.organization_id not in (
        None,
        parent.organization_id,
    ):
        raise _refused(runner, parent, "call_not_running", "this runner may not serve it")
    if parent.state == ActionState.QUEUED and parent.runner_id is None:
        raise ParentNotRunningYet
    if parent.state != ActionState.RUNNING or parent.runner_id != runner.pk:
        raise _refused(runner, parent, "call_not_running", f"the call is {parent.state} elsewhere")
    if not get_tool(parent.tool).runs_process:
        raise _refused(runner, parent, "call_not_running", "the call runs no process")
    if BrokeredRequest.objects.filter(request_id=request.request_id).exists():
        # A second delivery of the same task, or a replay: the first is answered, not this.
        raise _refused(runner, parent, "replayed", "request received already", answer=False)
    try:
        actor = _requester(parent)
    except BrokeredRequestRefused as refused:
        refused.parent = parent
        raise
    wanted = request.request
    child, error = None, None
    try:
        with transaction.atomic():
            # As its parent's requester, through its parent's surface: the workload's call
            # meets every policy term the call that started the workload met.
            child = action_request(
                actor=actor,
                thread=parent.thread,
                tool=ADAPTER_TOOL,
                args=wanted,
                surface=parent.surface,
            )
    except KestrelError as refused:
        # Refused before any action existed (an unknown adapter or operation, arguments
        # that do not fit, a credential this requester may not use...): the answer is what
        # the API would have said. Recorded all the same, so its request id is used up.
        error = {"code": refused.code, "message": refused.message[:1000]}
    brokered = BrokeredRequest.objects.create(
        request_id=request.request_id,
        organization=parent.organization,
        parent=parent,
        child=child,
        runner=runner,
        pool=runner.pool,
        adapter=str(wanted.get("adapter", ""))[:64],
        operation=str(wanted.get("operation", ""))[:64],
        expires_at=datetime.fromtimestamp(request.exp, tz=UTC),
        error=error,
        answered_at=timezone.now() if child is None else None,
        outcome="refused" if child is None else "",
    )
    audit_record(
        organization=parent.organization,
        actor=runner_principal(runner.public_id),
        action="adapter.broker_request",
        target=child or parent,
        outcome="requested" if child is not None else "refused",
        data={
            "parent": parent.public_id,
            "child": child.public_id if child is not None else None,
            "state": child.state if child is not None else None,
            "request": request.request_id,
            "adapter": brokered.adapter,
            "operation": brokered.operation,
            "error": error["code"] if error else None,
        },
    )
    return brokered


def _requester(parent: Action) -> Principal:
    """Who the child is requested as: the parent's own requester, as it stands now (a token
    revoked or expired since, or a person no longer active, requests nothing more)."""
    actor = requester_now(parent)
    if actor is None:
        raise BrokeredRequestRefused(
            REQUESTER_INACTIVE, "whoever requested this call can no longer act", answer=True
        )
    return actor


def _refused(
    runner: Runner, parent: Action | None, code: str, message: str, *, answer: bool = True
) -> BrokeredRequestRefused:
    refused = BrokeredRequestRefused(code, message, answer=answer)
    refused.parent = parent
    return refused


def _audit_refusal(runner: Runner, refused: BrokeredRequestRefused) -> None:
    """Recorded after the request's transaction rolled back, so the record is kept."""
    parent = refused.parent
    if parent is None:
        return
    audit_refusal_record(
        organization=parent.organization,
        actor=runner_principal(runner.public_id),
        action="adapter.broker_request_refused",
        target=parent,
        data={"code": refused.code},
    )
