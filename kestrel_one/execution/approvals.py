"""Approvals and verification records: acts of a person, never of a token
acting for itself, an integration, or an anonymous local agent."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from kestrel_one.accounts.principal import PrincipalKind
from kestrel_one.audit.services import audit_record
from kestrel_one.common.errors import CheckNotBound, Conflict, PermissionDenied, ValidationFailed
from kestrel_one.execution.arguments import action_arguments, call_args_digest
from kestrel_one.execution.models import Action, ActionState, Approval, Verification
from kestrel_one.execution.requesters import (
    REQUESTER_INACTIVE,
    REQUESTER_INACTIVE_MESSAGE,
    RequesterInactive,
    requester_now,
)
from kestrel_one.execution.services import (
    APPROVAL_EXPIRED,
    action_digest,
    action_dispatch,
    action_redecide,
    action_redecision,
    action_scope,
    end_action,
)
from kestrel_one.execution.signals import action_ended_notify
from kestrel_one.governance.selectors import policy_versions_lock
from kestrel_one.threads.services import event_append, thread_require_open
from policies import DENY


class ReauthenticationRequired(Exception):
    """A person's decision came through a console session past sudo mode: nothing is decided,
    and the console sends the person to confirm who they are (``what`` says for what). Not a
    ``KestrelError``, so that no page shows it as a refusal: the console's base view answers
    it (``console.base.ConsoleView.dispatch``)."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


def require_person(
    actor, *, organization, requested_by_lineage: str = "", act: str, what: str
) -> None:
    """Only a person holding ``actions:approve`` in ``organization`` may decide (approve or
    deny an action, accept a plan or a task), and never through a token of the lineage that
    made the request: a token minted by a token is the same agent
    (accounts.ApiToken.lineage), so neither the requesting token nor one minted from it (or
    from what minted it) decides.

    The scope is checked here, where each decision is made, not only by a view's scope map:
    task acceptance shares its endpoint with named checks, which need ``projects:write``.

    ``act`` and ``what`` make the messages: "approve" "this action", "accept" "this plan".

    Through the console it also takes sudo mode (``Principal.reauthenticated``): each decision
    a person alone may make is one that a session left open must not be enough for, whichever
    page posts it (``ReauthenticationRequired``, raised inside the caller's transaction, so
    nothing is written).
    """
    if actor.kind == PrincipalKind.LOCAL_AGENT:
        raise PermissionDenied(
            f"A local agent cannot {act} {what}: sign in as a person and use the console or "
            "your own API token with the actions:approve scope."
        )
    if not actor.is_person:
        raise PermissionDenied(f"Only a person can {act} {what}; integration tokens never can.")
    if "actions:approve" not in actor.scopes_in(organization):
        raise PermissionDenied(
            f"To {act} {what} you need the actions:approve scope, which your role or this "
            "token does not have. A token gets it only when a person makes it in the console."
        )
    require_other_lineage(actor, requested_by_lineage, act=act, what=what)
    if actor.reauthenticated is False:
        raise ReauthenticationRequired(f"{act} {what}")


def require_other_lineage(actor, requested_by_lineage: str, *, act: str, what: str) -> None:
    """No token of the lineage that made a request decides on it, whoever it speaks for (a
    person, or a named check): a token minted by a token is the same agent."""
    if requested_by_lineage and actor.lineage == requested_by_lineage:
        raise PermissionDenied(
            f"The token that made the request, or any token minted in the same chain (its "
            f"lineage), cannot {act} {what}: a token minted by a token is the same agent. "
            "Sign in to the console, or use a token made there for deciding."
        )


def _digest_intact(action: Action) -> None:
    """Recompute the action's digest from what is stored now: if any bound field (scope,
    tool, arguments, policy version) differs from what was requested, this approval is not
    for it."""
    args_digest = call_args_digest(action_arguments(action))
    recomputed = action_digest(
        scope=action_scope(action),
        tool=action.tool,
        args_digest=args_digest,
        policy_version=action.policy_version,
    )
    if args_digest != action.args_digest or recomputed != action.action_digest:
        raise Conflict(
            "This action changed after it was requested; it cannot be approved. Request it again."
        )


def _policy_unchanged(action: Action) -> bool:
    """The approval binds to the policy versions the action was decided under (read under
    the policy locks). Under a new version the action is decided again: when that denies it,
    it ends denied (False: the caller commits that, then refuses); any other new decision
    would not be the one the person is approving, so the action must be requested again."""
    decision = action_redecision(action)
    if decision is None:
        return True
    if decision.outcome == DENY:
        action_redecide(action, decision)
        return False
    raise Conflict(
        "The policy changed since this action was requested, so this approval would not "
        "match what was decided; request the action again.",
        details={"requested_under": action.policy_version, "now": decision.policy_version},
    )


EXPIRED_MESSAGE = "This action waited too long for approval and expired; request it again."


def approval_decide(*, actor, action: Action, approve: bool, reason: str = "") -> Approval:
    """Record a person's approval or denial of exactly this action.

    An action that waited past the approval window is ended as expired instead, judged on
    the row as it is locked for the decision (never on the caller's earlier read of it), and
    committed before the refusal, so the refusal does not roll the expiry back; likewise one
    whose requester can no longer act is cancelled rather than approved
    (``execution.requesters``).
    """
    approval = _decide(actor=actor, action=action, approve=approve, reason=reason)
    if approval is None:
        state, error = Action.objects.values_list("state", "error").get(pk=action.pk)
        if error["code"] == APPROVAL_EXPIRED[0]:
            raise Conflict(EXPIRED_MESSAGE, details={"state": state})
        refusal = RequesterInactive if error["code"] == REQUESTER_INACTIVE else Conflict
        raise refusal(error["message"], details={"state": state})
    return approval


