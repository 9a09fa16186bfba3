"""The path of one call through the control plane: request, decide, sign, dispatch, ingest.

Every state change is a conditional update (``UPDATE ... WHERE state IN (...)``) checked by
its row count, so a late or duplicated report can never move a finished action. The one
exception is ``command_expired``, the sweep's guess that no runner took a command: a runner's
verified finished report for it is recorded (``_record_finished``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import DataError, IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from kestrel_one.accounts.principal import runner_principal, system_principal
from kestrel_one.artifacts.capture import artifacts_capture
from kestrel_one.audit.services import audit_record, audit_refusal_record
from kestrel_one.celery import app
from kestrel_one.common.broker import broker_status, broker_unavailable_message
from kestrel_one.common.errors import Conflict, ThreadEnded, Unavailable, ValidationFailed, echo
from kestrel_one.common.injection import injection_flags
from kestrel_one.common.redaction import redact, redact_result, write_only_values
from kestrel_one.common.storable import json_storable, utf8_encodable
from kestrel_one.execution.arguments import (
    action_arguments,
    arguments_sealed,
    arguments_shown,
    call_args_digest,
    digest_salt,
)
from kestrel_one.execution.enrollment import call_pool_for
from kestrel_one.execution.keys import control_private_key
from kestrel_one.execution.models import (
    TERMINAL_STATES,
    Action,
    ActionState,
    Approval,
    IdempotencyKey,
    Plan,
    Receipt,
    Runner,
)
from kestrel_one.execution.requesters import (
    REQUESTER_INACTIVE,
    REQUESTER_INACTIVE_MESSAGE,
    requester_now,
)
from kestrel_one.execution.signals import action_ended_notify
from kestrel_one.governance.judging import (
    call_dispatch_check,
    call_judge,
    tool_call_admitted,
    tool_call_request,
)
from kestrel_one.governance.selectors import policy_version_label, policy_versions_lock
from kestrel_one.tenancy.models import Project
from kestrel_one.threads.models import Thread
from kestrel_one.threads.selectors import scope_of
from kestrel_one.threads.services import (
    THREAD_ENDED_MESSAGE,
    event_append,
    events_append,
    thread_require_open,
)
from policies import (
    ALLOW,
    DEFAULT_LIMITS,
    DENY,
    INTEGER_LIMITS,
    LIMIT_NAMES,
    NEEDS_APPROVAL,
    Decision,
    Mode,
    resolve_mode,
)
from runners.contract.canonical import digest, token_digest
from runners.contract.names import (
    ADAPTERS_QUEUE,
    COMMAND_ISSUER,
    CONTROL_TIER_TASKS,
    EXECUTE_TASK,
    command_audience,
    runner_queue,
)
from runners.contract.registry import get_tool
from runners.contract.tokens import (
    ProtocolError,
    ResultRefused,
    sign_command,
    unverified_runner_id,
    verify_result,
)
from runners.contract.toolspec import Tier

logger = logging.getLogger(__name__)

STATE_FOR_OUTCOME = {
    ALLOW: ActionState.QUEUED,
    NEEDS_APPROVAL: ActionState.AWAITING_APPROVAL,
    DENY: ActionState.DENIED,
}
RUNNER_SEEN_RESOLUTION = timedelta(minutes=1)


def action_digest(*, scope: dict, tool: str, args_digest: str, policy_version: str) -> str:
    """The identity an approval, a command and a receipt bind to."""
    return digest(
        {**scope, "tool": tool, "args_digest": args_digest, "policy_version": policy_version}
    )


def command_limits(decision_limits) -> dict:
    limits = {**DEFAULT_LIMITS, **dict(decision_limits)}
    return {
        # Every limit the engine knows goes on every command; integers where it counts things.
        name: int(value) if name in INTEGER_LIMITS else float(value)
        for name, value in limits.items()
        if name in LIMIT_NAMES
    }


def action_scope(action: Action) -> dict:
    """The scope the action was recorded in (its own environment, should the project move)."""
    return scope_of(
        organization=action.organization,
        environment=action.environment,
        project=action.project,
        thread=action.thread,
    )


def _plan_step(*, thread, plan_id: str, step: int, tool: str, args_digest: str):
    """The accepted plan step this action names, checked exactly (never found by similarity)
    and not yet used as many times as the plan allows."""
    # Locked: two requests naming the same step are counted one after the other.
    plan = Plan.objects.select_for_update().filter(public_id=plan_id, thread=thread).first()
    if plan is None:
        missing = f"no plan {echo(plan_id)} in this thread"
        raise ValidationFailed(missing, details={"plan_step.plan": [missing]})
    if plan.state != "accepted":
        raise ValidationFailed(
            f"This plan is {plan.state}; a person must accept it first.",
            details={"plan_step.plan": [f"plan is {plan.state}"]},
        )
    if not 0 <= step < len(plan.steps):
        raise ValidationFailed(
            f"The plan has {len(plan.steps)} step(s).", details={"plan_step.step": ["out of range"]}
        )
    expected = plan.steps[step]
    if expected["tool"] != tool or expected["args_digest"] != args_digest:
        raise ValidationFailed(
            "This action does not match the plan step it names (tool and arguments must be "
            "exactly the accepted ones).",
            details={"plan_step": ["does not match the accepted step"]},
        )
    uses = expected.get("uses", 1)
    used = Action.objects.filter(plan=plan, plan_step=step).count()
    if used >= uses:
        raise Conflict(
            f"Step {step} of this plan has already run {used} time(s), as many as the plan "
            "allows; propose and accept a new plan to run it again.",
            details={"plan_step.step": [f"used {used} of {uses}"]},
        )
    return plan


@transaction.atomic(savepoint=False)  # inside the request's transaction: no savepoint needed
def action_request(
    *, actor, thread, tool: str, args, plan_step: dict | None = None, surface: str = "api"
) -> Action:
    """Validate, decide and record one call; an allowed call is dispatched after commit.

    The thread's mode applies (Auto resolves to Ask). An action naming a step of a plan a
    person accepted runs in Agent mode: the acceptance is that person's explicit act, and it
    covers exactly that step's tool and arguments. An ended thread takes no new action.
    """
    if thread.status != Thread.Status.OPEN:
        raise ThreadEnded(THREAD_ENDED_MESSAGE)
    project = thread.project
    # A control-tier call's credential reference, checked for this requester (and a default
    # made explicit, so the digest binds it); an mcp.call's server and tool checked and its
    # pinned profile added; other tools' arguments are unchanged. The policy request is built
    # from these admitted arguments (mcp.call's danger comes from the record, POL-8).
    tool_spec, canonical, policy_request = tool_call_admitted(
        tool, args, project=project, user=actor.user, token=actor.token
    )
    # Stored and shown redacted (CRED-1); the exact arguments are signed into the command and
    # kept sealed until the call ends, never for a denied one (execution.arguments).
    shown = arguments_shown(canonical)
    args_digest = call_args_digest(canonical, shown)
    plan = None
    if plan_step is not None:
        plan = _plan_step(
            thread=thread,
            plan_id=plan_step["plan"],
            step=plan_step["step"],
            tool=tool_spec.name,
            args_digest=args_digest,
        )
    mode = Mode.AGENT if plan else resolve_mode(Mode(thread.mode), wants_plan=False)
    # Held until the command below is signed and stored: no narrowing is published between
    # this decision and the command that carries it.
    policy_versions_lock(project)
    # Declared outputs are judged as fs.read of each path too (decide_call).
    judged = call_judge(
        project=project,
        principal=actor,
        mode=mode,
        policy_request=policy_request,
        canonical=canonical,
        surface=surface,
    )
    decision = judged.decision
    if decision.outcome == ALLOW:
        # Only a call that would run now needs the broker. A denial, or a call that waits for
        # a person, is decided and recorded as usual with no broker: the approval dispatches.
        broker = broker_status()
        if not broker.reachable:
            raise Unavailable(broker_unavailable_message(broker))
    scope = scope_of(
        organization=project.organization,
        environment=project.environment,
        project=project,
        thread=thread,
    )
    flags = injection_flags(canonical)
    # Checked again under the thread's lock: the thread may have ended since it was read.
    thread_require_open(thread=thread)
    action = Action(
        organization=project.organization,
        environment=project.environment,
        project=project,
        thread=thread,
        tool=tool_spec.name,
        args=shown,
        sealed_args="" if decision.outcome == DENY else arguments_sealed(canonical, shown),
        args_digest=args_digest,
        action_digest=action_digest(
            scope=scope,
            tool=tool_spec.name,
            args_digest=args_digest,
            policy_version=decision.policy_version,
        ),
        mode=mode.value,
        surface=surface,
        state=STATE_FOR_OUTCOME[decision.outcome],
        # Reasons may quote an argument (a path, a command).
        decision=redact(decision.to_dict()),
        policy_version=decision.policy_version,
        limits=command_limits(decision.limits),
        requested_by=actor.actor_id,
        requested_by_token=actor.token,
        requested_by_lineage=actor.lineage,
        requested_by_user=actor.user,
        pool=call_pool_for(project.organization),
        plan=plan,
        plan_step=plan_step["step"] if plan else None,
        flags=flags,
    )
    command = None
    control_tier = tool_spec.tier == Tier.CONTROL
    if action.state == ActionState.QUEUED:
        action.attempt = 1
        if not control_tier:
            # Signed now, from the row being written, so that after commit dispatch only sends.
            command = _signed_command(action, args=canonical)
            action.command_digest = token_digest(command)
    action.save(force_insert=True)
    # Commit hooks run in the order they are registered: the command goes to the broker
    # first, so the runner starts while the rest (the events' notices, chaining the audit
    # record) runs here.
    if command is not None:
        transaction.on_commit(lambda: _command_send(action, command))
    elif control_tier and action.state == ActionState.QUEUED:
        transaction.on_commit(lambda: _control_send(action))
    if action.state == ActionState.DENIED:
        action_ended_notify(action, action.state)
    events_append(
        thread=thread,
        action=action,
        events=[
            (
                "action.requested",
                {
                    "action": action.public_id,
                    "tool": action.tool,
                    "args_digest": args_digest,
                    "mode": mode.value,
                    "flags": flags,
                    "plan_step": (
                        {"plan": plan.public_id, "step": plan_step["step"]} if plan else None
                    ),
                },
            ),
            (
                "action.decided",
                {
                    "action": action.public_id,
                    "outcome": decision.outcome,
                    "reasons": list(decision.reasons),
                    "policy_version": decision.policy_version,
                },
            ),
        ],
    )
    audit_record(
        organization=project.organization,
        actor=actor,
        action="action.request",
        target=action,
        outcome=decision.outcome,
        data={
            "tool": action.tool,
            "args_digest": args_digest,
            "thread": thread.public_id,
            "policy_version": decision.policy_version,
        },
    )
    return action


def action_dispatch(*, action_id: int) -> bool:
    """Sign the command for a queued action not sent yet, and send it to its pool's queue.

    For an action that became queued later (an approval), and for one whose send failed
    (the sweep); a new request signs its command as it is written (``action_request``).
    Each signing is a new attempt, decided again first under the policy locks
    (``action_redecide``): a version published since the action was decided may deny it or
    want a person, and a command is only ever signed under the versions current as it is
    signed. ``dispatched_at`` is set only after the broker took the message, so an action
    whose send failed is still undispatched and the sweep sends it again; the runner's single
    use of the call id keeps that from running twice.
    """
    with transaction.atomic():
        action = _queued_redecided(pk=action_id, dispatched_at__isnull=True)
        if action is None:
            return False
        action.attempt += 1
        # What the call was admitted for may have changed since (an mcp.call's server or
        # tool): such a call ends failed, never signed (ToolChecks.dispatch).
        changed = call_dispatch_check(action.tool, action_arguments(action))
        if changed is not None:
            end_action(
                action,
                ActionState.QUEUED,
                ActionState.FAILED,
                *changed,
                actor=system_principal("dispatch"),
            )
            return False
        if get_tool(action.tool).tier == Tier.CONTROL:
            # Never signed to a runner: the control tier reads the action itself.
            Action.objects.filter(pk=action.pk).update(attempt=action.attempt)
            token = None
        else:
            token = _signed_command(action, args=action_arguments(action))
            Action.objects.filter(pk=action.pk).update(
                attempt=action.attempt, command_digest=token_digest(token)
            )
    if token is None:
        return _control_send(action)
    return _command_send(action, token)


def _queued_redecided(**match) -> Action | None:
    """The queued action ``match`` names, locked, and decided again first if the policy
    versions changed since its decision; None when it is not queued, or no longer is once
    decided again, or its requester can no longer act (it is then cancelled:
    ``execution.requesters``). Call inside a transaction: the policy locks are held until it
    ends, so no narrowing is published between this decision and what the caller sends under
    it."""
    project_id = Action.objects.filter(**match).values_list("project_id", flat=True).first()
    if project_id is None:
        return None
    policy_versions_lock(Project.objects.get(pk=project_id))
    action = (
        Action.objects.select_for_update(of=("self",))
        .select_related("organization", "environment", "project", "thread")
        .filter(state=ActionState.QUEUED, **match)
        .first()
    )
    if action is None:
        return None
    if requester_now(action) is None:
        end_action(
            action,
            ActionState.QUEUED,
            ActionState.CANCELLED,
            REQUESTER_INACTIVE,
            REQUESTER_INACTIVE_MESSAGE,
            actor=system_principal("dispatch"),
        )
        return None
    decision = action_redecision(action)
    if decision is not None:
        action_redecide(action, decision)
        if action.state != ActionState.QUEUED:
            return None
    return action


POLICY_DENIES = "policy_denies"
POLICY_CHANGED = "policy_changed"


def action_redecision(action: Action) -> Decision | None:
    """The decision the current policy versions give ``action``, or None when they are still
    the versions it was decided under (versions are immutable, so that decision stands).

    Call under ``policy_versions_lock``. The requester's token scope is not judged again: it
    let the first decision through (a token without it is denied everything), and this one
    asks only what the policy now says.
    """
    mode = Mode(action.mode)
    label = policy_version_label(project=action.project, mode=mode, surface=action.surface)
    if label == action.policy_version:
        return None
    _, canonical, policy_request = tool_call_request(action.tool, action_arguments(action))
    return call_judge(
        project=action.project,
        principal=system_principal("redecide"),
        mode=mode,
        policy_request=policy_request,
        canonical=canonical,
        surface=action.surface,
    ).decision


def action_redecide(action: Action, decision: Decision) -> None:
    """Record ``action``'s new decision, and move it where that decision sends it.

    Allowed: it stays queued under the new version (its digest binds the new version). Needs
    approval: it waits for a person, or, when a person already approved it under the old
    version (one approval per action, bound to that version), it is cancelled to be
    requested again. Denied: it ends denied. The error names the version that decided.
    """
    version = decision.policy_version
    state = STATE_FOR_OUTCOME[decision.outcome]
    error = None
    if decision.outcome == DENY:
        error = {
            "code": POLICY_DENIES,
            "message": f"The policy changed since this action was decided; under {version} "
            "it is denied: " + "; ".join(decision.reasons),
        }
    elif decision.outcome == NEEDS_APPROVAL and Approval.objects.filter(action=action).exists():
        state = ActionState.CANCELLED
        error = {
            "code": POLICY_CHANGED,
            "message": f"The policy changed since this action was approved; under {version} "
            "it needs a new approval, so request it again.",
        }
    action.policy_version = version
    action.decision = redact(decision.to_dict())  # reasons may quote an argument
    action.limits = command_limits(decision.limits)
    action.action_digest = action_digest(
        scope=action_scope(action),
        tool=action.tool,
        args_digest=action.args_digest,
        policy_version=version,
    )
    moved = Action.objects.filter(
        pk=action.pk, state__in=[ActionState.AWAITING_APPROVAL, ActionState.QUEUED]
    ).update(
        state=state,
        decision=action.decision,
        policy_version=version,
        limits=action.limits,
        action_digest=action.action_digest,
        error=error,
        finished_at=timezone.now() if state in TERMINAL_STATES else None,
        # An ended call keeps no exact arguments (execution.arguments).
        **({"sealed_args": ""} if state in TERMINAL_STATES else {}),
    )
    if not moved:
        return
    action.state = state
    if state in TERMINAL_STATES:
        action_ended_notify(action, state)
    event_append(
        thread=action.thread,
        kind="action.decided",
        action=action,
        data={
            "action": action.public_id,
            "outcome": decision.outcome,
            "reasons": list(decision.reasons),
            "policy_version": version,
            "again": True,
        },
    )
    audit_record(
        organization=action.organization,
        actor=system_principal("redecide"),
        action="action.redecide",
        target=action,
        outcome=decision.outcome,
        data={"policy_version": version, "error": error},
    )


def _signed_command(action: Action, *, args: dict) -> str:
    """The command token for ``action``'s current attempt, carrying the exact ``args``."""
    return sign_command(
        {
            "iss": COMMAND_ISSUER,
            "aud": command_audience(action.pool),
            "jti": action.public_id,
            **action_scope(action),
            "tool": action.tool,
            "args": args,
            "args_salt": digest_salt(args),
            "args_digest": action.args_digest,
            "policy_version": action.policy_version,
            "limits": action.limits,
            "attempt": action.attempt,
        },
        control_private_key(),
        ttl=settings.KESTREL_COMMAND_TTL_SECONDS,
    )


