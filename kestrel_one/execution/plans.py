"""Plans: ordered, reviewable tool calls that become executable only when a person accepts them.

An accepted step is executed by an action that names it explicitly; the server checks the step
belongs to the thread and matches the action exactly (``services._plan_step``), never by
similarity. Each step runs at most ``uses`` times (1 unless the plan says otherwise): every
action that names it uses it once, whatever that action's outcome.
"""

from __future__ import annotations

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from kestrel_one.audit.services import audit_record
from kestrel_one.common.errors import Conflict, ThreadEnded, ValidationFailed
from kestrel_one.common.injection import injection_flags
from kestrel_one.execution.approvals import require_person
from kestrel_one.execution.arguments import arguments_shown, call_args_digest
from kestrel_one.execution.models import Plan
from kestrel_one.governance.judging import tool_call_admitted
from kestrel_one.threads.models import Thread
from kestrel_one.threads.services import THREAD_ENDED_MESSAGE, event_append, thread_require_open
from policies import Mode


@transaction.atomic
def plan_propose(*, actor, thread, steps: list[dict]) -> Plan:
    if thread.status != Thread.Status.OPEN:
        raise ThreadEnded(THREAD_ENDED_MESSAGE)
    if thread.mode not in {Mode.PLAN, Mode.AUTO}:
        raise Conflict(
            f"Plans are proposed in plan (or auto) threads; this thread is in {thread.mode} mode."
        )
    canonical_steps = []
    raw_steps: list[dict] = []
    for index, step in enumerate(steps):
        try:
            # Admitted where the recorded arguments depend on it (mcp.call's pinned), so the
            # step's digest is the one the action that runs it will have.
            tool, canonical, _ = tool_call_admitted(
                step["tool"],
                step["args"],
                project=thread.project,
                user=actor.user,
                token=actor.token,
                judging_only=True,
            )
        except ValidationFailed as exc:
            details = {f"steps[{index}].{name}": why for name, why in (exc.details or {}).items()}
            raise ValidationFailed(f"steps[{index}]: {exc.message}", details=details) from None
        uses = step.get("uses", 1)
        if not 1 <= uses <= settings.KESTREL_PLAN_STEP_MAX_USES:
            raise ValidationFailed(
                f"steps[{index}].uses must be 1 to {settings.KESTREL_PLAN_STEP_MAX_USES} "
                "(KESTREL_PLAN_STEP_MAX_USES): how many times the step may run once accepted.",
                details={f"steps[{index}].uses": ["out of range"]},
            )
        # The step binds to the exact arguments by digest; the plan keeps and shows them
        # redacted, and the action that runs the step supplies them again (CRED-1).
        shown = arguments_shown(canonical)
        canonical_steps.append(
            {
                "tool": tool.name,
                "args": shown,
                "args_digest": call_args_digest(canonical, shown),
                "uses": uses,
            }
        )
        raw_steps.append(canonical)
    thread_require_open(thread=thread)  # an ended thread takes no new plan
    plan = Plan.objects.create(
        organization=thread.organization,
        thread=thread,
        steps=canonical_steps,
        proposed_by=actor.actor_id,
        proposed_by_token=actor.token,
        proposed_by_lineage=actor.lineage,
        flags=injection_flags(raw_steps),
    )
    event_append(
        thread=thread,
        kind="plan.proposed",
        data={"plan": plan.public_id, "steps": len(canonical_steps), "flags": plan.flags},
    )
    audit_record(
        organization=thread.organization,
        actor=actor,
        action="plan.propose",
        target=plan,
        data={"steps": len(canonical_steps)},
    )
    return plan


@transaction.atomic
def plan_accept(*, actor, plan: Plan) -> Plan:
    plan = (
        Plan.objects.select_for_update(of=("self",))
        .select_related("thread", "organization")
        .get(pk=plan.pk)
    )
    require_person(
        actor,
        organization=plan.organization,
        requested_by_lineage=plan.proposed_by_lineage,
        act="accept",
        what="this plan",
    )
    if plan.state != "proposed":
        raise Conflict(f"This plan is {plan.state}; only a proposed plan can be accepted.")
    # Accepting would make steps executable in a thread that takes no new actions.
    thread_require_open(thread=plan.thread)
    Plan.objects.filter(pk=plan.pk, state="proposed").update(
        state="accepted", accepted_by=actor.user, accepted_at=timezone.now()
    )
    plan.refresh_from_db()
    event_append(
        thread=plan.thread,
        kind="plan.accepted",
        data={"plan": plan.public_id, "by": actor.user.public_id, "steps": len(plan.steps)},
    )
    audit_record(
        organization=plan.organization,
        actor=actor,
        action="plan.accept",
        target=plan,
        data={"steps": len(plan.steps)},
    )
    return plan
