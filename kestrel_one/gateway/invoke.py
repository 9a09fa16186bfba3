"""The ``model.invoke`` tool: a control-tier call of a model through the gateway.

``{"provider", "model", "messages", "max_tokens"?, "temperature"?, "credential"?}``. The
policy judges ``model.invoke`` for ``provider/model`` (docs/gateway.md) when the action is
requested; the organization's credential for the provider is made explicit in the recorded
arguments then (so the action digest binds it). The worker on the ``adapters`` queue takes
the queued action, appends the prompt to the thread's events, makes the call
(``calls.model_call``: reserve, release, send, settle), appends the completion, and
records the end through ``control_call_finish``: the receipt's evidence and the audit keep
sizes, hashes and token counts only. Thread events are trimmed by the organization's
retention like every other event.
"""

from __future__ import annotations

import json
from typing import Any

import structlog
from django.conf import settings
from django.db import transaction

from kestrel_one.accounts.principal import Principal, PrincipalKind, system_principal
from kestrel_one.common.errors import ValidationFailed
from kestrel_one.common.redaction import redact_text
from kestrel_one.execution.arguments import action_arguments
from kestrel_one.execution.services import (
    control_call_arguments_intact,
    control_call_claim,
    control_call_finish,
)
from kestrel_one.gateway.api import model_request_check
from kestrel_one.gateway.calls import Caller, GatewayError, model_call, model_credential_reference
from kestrel_one.gateway.models import ModelUsage
from kestrel_one.gateway.providers import ModelRequest, UnknownModel, split_model_name
from kestrel_one.threads.services import event_append
from policies import Request

logger = structlog.get_logger(__name__)

TOOL = "model.invoke"
# A thread event keeps at most this much of one message's text, in bytes of its JSON form; a
# longer text is cut into parts of this size, each its own event (events are bounded:
# threads.services).
EVENT_TEXT_BYTES = 3000


def model_request_of(canonical: dict[str, Any]) -> ModelRequest:
    """The gateway request a ``model.invoke`` call's (schema-checked) arguments ask for."""
    try:
        provider, model = split_model_name(f"{canonical['provider']}/{canonical['model']}")
    except UnknownModel as error:
        raise ValidationFailed(
            f"args.model: {error}", details={"args.model": [str(error)]}
        ) from None
    request = ModelRequest(
        provider=provider,
        model=model,
        messages=tuple({"role": m["role"], "content": m["content"]} for m in canonical["messages"]),
        max_tokens=canonical.get("max_tokens") or settings.KESTREL_GATEWAY_DEFAULT_MAX_TOKENS,
        temperature=canonical.get("temperature"),
    )
    model_request_check(request, prefix="args.")
    return request


def model_call_request(canonical: dict, request: Request) -> Request:
    """Request-time checks that need no database: the provider's operation accepts these
    arguments; the policy then judges ``provider/model``."""
    model = model_request_of(canonical)
    return Request(capability="model.invoke", model=model.policy_name, limits=request.limits)


def model_call_admit(*, organization, project=None, user, token, canonical: dict) -> dict:
    """The credential this call will use, checked for this requester, made explicit."""
    model = model_request_of(canonical)
    reference = model_credential_reference(
        organization=organization,
        request=model,
        named=canonical.get("credential"),
        caller=Caller(actor=None, user=user, token=token),
    )
    return {**canonical, "credential": reference["credential"]}


def text_parts(text: str, max_bytes: int = EVENT_TEXT_BYTES) -> list[str]:
    """``text`` redacted whole, then cut into parts whose JSON form (as an event stores it,
    non-ASCII characters escaped) is at most ``max_bytes``, never inside a character.

    Redacted before the cut: a secret across a cut would be two halves that no pattern
    recognises, each event being redacted on its own. Measured as JSON: a part of 3000
    UTF-8 bytes of accented text is 9000 bytes as an event, which the event bound cut."""
    clean = redact_text(text)
    parts, start, size = [], 0, 0
    for index, char in enumerate(clean):
        cost = 1 if " " <= char <= "~" and char not in '"\\' else len(json.dumps(char)) - 2
        if size + cost > max_bytes:
            parts.append(clean[start:index])
            start, size = index, 0
        size += cost
    parts.append(clean[start:])
    return parts