def _command_send(action: Action, token: str) -> bool:
    """Hand a signed command to the broker, then mark the action dispatched."""
    return _send(action, EXECUTE_TASK, [token], runner_queue(action.pool))


def _control_send(action: Action) -> bool:
    """Hand a control-tier call (its action id only) to the control tier's queue, then mark
    the action dispatched. The worker there reads the exact arguments from the action."""
    return _send(action, CONTROL_TIER_TASKS[action.tool], [action.public_id], ADAPTERS_QUEUE)


def _send(action: Action, task: str, args: list, queue: str) -> bool:
    if not broker_status().reachable:
        # Not even tried: a send to a broker that does not answer can block for seconds.
        logger.warning("the broker does not answer; %s waits for the sweep", action.public_id)
        _dispatch_pending(action)
        return False
    try:
        app.send_task(task, args=args, queue=queue)
    except Exception:
        logger.exception("dispatch of %s failed; the sweep will send it again", action.public_id)
        _dispatch_pending(action)
        return False
    now = timezone.now()
    Action.objects.filter(pk=action.pk, state=ActionState.QUEUED).update(
        dispatched_at=now,
        error=None,  # clears a dispatch_pending from an earlier send that failed
        deadline_at=now
        + timedelta(
            seconds=settings.KESTREL_COMMAND_TTL_SECONDS + settings.KESTREL_CALL_GRACE_SECONDS
        ),
    )
    return True


