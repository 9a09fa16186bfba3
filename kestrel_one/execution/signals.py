"""Hooks the execution app sends for apps above it (the import layers: a higher app
registers on a hook the lower one sends)."""

from __future__ import annotations

from django.db import transaction
from django.dispatch import Signal

# An action reached a terminal state (succeeded, failed, denied at request or by a person,
# expired, cancelled). Sent after the transaction that moved it commits, once per action,
# with ``action_id`` (the row's pk), ``public_id`` and ``state``; receivers read the row
# again for anything else. The broker beside the sandbox answers a waiting workload from it
# (kestrel_one.sandbox_broker).
action_ended = Signal()


def action_ended_notify(action, state: str) -> None:
    """Call inside the transaction that moved ``action`` to ``state`` (a terminal one): the
    signal goes out when it commits, and never for a transaction that rolls back."""
    action_id, public_id = action.pk, action.public_id

    def send() -> None:
        # A receiver that fails must not undo or hide an ending that already committed.
        action_ended.send_robust(
            sender=type(action), action_id=action_id, public_id=public_id, state=str(state)
        )

    transaction.on_commit(send, robust=True)