def _text_events(thread, action, kind: str, role: str, text: str, index: int) -> None:
    parts = text_parts(text)
    for number, part in enumerate(parts, start=1):
        event_append(
            thread=thread,
            kind=kind,
            action=action,
            data={
                "action": action.public_id,
                "message": index,
                "role": role,
                "part": number,
                "parts": len(parts),
                "content": part,
            },
        )


@transaction.atomic
def _prompt_record(action, request: ModelRequest) -> None:
    for index, message in enumerate(request.messages):
        _text_events(
            action.thread, action, "model.prompt", message["role"], message["content"], index
        )


def model_invoke_run(*, action_id: str) -> str:
    """Run the queued ``model.invoke`` action ``action_id``; what happened."""
    action = control_call_claim(action_id=action_id, tool=TOOL)
    if action is None:
        # Not queued: ended meanwhile, or taken by a worker that died (its reservation
        # expires and is charged; the sweep ends the action). Nothing is sent twice.
        return "not-queued"
    args = action_arguments(action)
    if not control_call_arguments_intact(action, args):
        # Not the arguments that were decided and approved (another model, credential or
        # prompt): nothing is released, reserved or sent.
        return control_call_finish(
            action=action,
            outcome="failed",
            result=None,
            error={
                "code": "arguments_changed",
                "message": "This call's arguments are not the ones that were decided and "
                "approved (the action digest binds them), so nothing was sent; request it "
                "again.",
            },
            evidence={"model": None, "usage_record": None},
        )
    request = model_request_of(args)
    _prompt_record(action, request)
    caller = Caller(
        actor=_requester(action), user=action.requested_by_user, token=action.requested_by_token
    )
    try:
        exchange = model_call(
            project=action.project,
            request=request,
            caller=caller,
            surface="tool",
            policy_version=action.policy_version,
            credential=args.get("credential"),
            action=action,
        )
    except GatewayError as error:
        usage = _usage_of(action)
        return control_call_finish(
            action=action,
            outcome="failed",
            result=None,
            error={"code": error.code, "message": error.message, "details": error.details},
            evidence=_evidence(usage, request),
        )
    except Exception:
        # The reservation is settled (calls.model_call); the action ends now rather than
        # when the sweep finds it silent. The exception itself may carry what was sent.
        logger.exception("model call failed", action=action.public_id)
        return control_call_finish(
            action=action,
            outcome="failed",
            result=None,
            error={"code": "internal", "message": "The model call failed on our side."},
            evidence=_evidence(_usage_of(action), request),
        )
    usage = exchange.usage
    with transaction.atomic():
        _text_events(action.thread, action, "model.completion", "assistant", exchange.text, 0)
        return control_call_finish(
            action=action,
            outcome="succeeded",
            result={
                "model": request.policy_name,
                "content": exchange.text,
                # Not "*_tokens": recorded results are redacted, and such keys are masked.
                "usage": {
                    "input": usage.input_tokens,
                    "output": usage.output_tokens,
                    "charged": usage.charged_tokens,
                },
                "usage_record": usage.public_id,
            },
            error=None,
            evidence=_evidence(usage, request),
        )


def _requester(action):
    """Whom the audit names for the call: the action's requester."""
    if action.requested_by_token is not None:
        return Principal(
            PrincipalKind.TOKEN, user=action.requested_by_user, token=action.requested_by_token
        )
    if action.requested_by_user is not None:
        return Principal(PrincipalKind.SESSION, user=action.requested_by_user)
    return system_principal(action.requested_by or "control-tier")


def _usage_of(action):
    return ModelUsage.objects.filter(action=action).order_by("-id").first()


def _evidence(usage, request: ModelRequest) -> dict:
    """The receipt's evidence: sizes, hashes and tokens; never a message or a completion."""
    if usage is None:
        return {"model": request.policy_name, "usage_record": None}
    return {
        "model": request.policy_name,
        "usage_record": usage.public_id,
        "credential": usage.credential,
        "upstream_status": usage.upstream_status,
        "request_bytes": usage.request_bytes,
        "request_sha256": usage.request_sha256,
        "response_bytes": usage.response_bytes,
        "response_sha256": usage.response_sha256,
        "usage": {
            "input": usage.input_tokens,
            "output": usage.output_tokens,
            "charged": usage.charged_tokens,
        },
    }
