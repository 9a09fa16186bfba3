"""The control tier's side of ``adapter.invoke``: one governed call of one adapter operation.

The worker on the ``adapters`` queue takes the queued action (``control_call_claim``), takes
its idempotency key (``AdapterInvocation``) before any request, has the credential released
for this one invocation, builds the operation's exact request from the registry, adds the
credential in the adapter's presentation header, sends it through the one egress client, and
records the answer (``control_call_finish``): the status and the bounded, parsed body; a
receipt with the request's hash and the response's status, hash and size. The credential is
never logged, stored or returned: every recorded byte is masked of it, in plain, base64,
hex and URL-encoded form, before anything is written.
"""

from __future__ import annotations

import hashlib
import logging
import time
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from kestrel_one.adapters.checks import credential_reference, invocation_digest
from kestrel_one.adapters.echoes import mask_forms, secret_forms
from kestrel_one.adapters.models import AdapterInvocation
from kestrel_one.adapters.registry import Adapter, Effect, Operation, get_operation, prepare_request
from kestrel_one.common.egress import EgressFailed, EgressRefused, egress_request
from kestrel_one.common.jsontext import json_loads
from kestrel_one.common.redaction import bounded, redact_result
from kestrel_one.credentials.release import CredentialRefused, secret_release
from kestrel_one.execution.arguments import action_arguments
from kestrel_one.execution.models import Action, ActionState
from kestrel_one.execution.services import (
    control_call_arguments_intact,
    control_call_claim,
    control_call_finish,
)
from runners.contract.canonical import digest

logger = logging.getLogger(__name__)

TOOL = "adapter.invoke"
# The body kept in the result (and receipt) is bounded to this, marked where it was cut; the
# upstream answer itself is bounded by the operation's ``response_max_bytes`` (more fails).
RESULT_BODY_MAX_BYTES = 64 * 1024
# How long a call waits for another call holding the same idempotency key to answer, beyond
# the operation's timeout, before it reports the outcome unknown.
IDEMPOTENCY_WAIT_GRACE_SECONDS = 10
# Egress failures that mean nothing reached the provider: the key is released, so a retry
# with it may send.
NOTHING_SENT = frozenset({"destination_refused", "connect_failed", "tls_failed"})


def adapter_invoke_run(*, action_id: str) -> str:
    """Run the queued ``adapter.invoke`` action ``action_id``; returns what happened."""
    action = control_call_claim(action_id=action_id, tool=TOOL)
    redelivered = False
    if action is None:
        # A delivery of a call already taken: its worker died (the broker handed the task
        # back). What it did is decided by the idempotency record below.
        action = (
            Action.objects.select_related("organization", "environment", "project", "thread")
            .filter(public_id=action_id, tool=TOOL, state=ActionState.RUNNING)
            .first()
        )
        if action is None:
            return "not-queued"
        redelivered = True
    held: list[AdapterInvocation] = []
    try:
        return _run(action, redelivered, held)
    except Exception:
        # A fault of ours (never an upstream answer: those are recorded). Logged without any
        # argument or header; the call ends failed, and a key it held answers every later
        # call with this error: the request may have been sent, so it is never sent again.
        logger.exception("adapter call %s failed in the control tier", action.public_id)
        return _finish(
            action, held[0] if held else None, "failed", None, _error("adapter_error"), {}
        )


def _run(action, redelivered: bool, held: list) -> str:
    args = action_arguments(action)
    if not control_call_arguments_intact(action, args):
        # The arguments are not the ones decided and approved (the digest binds them): the
        # call is refused, nothing is sent.
        return _finish(action, None, "failed", None, _error("arguments_changed"), {})
    adapter, operation = get_operation(args["adapter"], args["operation"])
    key = args.get("idempotency_key")
    invocation = None
    if key is not None:
        invocation, replay = _invocation_take(action, args, operation, redelivered=redelivered)
        if replay is not None:
            return replay
        held.append(invocation)
    elif redelivered and operation.effect == Effect.EXTERNAL:  # unreachable: checks want a key
        return _finish(action, None, "failed", None, _error("outcome_unknown"), {})
    return _invoke(action, args, adapter, operation, invocation)


