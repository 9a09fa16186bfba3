"""Kestrel One's policy engine: pure Python, no Django (an import-linter contract keeps it so).

Typical use on the control-plane side::

    env = parse_policy(environment_document)
    project = parse_policy(project_document)
    problems = widenings(project, env, parent_label="environment")   # [] means it narrows
    effective = meet_all(env, project, surface_mask, mode_mask(mode), token_scope_mask)
    decision = decide(effective, request, version=version_id)

See docs/policy.md for the document format and the exact semantics.
"""

from policies.capabilities import (
    APPROVAL_ALWAYS,
    APPROVAL_NEVER,
    CAPABILITY_NAMES,
    LIMITED_CAPABILITIES,
    Widening,
)
from policies.caps import DEFAULT_DOCUMENT_LIMITS, DocumentLimits
from policies.decide import ALLOW, DENY, NEEDS_APPROVAL, Decision, decide, render_decision
from policies.errors import PolicyError, PolicyIssue, PolicyTooLarge
from policies.limits import DEFAULT_LIMITS, INTEGER_LIMITS, LIMIT_NAMES, MAX_LIMITS
from policies.modes import (
    READ_AND_NETWORK_CAPABILITIES,
    Mode,
    apply_mode,
    mode_denial_reason,
    mode_mask,
    resolve_mode,
)
from policies.parse import parse_policy, parse_policy_json
from policies.policy import Policy, meet, meet_all, widenings
from policies.request import Request

__all__ = [
    "ALLOW",
    "APPROVAL_ALWAYS",
    "APPROVAL_NEVER",
    "CAPABILITY_NAMES",
    "DEFAULT_DOCUMENT_LIMITS",
    "DEFAULT_LIMITS",
    "DENY",
    "INTEGER_LIMITS",
    "LIMITED_CAPABILITIES",
    "LIMIT_NAMES",
    "MAX_LIMITS",
    "NEEDS_APPROVAL",
    "READ_AND_NETWORK_CAPABILITIES",
    "Decision",
    "DocumentLimits",
    "Mode",
    "Policy",
    "PolicyError",
    "PolicyIssue",
    "PolicyTooLarge",
    "Request",
    "Widening",
    "apply_mode",
    "decide",
    "meet",
    "meet_all",
    "mode_denial_reason",
    "mode_mask",
    "parse_policy",
    "parse_policy_json",
    "render_decision",
    "resolve_mode",
    "widenings",
]