DISPATCH_PENDING = (
    "dispatch_pending",
    "The broker did not take this call's command yet; it is sent again when the broker "
    "answers, and this error clears then.",
)


def _dispatch_pending(action: Action) -> None:
    """Say on the queued action that its command has not reached the broker (API: ``error``)."""
    code, message = DISPATCH_PENDING
    Action.objects.filter(
        pk=action.pk, state=ActionState.QUEUED, dispatched_at__isnull=True
    ).update(error={"code": code, "message": message})


# tool name -> what its app records when a runner's report on one of its calls is recorded
# (``hook(action=, runner=, outcome=, error=)``, inside the report's transaction; it must not
# raise on anything a runner may send). Registered by the app that owns the tool (its ``ready``):
# mcp.call records the changed tool definitions a failed call observed.
CALL_FINISHED_HOOKS: dict[str, Callable[..., None]] = {}


def call_finished_hook_register(tool_name: str, hook: Callable[..., None]) -> None:
    CALL_FINISHED_HOOKS[get_tool(tool_name).name] = hook


class ReportRefused(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code


def report_ingest(token: str) -> str:
    """Verify a runner's signed report and record it. Returns what happened, for logs.

    Nothing is recorded before the signature, the runner's enrollment, and the match with a
    command this control plane issued are all checked.
    """
    try:
        runner_id = unverified_runner_id(token)
    except ResultRefused as refused:
        raise ReportRefused(refused.code, str(refused)) from None
    runner = Runner.objects.filter(public_id=runner_id, revoked_at__isnull=True).first()
    if runner is None:
        raise ReportRefused("unknown_runner", f"{runner_id} is not an enrolled, active runner")
    try:
        report = verify_result(
            token,
            runner_public_key=runner.public_key,
            runner_id=runner_id,
            max_bytes=settings.KESTREL_MAX_REPORT_BYTES,
        )
    except ResultRefused as refused:
        if refused.signed_claims is not None:
            _refused_report_end(runner, refused, token)
        raise ReportRefused(refused.code, str(refused)) from None
    except ProtocolError as refused:
        raise ReportRefused(refused.code, str(refused)) from None
    _note_runner_seen(runner)
    try:
        with transaction.atomic():
            action = (
                Action.objects.select_for_update(of=("self",))
                .select_related("organization", "environment", "project", "thread__organization")
                .filter(public_id=report.call_id)
                .first()
            )
            if action is None or action.command_digest != report.command_digest:
                raise ReportRefused("unknown_command", "the report answers no command we issued")
            if runner.pool == action.pool and runner.organization_id in (
                None,
                action.organization_id,
            ):
                if report.event == "started":
                    return _record_started(action, runner, report)
                return _record_finished(action, runner, report, token)
    except (DataError, IntegrityError, ValueError, UnicodeError) as error:
        # Verified, but it cannot be stored as it is: end the call rather than lose it.
        logger.exception("report on %s could not be recorded", report.call_id)
        refused = ResultRefused(
            "unrecordable",
            f"the control plane could not store it ({type(error).__name__})",
            signed_claims={
                "call_id": report.call_id,
                "command_digest": report.command_digest,
                "event": report.event,
                "attempt": report.attempt,
            },
        )
        _refused_report_end(runner, refused, token)
        raise ReportRefused(refused.code, str(refused)) from None
    # Outside the report's transaction, so that the refusal's own record is kept.
    audit_refusal_record(
        organization=action.organization,
        actor=runner_principal(runner.public_id),
        action="runner.report_refused",
        target=action,
        data={"reason": "runner not allowed for this call's pool or organization"},
    )
    raise ReportRefused("wrong_runner", "this runner may not answer this call")


REPORT_REFUSED = "report_refused"


def _refused_report_end(runner: Runner, refused: ResultRefused, token: str) -> None:
    """End the call a signed report answered, as failed, when the report itself cannot be
    recorded (too large, malformed claims, expired): the runner says the call ran, so it
    must not be left for the sweep to call untaken (``command_expired``).

    Only when the claims that verified name a command we issued, from a runner allowed for
    the call, and the report is not a "started" one. The receipt records the refusal, with
    the refused report's digest as its evidence; nothing of the report's result is kept.
    """
    claims = refused.signed_claims or {}
    call_id, command_digest = claims.get("call_id"), claims.get("command_digest")
    if not isinstance(call_id, str) or not isinstance(command_digest, str):
        return
    if claims.get("event") == "started":
        return
    error = {
        "code": REPORT_REFUSED,
        "message": (
            f"The runner reported on this call, but its report could not be recorded "
            f"({refused.code}: {refused.message}). The call may have had its effects."
        ),
    }
    with transaction.atomic():
        action = (
            Action.objects.select_for_update(of=("self",))
            .select_related("organization", "environment", "project", "thread__organization")
            .filter(public_id=call_id, command_digest=command_digest)
            .first()
        )
        if action is None or not (
            runner.pool == action.pool and runner.organization_id in (None, action.organization_id)
        ):
            return
        attempt = claims.get("attempt")
        report = _RefusedReport(
            attempt=attempt if isinstance(attempt, int) else 0,
            error=error,
            command_digest=command_digest,
        )
        _record_finished(action, runner, report, token)


@dataclass(frozen=True)
class _RefusedReport:
    """What ``_record_finished`` records for a signed report it could not take: a failure
    with the refusal as its error, and nothing the report itself claimed beyond the call."""

    attempt: int
    error: dict
    command_digest: str
    outcome: str = "failed"
    result: None = None
    sandbox: None = None
    started_at: None = None
    finished_at: None = None


def _note_runner_seen(runner: Runner) -> None:
    """Advisory, so written at most once a minute, and outside the report's transaction:
    every report of a runner would otherwise queue on the runner's one row."""
    now = timezone.now()
    if runner.last_seen_at is None or now - runner.last_seen_at > RUNNER_SEEN_RESOLUTION:
        Runner.objects.filter(pk=runner.pk).update(last_seen_at=now)


def _running_deadline(action: Action, now):
    """When the sweep may call a running action lost.

    A runner killed mid-call gets its command back from the broker only after the visibility
    timeout; an idempotent tool then runs again for up to its timeout. Ending the action
    before that would turn a call that is about to complete into ``runner_lost``.
    """
    redelivery = settings.CELERY_BROKER_TRANSPORT_OPTIONS["visibility_timeout"]
    timeout = float(action.limits.get("timeout_s") or settings.KESTREL_MAX_CALL_SECONDS)
    return now + timedelta(seconds=redelivery + timeout + settings.KESTREL_CALL_GRACE_SECONDS)


def _record_started(action: Action, runner: Runner, report) -> str:
    now = timezone.now()
    moved = Action.objects.filter(pk=action.pk, state=ActionState.QUEUED).update(
        state=ActionState.RUNNING,
        runner=runner,
        started_at=now,
        deadline_at=_running_deadline(action, now),
    )
    if not moved:
        return "duplicate-start"
    kind, data = _started_event(action, runner, report)
    event_append(thread=action.thread, kind=kind, action=action, data=data)
    return "started"


def _started_event(action: Action, runner: Runner, report) -> tuple[str, dict]:
    return (
        "action.started",
        {"action": action.public_id, "runner": runner.public_id, "attempt": report.attempt},
    )


def _reported_start(report, now):
    """When the runner says the call started, for a call whose "started" report never came.

    The runner's clock may run a little ahead of ours; a start after our "finished" would
    read as nonsense, so it is capped at now.
    """
    if not report.started_at:
        return now
    return min(datetime.fromisoformat(report.started_at), now)


def _record_finished(action: Action, runner: Runner, report, token: str) -> str:
    """Record the outcome, once. A call that ended within the runner's started-report delay
    sent no "started" report (docs/runners.md#reports): its start is recorded here, in the
    same transaction and before the finish, so its events read as for any other call."""
    now = timezone.now()
    # The row is locked (report_ingest), so this state is the one the update below moves.
    # An action the sweep ended as never taken (command_expired) was taken after all when a
    # runner reports on it: a worker died within the delay, before any "started" report, and
    # the broker handed its command back only after the sweep's deadline. The report is the
    # fact; the sweep's conclusion was an inference, and this is the one ending that moves.
    taken_after_all = (
        action.state == ActionState.EXPIRED
        and (action.error or {}).get("code") == COMMAND_EXPIRED[0]
    )
    never_started = action.state == ActionState.QUEUED or taken_after_all
    # Output past the inline cap and checkpoint archives become artifacts; the action and
    # its receipt keep the inline part and a reference (docs/records.md). Only for an
    # action still in flight: a report on one that already finished changes nothing there.
    # Redacted as received, before it is stored anywhere (CRED-1): the action, its receipt,
    # events, audit and artifacts all keep this copy; the call's own environment values are
    # masked wherever the tool printed them. Digests in the result (sha256 of files) stay
    # those of the real content. What the runner printed may hold NULs and unpaired
    # surrogates, which no JSON column keeps (kestrel_one.common.storable): artifacts keep
    # the NULs, the records U+FFFD.
    known = write_only_values(action_arguments(action))
    result = utf8_encodable(report.result)
    if action.state in (ActionState.QUEUED, ActionState.RUNNING):
        result = artifacts_capture(action=action, result=result, known=known)
    result = json_storable(redact_result(result, known=known))
    error = json_storable(redact_result(report.error, known=known))
    state = ActionState.SUCCEEDED if report.outcome == "succeeded" else ActionState.FAILED
    # Tool output is untrusted data: flagged for people, never read as an instruction. All of
    # it: a result may hold more than the scan's default budget (an MCP server's content and
    # its structured content), and an error quotes what the tool said (a server's JSON-RPC
    # error, its stderr). The report was verified within KESTREL_MAX_REPORT_BYTES, so all it
    # carries is within that many characters, and redacting it costs more than this scan.
    output_flags = {
        f"output:{flag}"
        for flag in injection_flags(
            [report.result, report.error], max_chars=settings.KESTREL_MAX_REPORT_BYTES
        )
    }
    moved = Action.objects.filter(
        Q(state__in=[ActionState.QUEUED, ActionState.RUNNING])
        | Q(state=ActionState.EXPIRED, error__code=COMMAND_EXPIRED[0]),
        pk=action.pk,
    ).update(
        state=state,
        runner=runner,
        finished_at=now,
        result=result,
        error=error,
        sealed_args="",
        started_at=_reported_start(report, now) if never_started else action.started_at or now,
        flags=sorted(set(action.flags) | output_flags),
    )
    if not moved:
        return "duplicate-finish"
    hook = CALL_FINISHED_HOOKS.get(action.tool)
    if hook is not None:
        # In this transaction: what the tool's app records of the report (an mcp.call's
        # changed tool definitions) is kept exactly when the report is. The report's own
        # error, as signed: the hook bounds and checks what it keeps.
        hook(action=action, runner=runner, outcome=report.outcome, error=report.error)
    receipt = Receipt.objects.create(
        action=action,
        organization=action.organization,
        call_id=action.public_id,
        tool=action.tool,
        args=action.args,
        args_digest=action.args_digest,
        action_digest=action.action_digest,
        scope=action_scope(action),
        outcome=report.outcome,
        result=result,
        error=error,
        policy_version=action.policy_version,
        decision=action.decision,
        runner=runner.public_id,
        sandbox=report.sandbox or "",
        command_digest=report.command_digest,
        report_digest=token_digest(token),
        started_at=report.started_at,
        finished_at=report.finished_at,
    )
    finished = (
        "action.finished",
        {
            "action": action.public_id,
            "state": state,
            "receipt": receipt.public_id,
            "error": error,
            "exit_code": (report.result or {}).get("exit_code"),
            "flags": sorted(output_flags),
        },
    )
    # A start never reported is recorded just before the finish, in the same statement.
    events_append(
        thread=action.thread,
        action=action,
        events=[_started_event(action, runner, report), finished] if never_started else [finished],
    )
    audit_record(
        organization=action.organization,
        actor=runner_principal(runner.public_id),
        action="action.finish",
        target=action,
        outcome=state,
        data={"receipt": receipt.public_id, "error": error},
    )
    # Registered after the events: their notices (which wake a request waiting on this
    # action) go out on commit before the action_ended receivers run.
    action_ended_notify(action, state)
    return state


# (code, message) of the errors the control plane itself ends actions with.
COMMAND_EXPIRED = ("command_expired", "No runner took the command before it expired.")
RUNNER_LOST = ("runner_lost", "The runner stopped reporting before the call finished.")
APPROVAL_EXPIRED = ("approval_expired", "Nobody decided before the approval window closed.")
# The same endings said of a control-tier call, which no runner takes.
CONTROL_TIER_MESSAGES = {
    COMMAND_EXPIRED[0]: "No control-tier worker (queue adapters) took the call before it expired.",
    RUNNER_LOST[0]: "The control-tier worker stopped reporting before the call finished.",
}


def _control_tier(action: Action) -> bool:
    return get_tool(action.tool).tier == Tier.CONTROL


def calls_sweep(*, now=None) -> dict:
    """End calls whose runner went silent; send again what never reached the broker."""
    now = now or timezone.now()
    approval_deadline = now - timedelta(seconds=settings.KESTREL_APPROVAL_TTL_SECONDS)
    endings = (
        (
            "expired",
            Q(dispatched_at__isnull=False, deadline_at__lt=now),
            ActionState.QUEUED,
            ActionState.EXPIRED,
            COMMAND_EXPIRED,
        ),
        (
            "runner_lost",
            Q(deadline_at__lt=now),
            ActionState.RUNNING,
            ActionState.FAILED,
            RUNNER_LOST,
        ),
        (
            "approvals_expired",
            Q(created_at__lt=approval_deadline),
            ActionState.AWAITING_APPROVAL,
            ActionState.EXPIRED,
            APPROVAL_EXPIRED,
        ),
    )
    ended = {"expired": 0, "runner_lost": 0, "redispatched": 0, "approvals_expired": 0}
    for counter, condition, from_state, to_state, (code, message) in endings:
        overdue = Action.objects.filter(condition, state=from_state)
        for action in overdue.select_related("thread", "organization"):
            said = CONTROL_TIER_MESSAGES.get(code, message) if _control_tier(action) else message
            if end_action(action, from_state, to_state, code, said):
                ended[counter] += 1
    ended["idempotency_keys_deleted"], _ = IdempotencyKey.objects.filter(
        created_at__lt=now - timedelta(seconds=settings.KESTREL_IDEMPOTENCY_TTL_SECONDS)
    ).delete()
    stale = now - timedelta(seconds=10)
    for action_id in Action.objects.filter(
        state=ActionState.QUEUED, dispatched_at__isnull=True, created_at__lt=stale
    ).values_list("pk", flat=True):
        ended["redispatched"] += int(action_dispatch(action_id=action_id))
    return ended


@transaction.atomic
def end_action(
    action: Action, from_state: str, to_state: str, code: str, message: str, *, actor=None
) -> bool:
    """Move an action to a terminal state with an error, once (a conditional update)."""
    error = {"code": code, "message": message}
    moved = Action.objects.filter(pk=action.pk, state=from_state).update(
        state=to_state, error=error, finished_at=timezone.now(), sealed_args=""
    )
    if moved:
        action_ended_notify(action, to_state)
        event_append(
            thread=action.thread,
            kind="action.finished",
            action=action,
            data={"action": action.public_id, "state": to_state, "error": error},
        )
        audit_record(
            organization=action.organization,
            actor=actor or system_principal("sweep"),
            action="action.end",
            target=action,
            outcome=to_state,
            data={"error": error},
        )
    return bool(moved)


# The receipt's ``runner`` for a call the control tier made (no runner took part).
CONTROL_TIER_RUNNER = "control-tier"


def control_call_arguments_intact(action: Action, args: dict) -> bool:
    """Whether ``args`` (``action_arguments(action)``) are still the arguments the action was
    decided and approved with: their digest and the action digest recomputed over them. A
    control-tier tool checks it before it releases a credential or sends anything, as a
    runner checks a signed command's digest."""
    args_digest = call_args_digest(args)
    recomputed = action_digest(
        scope=action_scope(action),
        tool=action.tool,
        args_digest=args_digest,
        policy_version=action.policy_version,
    )
    return args_digest == action.args_digest and recomputed == action.action_digest


def control_call_claim(*, action_id: str, tool: str) -> Action | None:
    """Take a queued control-tier call for the worker that received it: queued -> running,
    once (a conditional update), with its "started" event. None when it is not queued (ended
    meanwhile: expired, cancelled, redecided; or already taken by an earlier delivery).

    Decided again first, under the policy locks, as a runner command is when it is signed
    (``action_dispatch``): nothing signed carries the version here, so the version current
    when the call starts is the one it runs under, and a narrowing published since denies it
    (or sends it back to a person) before anything is released or sent.
    """
    now = timezone.now()
    with transaction.atomic():
        action = _queued_redecided(public_id=action_id, tool=tool)
        if action is None:
            return None
        action.state = ActionState.RUNNING
        action.started_at = now
        action.deadline_at = _running_deadline(action, now)
        Action.objects.filter(pk=action.pk).update(
            state=action.state, started_at=now, deadline_at=action.deadline_at
        )
        event_append(
            thread=action.thread,
            kind="action.started",
            action=action,
            data={
                "action": action.public_id,
                "runner": CONTROL_TIER_RUNNER,
                "attempt": action.attempt,
            },
        )
    return action


@transaction.atomic
def control_call_finish(*, action: Action, outcome: str, result, error, evidence: dict) -> str:
    """Record how a control-tier call ended, once: the action's result, its receipt (with
    ``evidence``: request and response hashes and sizes, never a credential), the
    "finished" event and the audit record. The one ending path of every control-tier tool
    (adapter.invoke, model.invoke).

    ``result``, ``error`` and ``evidence`` must already be secret-free: the caller masks the
    credential it released wherever the upstream echoed it; everything is redacted again
    here, as every recorded result is. Returns the state, or "duplicate-finish" when the
    action had already ended (the sweep called it lost, say).
    """
    if outcome not in ("succeeded", "failed"):
        raise ValueError(f"unknown outcome {outcome!r}")
    now = timezone.now()
    result = json_storable(redact_result(utf8_encodable(result)))
    error = json_storable(redact_result(error))
    evidence = json_storable(redact(evidence))
    state = ActionState.SUCCEEDED if outcome == "succeeded" else ActionState.FAILED
    started_at = action.started_at or now
    moved = Action.objects.filter(
        pk=action.pk, state__in=[ActionState.QUEUED, ActionState.RUNNING]
    ).update(
        state=state,
        finished_at=now,
        result=result,
        error=error,
        sealed_args="",
        started_at=started_at,
    )
    if not moved:
        return "duplicate-finish"
    action_ended_notify(action, state)
    receipt = Receipt.objects.create(
        action=action,
        organization=action.organization,
        call_id=action.public_id,
        tool=action.tool,
        args=action.args,
        args_digest=action.args_digest,
        action_digest=action.action_digest,
        scope=action_scope(action),
        outcome=outcome,
        result=result,
        error=error,
        policy_version=action.policy_version,
        decision=action.decision,
        runner=CONTROL_TIER_RUNNER,
        sandbox="",
        evidence=evidence,
        started_at=started_at,
        finished_at=now,
    )
    event_append(
        thread=action.thread,
        kind="action.finished",
        action=action,
        data={
            "action": action.public_id,
            "state": state,
            "receipt": receipt.public_id,
            "error": error,
            "runner": CONTROL_TIER_RUNNER,
        },
    )
    audit_record(
        organization=action.organization,
        actor=system_principal(CONTROL_TIER_RUNNER),
        action="action.finish",
        target=action,
        outcome=state,
        data={"receipt": receipt.public_id, "error": error, "evidence": evidence},
    )
    return state