def _invoke(action, args, adapter: Adapter, operation: Operation, invocation) -> str:
    prepared = prepare_request(adapter.name, operation.name, args["args"])
    evidence: dict[str, Any] = {
        "adapter": adapter.name,
        "operation": operation.name,
        "effect": operation.effect.value,
        "resource": operation.resource(),
        "request_sha256": _request_sha256(prepared),
        "idempotency_key": args.get("idempotency_key"),
        "upstream_requests": 0,
    }
    try:
        released = secret_release(
            organization=action.organization,
            adapter=adapter.name,
            reference=credential_reference(args) or {},
            user=action.requested_by_user,
            token=action.requested_by_token,
        )
    except CredentialRefused as refused:
        # Nothing was sent: the key is free again for a retry once the credential is fixed.
        _invocation_release(invocation)
        return _finish(
            action,
            None,
            "failed",
            None,
            {"code": refused.code, "message": refused.message},
            evidence,
        )
    forms = secret_forms(released.secret, adapter)
    # Not under a "credential" key: redaction masks any value under such a name.
    evidence["released"] = {"record": released.record, "fingerprint": released.fingerprint}
    headers = dict(prepared.headers)
    headers[adapter.presentation.header] = adapter.presentation.header_value(released.secret)
    if operation.idempotency_header and invocation is not None:
        headers[operation.idempotency_header] = _provider_idempotency_key(action, invocation)
    del released
    try:
        answer = egress_request(
            method=prepared.method,
            url=prepared.url,
            headers=headers,
            body=prepared.body,
            timeout_s=operation.timeout_s,
            max_bytes=operation.response_max_bytes,
        )
    except EgressRefused as refused:
        _invocation_release(invocation)
        error = _clean({"code": refused.code, "message": str(refused.message)}, forms)
        return _finish(action, None, "failed", None, error, evidence)
    except EgressFailed as failed:
        error = _clean({"code": failed.code, "message": str(failed.message)}, forms)
        if failed.code in NOTHING_SENT:
            _invocation_release(invocation)
            return _finish(action, None, "failed", None, error, evidence)
        # It may have reached the provider: this is the key's answer, never sent again.
        evidence["upstream_requests"] = 1
        return _finish(action, invocation, "failed", None, error, evidence)
    finally:
        headers.clear()
    evidence["upstream_requests"] = 1
    evidence["response_status"] = answer.status
    evidence["response_sha256"] = hashlib.sha256(answer.body).hexdigest()
    evidence["response_bytes"] = len(answer.body)
    result = _clean({"status": answer.status, "body": _parsed_body(answer)}, forms)
    result["body"] = bounded(result["body"], max_bytes=RESULT_BODY_MAX_BYTES)
    if 200 <= answer.status < 300:
        return _finish(action, invocation, "succeeded", result, None, evidence)
    error = {
        "code": "upstream_error",
        "message": f"{adapter.name} {operation.name} answered HTTP {answer.status}",
        "status": answer.status,
    }
    return _finish(action, invocation, "failed", result, error, evidence)


def _finish(action, invocation, outcome, result, error, evidence) -> str:
    """Record the action's end and, when it holds the key, the key's first answer, in one
    transaction: a later call with the key gets exactly what this action recorded."""
    with transaction.atomic():
        state = control_call_finish(
            action=action, outcome=outcome, result=result, error=error, evidence=evidence
        )
        if invocation is not None:
            AdapterInvocation.objects.filter(
                pk=invocation.pk, state=AdapterInvocation.State.PENDING
            ).update(
                state=AdapterInvocation.State.ANSWERED,
                outcome=outcome,
                evidence=evidence,
                answered_at=timezone.now(),
            )
    return state


