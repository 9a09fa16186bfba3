"""The approval window is judged on the action as it is locked for the decision: a caller's
earlier read of it, made while the window was still open, never carries an approval past it."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.conf import settings
from django.utils import timezone

from kestrel_one.accounts.principal import Principal, PrincipalKind
from kestrel_one.common.errors import Conflict, PermissionDenied
from kestrel_one.execution.approvals import approval_decide
from kestrel_one.execution.models import Action, ActionState, Approval

pytestmark = pytest.mark.spec("POL-4")


@pytest.mark.parametrize("approve", [True, False])
def test_a_decision_read_before_the_window_closed_is_refused_after_it(world, approve):
    # The caller (a view, a console page) read the action while it could still be decided...
    read = Action.objects.get(pk=world.action.pk)
    assert read.state == ActionState.AWAITING_APPROVAL
    # ...and by the time its decision takes the row, the window has closed.
    closed = timezone.now() - timedelta(seconds=settings.KESTREL_APPROVAL_TTL_SECONDS + 5)
    Action.objects.filter(pk=read.pk).update(created_at=closed)
    owner = Principal(PrincipalKind.TOKEN, user=world["owner"].user, token=world["owner"].token)

    with pytest.raises(Conflict) as refused:
        approval_decide(actor=owner, action=read, approve=approve)

    assert "expired" in refused.value.message
    stored = Action.objects.get(pk=read.pk)
    assert stored.state == ActionState.EXPIRED
    assert stored.error["code"] == "approval_expired"
    assert not Approval.objects.filter(action=stored).exists()


def test_a_non_person_cannot_end_an_action_by_trying_to_decide_it(world):
    """Only a person's decision reaches the action: a token that may not decide is refused
    before anything about the action is recorded (the sweep expires it in its own time)."""
    Action.objects.filter(pk=world.action.pk).update(
        created_at=timezone.now() - timedelta(seconds=settings.KESTREL_APPROVAL_TTL_SECONDS + 5)
    )
    agent = Principal(PrincipalKind.TOKEN, token=world.agent.token)

    with pytest.raises(PermissionDenied):
        approval_decide(actor=agent, action=Action.objects.get(pk=world.action.pk), approve=True)

    assert Action.objects.get(pk=world.action.pk).state == ActionState.AWAITING_APPROVAL
