"""A call runs on its requester's authority, and a person's approval never lends it one that
has ended: a token revoked or expired while its call waits, or a person deactivated, leaves
the call cancelled (``requester_inactive``), neither approved nor signed."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from kestrel_one.accounts.models import ApiToken
from kestrel_one.accounts.principal import Principal, PrincipalKind, system_principal
from kestrel_one.accounts.services import token_revoke
from kestrel_one.audit.models import AuditRecord
from kestrel_one.execution.approvals import approval_decide
from kestrel_one.execution.models import Action, ActionState, Approval
from kestrel_one.execution.services import action_dispatch, action_request

pytestmark = pytest.mark.spec("TEN-1", "POL-2")


def approve_url(world, action) -> str:
    return (
        f"/api/v1/orgs/acme/projects/{world.project.public_id}/threads/"
        f"{action.thread.public_id}/actions/{action.public_id}/approve"
    )


def end_authority(how: str, token: ApiToken) -> None:
    """End ``token``'s authority the way ``how`` says."""
    if how == "revoked":
        token_revoke(actor=system_principal("tests"), token=token)
    elif how == "expired":
        ApiToken.objects.filter(pk=token.pk).update(expires_at=timezone.now() - timedelta(1))
    else:  # the person whose token it is was deactivated
        type(token.user).objects.filter(pk=token.user_id).update(is_active=False)


def test_a_revoked_tokens_waiting_call_is_cancelled_not_approved(world):
    waiting = world.action  # shell.exec awaiting approval, requested by an integration token
    token_revoke(actor=system_principal("tests"), token=world.agent.token)

    refused = world["owner"].client().post(approve_url(world, waiting), {}, format="json")

    assert refused.status_code == 409, refused.content
    error = refused.json()["error"]
    assert error["code"] == "requester_inactive"
    assert "no longer act" in error["message"]
    waiting.refresh_from_db()
    assert waiting.state == ActionState.CANCELLED
    assert waiting.error["code"] == "requester_inactive"
    assert waiting.sealed_args == ""
    assert not Approval.objects.filter(action=waiting).exists()
    ended = AuditRecord.objects.get(action="action.end", target_id=waiting.public_id)
    assert ended.outcome == ActionState.CANCELLED
    assert ended.actor_id == world["owner"].token.public_id


def test_a_waiting_call_may_still_be_denied_once_its_token_is_revoked(world):
    waiting = world.action
    token_revoke(actor=system_principal("tests"), token=world.agent.token)
    owner = Principal(PrincipalKind.TOKEN, user=world["owner"].user, token=world["owner"].token)

    approval_decide(actor=owner, action=waiting, approve=False, reason="the agent is gone")

    waiting.refresh_from_db()
    assert waiting.state == ActionState.DENIED
    assert Approval.objects.get(action=waiting).decision == "denied"


@pytest.mark.parametrize("how", ["revoked", "expired", "deactivated"])
def test_an_approved_call_is_not_signed_once_its_requester_can_no_longer_act(world, how):
    member = world["member"]
    requester = Principal(PrincipalKind.TOKEN, user=member.user, token=member.token)
    action = action_request(
        actor=requester, thread=world.thread, tool="shell.exec", args={"argv": ["make"]}
    )
    assert action.state == ActionState.AWAITING_APPROVAL
    owner = Principal(PrincipalKind.TOKEN, user=world["owner"].user, token=world["owner"].token)
    # Approved while the requester could act; the dispatch queued on commit has not run yet.
    approval_decide(actor=owner, action=action, approve=True)
    action.refresh_from_db()
    assert action.state == ActionState.QUEUED and action.dispatched_at is None

    end_authority(how, member.token)

    assert action_dispatch(action_id=action.pk) is False
    action = Action.objects.get(pk=action.pk)
    assert action.state == ActionState.CANCELLED
    assert action.error["code"] == "requester_inactive"
    assert action.command_digest == "" and action.attempt == 0
    assert action.sealed_args == ""


@pytest.mark.parametrize("how", ["demoted to viewer", "no longer shown the project"])
def test_a_waiting_call_is_cancelled_once_its_person_may_no_longer_request_it(world, how):
    """Losing the authority to request a call is losing it as surely as a revoked token: a
    member demoted to viewer (no projects:write) or no longer shown the project is denied any
    new call there, and an approval does not let one already waiting run on their behalf."""
    member = world["member"]
    requester = Principal(PrincipalKind.TOKEN, user=member.user, token=member.token)
    waiting = action_request(
        actor=requester, thread=world.thread, tool="shell.exec", args={"argv": ["make"]}
    )
    assert waiting.state == ActionState.AWAITING_APPROVAL
    if how == "demoted to viewer":
        type(member.membership).objects.filter(pk=member.membership.pk).update(role="viewer")
    else:
        type(member.membership).objects.filter(pk=member.membership.pk).update(all_projects=False)

    refused = world["owner"].client().post(approve_url(world, waiting), {}, format="json")

    assert refused.status_code == 409, refused.content
    assert refused.json()["error"]["code"] == "requester_inactive"
    waiting.refresh_from_db()
    assert waiting.state == ActionState.CANCELLED
    assert not Approval.objects.filter(action=waiting).exists()


def test_an_approved_call_is_not_signed_once_its_person_is_demoted(world):
    member = world["member"]
    requester = Principal(PrincipalKind.TOKEN, user=member.user, token=member.token)
    action = action_request(
        actor=requester, thread=world.thread, tool="shell.exec", args={"argv": ["make"]}
    )
    owner = Principal(PrincipalKind.TOKEN, user=world["owner"].user, token=world["owner"].token)
    approval_decide(actor=owner, action=action, approve=True)
    type(member.membership).objects.filter(pk=member.membership.pk).update(role="viewer")

    assert action_dispatch(action_id=action.pk) is False
    action = Action.objects.get(pk=action.pk)
    assert action.state == ActionState.CANCELLED
    assert action.error["code"] == "requester_inactive"
    assert action.command_digest == ""