def _invocation_take(action, args, operation: Operation, *, redelivered: bool):
    """(the key's row, None) when this action holds the key and makes the request; (row,
    what happened) when the call ended here, answered from the key's first answer, refused
    (other arguments), or unknown (a holder that died mid-request)."""
    request_digest = invocation_digest(args, project=action.project.public_id)
    wait_until = time.monotonic() + operation.timeout_s + IDEMPOTENCY_WAIT_GRACE_SECONDS
    lease = timedelta(
        seconds=operation.timeout_s
        + IDEMPOTENCY_WAIT_GRACE_SECONDS
        + settings.KESTREL_CALL_GRACE_SECONDS
    )
    key = {
        "organization": action.organization,
        "adapter": args["adapter"],
        "operation": args["operation"],
        "idempotency_key": args["idempotency_key"],
    }
    while True:
        try:
            with transaction.atomic():
                invocation = AdapterInvocation.objects.create(
                    **key,
                    request_digest=request_digest,
                    action=action,
                    lease_until=timezone.now() + lease,
                )
            return invocation, None
        except IntegrityError:
            pass
        invocation = AdapterInvocation.objects.filter(**key).first()
        if invocation is None:
            continue  # released meanwhile (nothing was sent): take it
        if invocation.request_digest != request_digest:
            error = {
                "code": "idempotency_key_reused",
                "message": "This idempotency key was already used for a call with other "
                "arguments, another credential or in another project; nothing was sent.",
            }
            return invocation, _finish(action, None, "failed", None, error, {})
        if invocation.state == AdapterInvocation.State.ANSWERED:
            return invocation, _replay(action, invocation)
        if invocation.action_id == action.pk and redelivered:
            if operation.effect == Effect.READ:
                return invocation, None  # a read may be made again
            # Our own earlier delivery took the key and died: the request may have been made.
            return invocation, _finish(
                action, invocation, "failed", None, _error("outcome_unknown"), {}
            )
        if time.monotonic() > wait_until or timezone.now() > invocation.lease_until:
            return invocation, _finish(
                action, None, "failed", None, _error("idempotency_outcome_unknown"), {}
            )
        time.sleep(0.1)


def _replay(action, invocation: AdapterInvocation) -> str:
    """End ``action`` with the key's first answer: no request is made."""
    first = Action.objects.filter(pk=invocation.action_id).values("public_id", "result", "error")
    answer = first.first()
    evidence = {
        **(invocation.evidence or {}),
        "upstream_requests": 0,
        "replayed_from": answer["public_id"] if answer else None,
    }
    if answer is None:
        # Retention removed the first call's record: its outcome and hashes remain.
        return _finish(action, None, "failed", None, _error("idempotency_answer_gone"), evidence)
    result = answer["result"]
    if isinstance(result, dict):
        result = {**result, "replayed": True}
    return _finish(action, None, invocation.outcome or "failed", result, answer["error"], evidence)


def _invocation_release(invocation) -> None:
    if invocation is not None:
        AdapterInvocation.objects.filter(
            pk=invocation.pk, state=AdapterInvocation.State.PENDING
        ).delete()


_ERRORS = {
    "idempotency_answer_gone": "This idempotency key was already used, and its first call's "
    "record is past the organization's retention; nothing was sent. Use a new key.",
    "adapter_error": "The adapter call failed inside the control tier; whether it reached "
    "the provider is unknown. Check the provider, and use a new idempotency key to make it "
    "again.",
    "arguments_changed": "This call's arguments are not the ones that were decided and "
    "approved (the action digest binds them), so nothing was sent; request it again.",
    "outcome_unknown": "The worker making this call stopped after it may have sent the "
    "request, so whether the effect happened is unknown; check the provider, and use a new "
    "idempotency key to make it again.",
    "idempotency_outcome_unknown": "Another call holding this idempotency key did not answer "
    "in time, so whether its effect happened is unknown; check the provider, and use a new "
    "idempotency key to make it again.",
}


def _error(code: str) -> dict:
    return {"code": code, "message": _ERRORS[code]}


def _request_sha256(prepared) -> str:
    """Over the exact request without its credential: method, URL, headers and body."""
    return digest(
        {
            "method": prepared.method,
            "url": prepared.url,
            "headers": dict(sorted(prepared.headers.items())),
            "body_sha256": hashlib.sha256(prepared.body or b"").hexdigest(),
        }
    )


def _provider_idempotency_key(action, invocation) -> str:
    """The provider's own idempotency header value: stable per key, naming nothing of ours."""
    seed = f"{action.organization.public_id}:{invocation.adapter}:{invocation.operation}:"
    return hashlib.sha256((seed + invocation.idempotency_key).encode()).hexdigest()


def _clean(value: Any, forms: list[str]) -> Any:
    """``value`` with every form of the credential masked, then redacted as any result."""
    return redact_result(mask_forms(value, forms), known=forms)


def _parsed_body(answer) -> Any:
    """The body as JSON when it is JSON, else as text (both bounded later)."""
    text = answer.body.decode("utf-8", errors="replace")
    try:
        return json_loads(text)
    except ValueError:
        return text
