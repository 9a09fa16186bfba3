"""Modes: how much of the policy a turn may use.

Ask and Plan are read-only: they keep fs.read, net.http and model.invoke and drop every
capability that changes something or runs code. Agent keeps the policy as it is. Auto picks
Ask or Plan for each request and inherits that mode's read-only mask; it never becomes Agent,
because a plan only becomes executable when a person accepts it (SPEC POL-4).
"""

from __future__ import annotations

from enum import StrEnum

from policies.capabilities import CAPABILITY_NAMES
from policies.policy import Policy, meet

READ_AND_NETWORK_CAPABILITIES = frozenset({"fs.read", "net.http", "model.invoke"})


class Mode(StrEnum):
    ASK = "ask"
    PLAN = "plan"
    AGENT = "agent"
    AUTO = "auto"


def resolve_mode(mode: Mode, *, wants_plan: bool) -> Mode:
    """The concrete mode a request runs in.

    Auto becomes Plan when the request asks for a reviewable proposal (``wants_plan``) and
    Ask otherwise; every other mode is already concrete and is returned unchanged.
    """
    if mode is Mode.AUTO:
        return Mode.PLAN if wants_plan else Mode.ASK
    return mode


def mode_mask(mode: Mode) -> Policy:
    """The mask a mode applies. Auto gets the read-only mask even before it is resolved,
    since both modes it can resolve to share it."""
    if mode is Mode.AGENT:
        return Policy.allowing(CAPABILITY_NAMES)
    return Policy.allowing(READ_AND_NETWORK_CAPABILITIES)


def apply_mode(policy: Policy, mode: Mode) -> Policy:
    """``policy`` as a turn in ``mode`` may use it."""
    return meet(policy, mode_mask(mode))


# What a person can do about a capability a read-only mode removed, per mode.
_WAY_OUT = {
    Mode.ASK: "use a thread in agent mode to run it",
    Mode.PLAN: (
        "propose it as a plan step (POST .../plans) for a person to accept, "
        "or use a thread in agent mode"
    ),
    Mode.AUTO: (
        "auto resolves to ask or plan; propose it as a plan step for a person to accept, "
        "or use a thread in agent mode"
    ),
}


def mode_denial_reason(mode: Mode, capability: str) -> str | None:
    """Why ``mode`` alone removes ``capability``, or None when the mode keeps it.

    A denial's reason should name what took the capability away: in a read-only mode it is
    the mode, whatever the policy grants, so saying only "not granted by the policy" would
    send a person to edit a policy that is not the cause.
    """
    if mode is Mode.AGENT or capability in READ_AND_NETWORK_CAPABILITIES:
        return None
    reads = ", ".join(sorted(READ_AND_NETWORK_CAPABILITIES))
    return (
        f"{capability} is not available in {mode} mode: {mode} mode allows reads only "
        f"({reads}); {_WAY_OUT[mode]}"
    )