@transaction.atomic
def _decide(*, actor, action: Action, approve: bool, reason: str) -> Approval | None:
    """The decision, or None when the action ended instead, recorded with its error: it
    waited past the approval window (expired), a policy published since the request now
    denies it, or (for an approval) its requester can no longer act, so it is cancelled."""
    # Before the action's row, in the order a publish takes them (policy_versions_lock).
    policy_versions_lock(action.project)
    action = (
        Action.objects.select_for_update(of=("self",))
        .select_related("thread", "project", "organization", "environment")
        .get(pk=action.pk)
    )
    require_person(
        actor,
        organization=action.organization,
        requested_by_lineage=action.requested_by_lineage,
        act="approve" if approve else "deny",
        what="this action",
    )
    if action.state != ActionState.AWAITING_APPROVAL:
        raise Conflict(
            f"This action is {action.state}; only an action awaiting approval can be decided."
        )
    # Judged here, on the locked row: the window is the row's, whatever the caller read.
    window = timedelta(seconds=settings.KESTREL_APPROVAL_TTL_SECONDS)
    if timezone.now() > action.created_at + window:
        end_action(action, ActionState.AWAITING_APPROVAL, ActionState.EXPIRED, *APPROVAL_EXPIRED)
        return None
    if approve:
        # An approval would dispatch a new call into a thread that has ended; a denial
        # only settles the action, so it stays possible.
        thread_require_open(thread=action.thread)
        if requester_now(action) is None:
            end_action(
                action,
                ActionState.AWAITING_APPROVAL,
                ActionState.CANCELLED,
                REQUESTER_INACTIVE,
                REQUESTER_INACTIVE_MESSAGE,
                actor=actor,
            )
            return None
        _digest_intact(action)
        if not _policy_unchanged(action):
            return None
    decision = "approved" if approve else "denied"
    approval = Approval.objects.create(
        organization=action.organization,
        action=action,
        action_digest=action.action_digest,
        decision=decision,
        reason=reason,
        decided_by=actor.user,
        decided_by_token=actor.token,
    )
    new_state = ActionState.QUEUED if approve else ActionState.DENIED
    Action.objects.filter(pk=action.pk, state=ActionState.AWAITING_APPROVAL).update(
        state=new_state,
        finished_at=None if approve else timezone.now(),
        # A denied call is never signed: its exact arguments are not kept.
        **({} if approve else {"sealed_args": ""}),
    )
    if not approve:
        action_ended_notify(action, new_state)
    event_append(
        thread=action.thread,
        kind=f"action.{decision}",
        action=action,
        data={
            "action": action.public_id,
            "approval": approval.public_id,
            "by": actor.user.public_id,
            "action_digest": action.action_digest,
        },
    )
    audit_record(
        organization=action.organization,
        actor=actor,
        action="action.approve" if approve else "action.deny",
        target=action,
        data={
            "approval": approval.public_id,
            "action_digest": action.action_digest,
            "reason": reason,
        },
    )
    if approve:
        transaction.on_commit(lambda: action_dispatch(action_id=action.pk))
    return approval


def _has_substance(evidence: str) -> bool:
    """Evidence says something: at least one letter or digit, not only spaces, punctuation
    or invisible characters."""
    return any(char.isalnum() for char in evidence)


@transaction.atomic
def verification_record(
    *, actor, action: Action, accepted: bool, evidence: str, check_name: str = ""
) -> Verification:
    """Record whether the task was accepted. A person decides, or a named check does; the
    receipt's observed effects are evidence, never acceptance by themselves (AUD-4).

    Either way it needs its own evidence. A named check speaks only through a token bound to
    it (``ApiToken.checks``); neither a person nor a check accepts through a token of the
    lineage that requested the action: an agent never accepts its own work.
    """
    if not _has_substance(evidence or ""):
        raise ValidationFailed(
            "Evidence is required: say what was checked and what it showed (a test run, a "
            "review, a link); the receipt alone never accepts a task.",
            details={"evidence": ["empty"]},
        )
    if check_name:
        token = actor.token
        if token is None or check_name not in token.checks:
            raise CheckNotBound(
                f"This token is not bound to the check '{check_name}', so it cannot record "
                "verifications as it. An admin makes an integration token for the check "
                f'with "checks": ["{check_name}"].',
                details={"check": ["not bound to this token"]},
            )
        require_other_lineage(
            actor,
            action.requested_by_lineage,
            act="accept or reject",
            what=f"this task as the check '{check_name}'",
        )
        verified_by = f"check:{check_name}"
    else:
        require_person(
            actor,
            organization=action.organization,
            requested_by_lineage=action.requested_by_lineage,
            act="accept or reject",
            what="this task",
        )
        verified_by = actor.user.public_id
    if action.state not in {ActionState.SUCCEEDED, ActionState.FAILED}:
        raise Conflict("Only a finished action can be verified.")
    verification = Verification.objects.create(
        organization=action.organization,
        action=action,
        accepted=accepted,
        evidence=evidence,
        verified_by=verified_by,
        check_name=check_name,
    )
    event_append(
        thread=action.thread,
        kind="action.verified",
        action=action,
        data={
            "action": action.public_id,
            "verification": verification.public_id,
            "accepted": accepted,
            "by": verified_by,
        },
    )
    audit_record(
        organization=action.organization,
        actor=actor,
        action="action.verify",
        target=action,
        data={"accepted": accepted, "by": verified_by},
    )
    return verification
