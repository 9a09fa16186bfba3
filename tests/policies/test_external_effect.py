"""An external-effect adapter operation is never allowed outright: a grant that says
``approval: never`` still needs a person for it, and a denial stays a denial (CRED-5)."""

from __future__ import annotations

import pytest

from policies import ALLOW, DENY, NEEDS_APPROVAL, Request, decide, parse_policy

pytestmark = pytest.mark.spec("CRED-5")

POLICY = parse_policy(
    {
        "capabilities": {
            "adapter.invoke": {
                "approval": "never",
                "adapters": {"github": {"operations": ["issue_comment.create", "issues.list"]}},
            }
        }
    }
)


def request(operation: str, *, external: bool) -> Request:
    return Request(
        capability="adapter.invoke",
        adapter="github",
        operation=operation,
        external_effect=external,
    )


def test_an_external_operation_needs_approval_even_under_approval_never():
    decision = decide(POLICY, request("issue_comment.create", external=True), version="v1")
    assert decision.outcome == NEEDS_APPROVAL
    assert any("external effect" in reason for reason in decision.reasons)


def test_a_read_operation_under_approval_never_is_allowed():
    assert decide(POLICY, request("issues.list", external=False), version="v1").outcome == ALLOW


def test_an_external_operation_the_policy_does_not_name_stays_denied():
    decision = decide(POLICY, request("repos.delete", external=True), version="v1")
    assert decision.outcome == DENY
