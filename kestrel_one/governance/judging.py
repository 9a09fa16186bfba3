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


@dataclass(frozen=True)
class ToolChecks:
    """What the control plane checks of a tool's call beyond its schema.

    ``request(canonical, request)``: pure checks against what only the control plane knows
    (the adapter registry), returning the policy request to judge (e.g. with the operation's
    effect); raises ``ValidationFailed`` naming the field. ``admit(organization=, project=,
    user=, token=, canonical=)``: checks that read the database (a credential reference
    usable by this requester, an MCP server installed in the project's Environment),
    returning the canonical arguments to record (a default reference made explicit, the
    server's pinned profile added, so the digest binds it). For a tool whose spec says
    ``admitted`` the policy request depends on what ``admit`` adds (mcp.call's ``pinned``:
    the server's name and the recorded tool's danger), so every judging of a caller's
    arguments (explain, plan steps) admits them first. ``dispatch(canonical)``: checked
    again each time a queued call is signed (an approval, a resend): ``(code, message)``
    ends the call failed unsigned, None lets it go. Registered by the app that owns the tool
    (its ``AppConfig.ready``): this layer cannot import it.
    """

    request: Callable[[dict, Request], Request] | None = None
    admit: Callable[..., dict] | None = None
    dispatch: Callable[[dict], tuple[str, str] | None] | None = None


TOOL_CHECKS: dict[str, ToolChecks] = {}


def tool_checks_register(tool_name: str, checks: ToolChecks) -> None:
    tool = get_tool(tool_name)
    if not tool.needs_checks():
        raise TypeError(f"{tool_name} takes no checks of the control plane")
    TOOL_CHECKS[tool.name] = checks


def _checks(tool) -> ToolChecks | None:
    checks = TOOL_CHECKS.get(tool.name)
    if checks is None and tool.needs_checks():
        # Fail closed: a tool whose checks are not installed is not callable.
        raise Unavailable(f"{tool.name} is not available here: its control tier is not installed.")
    return checks


def _validated(tool_name: str, args):
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
    return tool, canonical


def policy_request_of(tool, canonical: dict) -> Request:
    """The policy request for ``tool``'s validated (and, for a checked tool, admitted)
    canonical arguments."""
    request = tool.capability_request(canonical)
    checks = _checks(tool)
    if checks is not None and checks.request is not None:
        request = checks.request(canonical, request)
    return request


def tool_call_request(tool_name: str, args):
    """Return (tool spec, canonical args, policy request) for a call, or a 400 naming the field.

    For arguments as recorded (an action's own, already admitted: re-decisions, previews),
    or before ``call_admit``; a caller's arguments are judged through ``tool_call_admitted``.
    Tools exist only in the registry (EXT-1): an unknown name is refused, never passed on.
    """
    tool, canonical = _validated(tool_name, args)
    return tool, canonical, policy_request_of(tool, canonical)


def call_admit(*, tool, canonical: dict, organization, project, user, token) -> dict[str, Any]:
    """The canonical arguments to record for a call by this requester, after the checks
    that read the database (tools with checks only; others are returned unchanged)."""
    checks = _checks(tool)
    if checks is None or checks.admit is None:
        return canonical
    return checks.admit(
        organization=organization, project=project, user=user, token=token, canonical=canonical
    )


def tool_call_admitted(tool_name: str, args, *, project, user, token, judging_only=False):
    """(tool spec, admitted canonical args, policy request) for a caller's call in
    ``project``: validated, admitted (``call_admit``), and the policy request built from the
    admitted arguments, so what is judged is what would be recorded and signed.

    ``judging_only`` (explain, plan steps): admit only tools whose request depends on it
    (``ToolSpec.admitted``); the others' request is the same either way.
    """
    # The pure checks first (an unknown adapter is named before any credential is looked up).
    tool, canonical, request = tool_call_request(tool_name, args)
    checks = _checks(tool)
    if checks is None or checks.admit is None or (judging_only and not tool.admitted):
        return tool, canonical, request
    if tool.admitted and project is None:
        raise ValidationFailed(
            f"{tool.name} is judged for a project: name one.",
            details={"project": ["required for this tool"]},
        )
    canonical = call_admit(
        tool=tool,
        canonical=canonical,
        organization=project.organization,
        project=project,
        user=user,
        token=token,
    )
    return tool, canonical, policy_request_of(tool, canonical)


def call_dispatch_check(tool_name: str, canonical: dict) -> tuple[str, str] | None:
    """``(code, message)`` when a queued call may no longer be signed as it was admitted
    (``ToolChecks.dispatch``), else None."""
    checks = _checks(get_tool(tool_name))
    if checks is None or checks.dispatch is None:
        return None
    return checks.dispatch(canonical)


def unknown_tool_message(tool_name) -> str:
    """Names the tools there are (and the likeliest one meant), so a typo is fixed at once."""
    known = sorted(TOOLS)
    close = get_close_matches(str(tool_name), known, n=1)
    meant = f" (did you mean {close[0]!r}?)" if close else ""
    return (
        f"Unknown tool {str(tool_name)[:100]!r}{meant}; the tools are: {', '.join(known)}. "
        "GET /api/v1/tools describes each one's arguments."
    )


def decide_call(
    policy: Policy, request: Request, args, *, version: str, mode: Mode | None
) -> Decision:
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


def decide_effective(effective: EffectivePolicy, request: Request, canonical) -> Decision:
    """Judge a call under ``effective`` (``decide_call``); a denial that the surface's own
    policy makes says so first, naming the surface and its version, so that a call allowed
    through the API and denied through MCP explains why."""
    decision = decide_call(
        effective.policy, request, canonical, version=effective.version, mode=effective.mode
    )
    if decision.outcome != DENY or effective.surface_version is None:
        return decision
    on_surface = decide_call(
        effective.surface_policy, request, canonical, version=effective.version, mode=None
    )
    if on_surface.outcome != DENY:
        return decision
    term = f"the {effective.surface} surface policy ({effective.surface_version})"
    if effective.surface_policy.grant(request.capability) is None:
        reason = f"{request.capability} is not granted by {term}"
    else:
        reason = f"{term} does not allow this call: " + "; ".join(on_surface.reasons)
    return Decision(DENY, decision.capability, (reason, *decision.reasons), decision.policy_version)


def call_judge(
    *, project, principal, mode: Mode, policy_request: Request, canonical, surface: str = "api"
) -> Judgement:
    """Judge one call in a project for a principal, mode and surface: the one sequence that
    both an action request (``execution.services.action_request``) and ``explain`` run, so
    explain answers exactly what a request would meet."""
    effective = effective_policy(project=project, principal=principal, mode=mode, surface=surface)
    return Judgement(
        effective=effective, decision=decide_effective(effective, policy_request, canonical)
    )
