"""Turning a requested tool call into what the policy judges, with errors naming the field."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from difflib import get_close_matches
from typing import Any

from kestrel_one.common.errors import Unavailable, ValidationFailed
from kestrel_one.governance.selectors import EffectivePolicy, effective_policy
from policies import DENY, NEEDS_APPROVAL, Decision, Mode, Policy, Request, decide
from runners.contract.arguments import output_read_requests
from runners.contract.errors import InvalidArguments, UnknownTool
from runners.contract.registry import TOOLS, get_tool, validate_args
from runners.contract.toolspec import Tier


@dataclass(frozen=True)
class ControlToolChecks:
    """What the control plane checks of a control-tier tool's call beyond its schema.

    ``request(canonical, request)``: pure checks against what only the control plane knows
    (the adapter registry), returning the policy request to judge (e.g. with the operation's
    effect); raises ``ValidationFailed`` naming the field. ``admit(organization=, user=,
    token=, canonical=)``: checks that read the database (a credential reference usable by
    this requester), returning the canonical arguments to record (a default reference made
    explicit, so the digest binds it). Registered by the app that owns the tool (its
    ``AppConfig.ready``): this layer cannot import it.
    """

    request: Callable[[dict, Request], Request]
    admit: Callable[..., dict]


CONTROL_TOOL_CHECKS: dict[str, ControlToolChecks] = {}


def control_tool_checks_register(tool_name: str, checks: ControlToolChecks) -> None:
    if get_tool(tool_name).tier != Tier.CONTROL:
        raise TypeError(f"{tool_name} is not a control-tier tool")
    CONTROL_TOOL_CHECKS[tool_name] = checks


def _control_checks(tool) -> ControlToolChecks:
    checks = CONTROL_TOOL_CHECKS.get(tool.name)
    if checks is None:
        # Fail closed: a control-tier tool whose checks are not installed is not callable.
        raise Unavailable(f"{tool.name} is not available here: its control tier is not installed.")
    return checks


def tool_call_request(tool_name: str, args):
    """Return (tool spec, canonical args, policy request) for a call, or a 400 naming the field.

    Tools exist only in the registry (EXT-1): an unknown name is refused, never passed on.
    """
    try:
        tool = get_tool(tool_name)
    except UnknownTool:
        raise ValidationFailed(
            unknown_tool_message(tool_name), details={"tool": ["unknown"]}
        ) from None
    try:
        canonical = validate_args(tool.name, args)
    except InvalidArguments as exc:
        raise ValidationFailed(str(exc), details={exc.field: [exc.reason]}) from None
    request = tool.capability_request(canonical)
    if tool.tier == Tier.CONTROL:
        request = _control_checks(tool).request(canonical, request)
    return tool, canonical, request


def call_admit(*, tool, canonical: dict, organization, user, token) -> dict[str, Any]:
    """The canonical arguments to record for a call by this requester, after the checks
    that read the database (control-tier tools only; others are returned unchanged)."""
    if tool.tier != Tier.CONTROL:
        return canonical
    return _control_checks(tool).admit(
        organization=organization, user=user, token=token, canonical=canonical
    )


def unknown_tool_message(tool_name) -> str:
    """Names the tools there are (and the likeliest one meant), so a typo is fixed at once."""
    known = sorted(TOOLS)
    close = get_close_matches(str(tool_name), known, n=1)
    meant = f" (did you mean {close[0]!r}?)" if close else ""
    return (
        f"Unknown tool {str(tool_name)[:100]!r}{meant}; the tools are: {', '.join(known)}. "
        "GET /api/v1/tools describes each one's arguments."
    )


def decide_call(policy: Policy, request: Request, args, *, version: str, mode: Mode) -> Decision:
    """Judge a call: its own request, then ``fs.read`` on each file it declares as output.

    A declared output comes back to the control plane whole and is kept as an artifact, so
    returning it is reading it. shell.exec and code.exec grants do not judge paths, so the
    files cannot simply ride in the tool's ``Request``; each is judged as the ``fs.read`` it
    amounts to. Any unreadable output denies the whole call, with a reason naming the path;
    an output whose read needs approval makes the call need approval. The limits are the
    tool's own. ``mode`` (already applied to ``policy``) lets a denial say that the mode, not
    the policy, removed the capability.
    """
    decision = decide(policy, request, version=version, mode=mode)
    reads = output_read_requests(args)
    if decision.outcome == DENY or not reads:
        return decision
    outcome, reasons, denials = decision.outcome, list(decision.reasons), []
    for read in reads:
        path = read.paths[0]
        verdict = decide(policy, read, version=version, mode=mode)
        if verdict.outcome == DENY:
            denials.append(
                f"declared output '{path}' may not be read: " + "; ".join(verdict.reasons)
            )
            continue
        reasons.append(f"declared output '{path}' may be read: " + "; ".join(verdict.reasons))
        if verdict.outcome == NEEDS_APPROVAL:
            outcome = NEEDS_APPROVAL
    if denials:
        return Decision(DENY, decision.capability, tuple(denials), version)
    return Decision(outcome, decision.capability, tuple(reasons), version, decision.limits)


@dataclass(frozen=True)
class Judgement:
    """A call judged: the effective policy it was judged by, and the decision."""

    effective: EffectivePolicy
    decision: Decision


def call_judge(*, project, principal, mode: Mode, policy_request: Request, canonical) -> Judgement:
    """Judge one call in a project for a principal and mode: the one sequence that both an
    action request (``execution.services.action_request``) and ``explain`` run, so explain
    answers exactly what a request would meet."""
    effective = effective_policy(project=project, principal=principal, mode=mode)
    decision = decide_call(
        effective.policy, policy_request, canonical, version=effective.version, mode=mode
    )
    return Judgement(effective=effective, decision=decision)
