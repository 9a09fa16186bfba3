"""Judging one request against an effective policy.

``decide`` fails closed: an unknown capability, a capability the policy lacks, a malformed
path or URL, a missing argument or a resource request above its ceiling all deny. Every
outcome carries reasons a person can read and the policy version that produced it, which is
what ``explain`` shows (SPEC POL-6). The Decision is itself the explanation;
``render_decision`` turns it into text.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from policies.capabilities import APPROVAL_ALWAYS, GRANT_KINDS, Grant
from policies.limits import LIMIT_NAMES, canonical_number
from policies.modes import Mode, mode_denial_reason
from policies.policy import Policy
from policies.request import Request

ALLOW = "allow"
DENY = "deny"
NEEDS_APPROVAL = "needs_approval"
# From most to least permissive; monotonicity of decide is stated in this order.
OUTCOMES = (ALLOW, NEEDS_APPROVAL, DENY)
_NO_LIMITS: Mapping[str, int | float] = MappingProxyType({})


@dataclass(frozen=True)
class Decision:
    """The verdict on one request, why, under which policy version, within which limits."""

    outcome: str
    capability: str
    reasons: tuple[str, ...]
    policy_version: str
    # The ceilings the runner must enforce: each requested value, or the policy's ceiling
    # where the request names none. Empty for capabilities without resource limits and for
    # denials.
    limits: Mapping[str, int | float] = field(default_factory=lambda: _NO_LIMITS)

    @property
    def allowed(self) -> bool:
        return self.outcome == ALLOW

    def to_dict(self) -> dict[str, object]:
        """A JSON-able form, e.g. for an explain response or an audit record."""
        return {
            "outcome": self.outcome,
            "capability": self.capability,
            "reasons": list(self.reasons),
            "policy_version": self.policy_version,
            "limits": dict(self.limits),
        }


def decide(
    effective: Policy, request: Request, *, version: str, mode: Mode | None = None
) -> Decision:
    """Judge ``request`` against the ``effective`` policy, recorded as ``version``.

    ``mode`` is the mode whose mask ``effective`` already includes; it changes no outcome,
    only the reason a capability is missing: one that the mode removed says so.
    """
    capability = request.capability
    if capability not in GRANT_KINDS:
        reason = f"unknown capability '{capability}'; unknown capabilities are always denied"
        return Decision(DENY, capability, (reason,), version)
    grant = effective.grant(capability)
    if grant is None:
        reason = (mode is not None and mode_denial_reason(mode, capability)) or (
            f"{capability} is not granted by the effective policy"
        )
        return Decision(DENY, capability, (reason,), version)
    denials, grounds = grant.judge(capability, request)
    limit_denials, limits = _judge_limits(grant, capability, request.limits)
    denials += limit_denials
    if denials:
        return Decision(DENY, capability, tuple(denials), version)
    grounds.insert(0, f"{capability} is granted by the effective policy")
    if grant.approval == APPROVAL_ALWAYS:
        grounds.append(f"{capability} requires a person's approval for every use")
        return Decision(NEEDS_APPROVAL, capability, tuple(grounds), version, limits)
    if request.external_effect:
        grounds.append(
            f"'{request.adapter}.{request.operation}' has an external effect, which always "
            "requires a person's approval of the exact action"
        )
        return Decision(NEEDS_APPROVAL, capability, tuple(grounds), version, limits)
    return Decision(ALLOW, capability, tuple(grounds), version, limits)


def _judge_limits(
    grant: Grant, capability: str, requested: Mapping[str, float]
) -> tuple[list[str], Mapping[str, int | float]]:
    """Denials for requested amounts, and the limits the runner must enforce."""
    ceilings = grant.limits
    if ceilings is None:
        if requested:
            return [
                f"{capability} takes no resource limits, but the request sets {sorted(requested)}"
            ], _NO_LIMITS
        return [], _NO_LIMITS
    effective = ceilings.as_dict()
    denials = []
    for name, value in requested.items():
        if name not in LIMIT_NAMES:
            denials.append(f"unknown limit '{name}'; known limits are {list(LIMIT_NAMES)}")
        elif (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or (isinstance(value, float) and not math.isfinite(value))
            or value <= 0
        ):
            denials.append(f"requested {name} {value!r} is not a positive number")
        elif value > effective[name]:
            denials.append(
                f"requested {name} {canonical_number(value)} exceeds the ceiling {effective[name]}"
            )
        else:
            effective[name] = canonical_number(value)
    return denials, MappingProxyType(effective)


def render_decision(decision: Decision) -> str:
    """A short text explanation of a decision, for people and logs."""
    lines = [f"{decision.outcome}: {decision.capability} (policy {decision.policy_version})"]
    lines += [f"  - {reason}" for reason in decision.reasons]
    if decision.limits:
        limits = ", ".join(f"{name}={value}" for name, value in decision.limits.items())
        lines.append(f"  limits: {limits}")
    return "\n".join(lines)
