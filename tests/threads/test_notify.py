"""Long polls wake on committed changes, and only on committed ones."""

from __future__ import annotations

import pytest
from django.db import transaction

from kestrel_one.execution.api import settle
from kestrel_one.execution.models import Action, ActionState
from kestrel_one.threads.notify import action_changed, action_watch
from kestrel_one.threads.services import event_append

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_committed_change_wakes_the_watcher(world):
    with action_watch(world.action.public_id) as wait:
        with transaction.atomic():
            action_changed(world.action.public_id)
        assert wait(30) is True


def test_a_rolled_back_change_sends_nothing(world):
    with action_watch(world.action.public_id) as wait:
        with transaction.atomic():
            action_changed(world.action.public_id)
            transaction.set_rollback(True)
        assert wait(0.5) is False


def test_an_action_event_notifies_and_settle_returns_the_settled_state(world):
    action = world.finished_action
    Action.objects.filter(pk=action.pk).update(state=ActionState.RUNNING)
    action.refresh_from_db()
    with action_watch(action.public_id) as wait:
        with transaction.atomic():
            Action.objects.filter(pk=action.pk).update(state=ActionState.SUCCEEDED)
            event_append(thread=action.thread, kind="action.finished", action=action, data={})
        assert wait(30) is True
    assert settle(action, 30).state == ActionState.SUCCEEDED
