"""Idempotent action requests: with an Idempotency-Key seen before, the first response.

The key is per organization and actor. Its row is written in the same transaction as the
action it made, so a request that rolls back leaves no key behind, and a concurrent request
with the same key waits on the unique index and then replays the winner's response.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from http import HTTPStatus

from django.db import IntegrityError, transaction
from rest_framework.utils.encoders import JSONEncoder

from kestrel_one.common.errors import Conflict
from kestrel_one.execution.models import Action, IdempotencyKey
from kestrel_one.execution.services import action_request
from runners.contract.canonical import digest


@transaction.atomic
def action_request_once(
    *,
    actor,
    thread,
    key: str | None,
    raw_body,
    tool: str,
    args,
    plan_step: dict | None,
    render: Callable[[Action], dict] | None,
    surface: str = "api",
) -> tuple[int, dict | None, Action | None]:
    """Request the action, or with a key seen before, replay the first response: the status,
    the body and the action (None if the replayed request made none). A key reused with a
    different body is a 409.

    ``render`` gives the response body of a new action; None (a caller that waits, with no
    key to keep the body for) leaves the body to the caller, after its wait.
    """
    record = None
    if key is not None:
        request_digest = digest({"thread": thread.public_id, "body": raw_body})
        try:
            with transaction.atomic():
                record = IdempotencyKey.objects.create(
                    organization=thread.organization,
                    actor_id=actor.actor_id,
                    key=key,
                    request_digest=request_digest,
                )
        except IntegrityError:
            # A concurrent or earlier request with this key committed first: its response
            # is the answer, or a 409 when the body differs.
            first = IdempotencyKey.objects.get(
                organization=thread.organization, actor_id=actor.actor_id, key=key
            )
            if first.request_digest != request_digest:
                raise Conflict(
                    "This Idempotency-Key was already used with a different request.",
                    details={"Idempotency-Key": ["reused with another body"]},
                ) from None
            return first.response_status, first.response_body, first.action
    action = action_request(
        actor=actor, thread=thread, tool=tool, args=args, plan_step=plan_step, surface=surface
    )
    if record is None and render is None:
        return HTTPStatus.CREATED, None, action
    body = render(action)
    if record is not None:
        IdempotencyKey.objects.filter(pk=record.pk).update(
            action=action,
            response_status=HTTPStatus.CREATED,
            response_body=json.loads(json.dumps(body, cls=JSONEncoder)),
        )
    return HTTPStatus.CREATED, body, action
