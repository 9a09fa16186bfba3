"""One model call through the gateway, whole or streamed: judged, reserved, sent, settled.

The order is fixed, and every path after the reservation settles it exactly once:

1. the policy judges ``model.invoke`` for ``provider/model`` (the tool path has already
   been judged as an action; the endpoint is judged here, where no person can approve);
2. the credential is released for this one call (the org credential for the provider
   unless the call names one); a refusal here reserves nothing;
3. the call's upper bound of tokens is reserved in the project's budget (or 429);
4. the registry operation's exact request is built, the credential put in its
   presentation header, and the one egress client sends it;
5. the reservation is settled with the provider's reported usage: on success, on an
   upstream error (what it reports, else nothing), on a failure before anything was sent
   (nothing), and when the answer was lost after sending (a timeout, a stream cut short:
   the whole reservation, since the provider may have done the work).

A worker that dies between 3 and 5 leaves the reservation to expire
(``usage_reservations_expire``), charged in full.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import structlog

from kestrel_one.adapters.echoes import EchoMask, mask_bytes, mask_forms, secret_forms
from kestrel_one.adapters.registry import get_adapter, prepare_request
from kestrel_one.common.egress import EgressFailed, EgressRefused, egress_request, egress_stream
from kestrel_one.common.errors import KestrelError
from kestrel_one.common.jsontext import json_loads
from kestrel_one.credentials.release import (
    CredentialRefused,
    credential_default,
    reference_check,
    secret_release,
)
from kestrel_one.gateway.models import ModelUsage
from kestrel_one.gateway.providers import (
    AnthropicStreamToOpenAI,
    ModelRequest,
    StreamReader,
    completion_text,
    operation_limits,
    provider_args,
    usage_of,
)
from kestrel_one.gateway.services import (
    Settlement,
    reservation_tokens,
    usage_reserve,
    usage_settle,
)

logger = structlog.get_logger(__name__)

# Egress failures where nothing reached the provider: nothing is charged.
NOT_SENT = frozenset({"destination_refused", "connect_failed", "tls_failed"})


class GatewayError(KestrelError):
    """A model call refused or failed; ``code`` is stable, the message secret-free."""

    code = "gateway_error"
    status = 502

    def __init__(self, code: str, message: str, *, status: int, details: Any = None):
        super().__init__(message, details=details)
        self.code = code
        self.status = status


@dataclass
class Caller:
    """Who the call is for: the actor recorded, and the user and token a credential
    reference is checked against (an action's requester, or the endpoint's bearer)."""

    actor: Any
    user: Any = None
    token: Any = None


@dataclass
class Exchange:
    """A finished call: its usage record, the provider's status and parsed answer (the
    endpoint sends ``raw`` on as it came), and the completion's text (for thread events)."""

    usage: ModelUsage
    status: int
    body: Any
    raw: bytes
    text: str
    # With ``settle_after``: settles the reservation (call it once the answer is sent).
    settle: Any = None


def model_credential_reference(*, organization, request: ModelRequest, named: str | None, caller):
    """The credential a model call uses (the one named, else the organization's one for the
    provider), checked for this caller: ``{"credential": "crd_..."}``, or a GatewayError."""
    try:
        credential = named or credential_default(organization=organization, adapter=request.adapter)
        if credential is None:
            raise _credential_missing(request)
        reference = {"credential": credential}
        reference_check(
            organization=organization,
            adapter=request.adapter,
            reference=reference,
            user=caller.user,
            token=caller.token,
        )
    except CredentialRefused as refused:
        raise GatewayError(refused.code, refused.message, status=403) from None
    return reference


def _credential_missing(request: ModelRequest) -> GatewayError:
    return GatewayError(
        "credential_missing",
        f"This organization has no active {request.provider} credential; an admin adds one "
        f"(adapter '{request.adapter}') under Credentials.",
        status=409,
    )


def _release(*, organization, request: ModelRequest, reference: dict, caller):
    try:
        return secret_release(
            organization=organization,
            adapter=request.adapter,
            reference=reference,
            user=caller.user,
            token=caller.token,
        )
    except CredentialRefused as refused:
        raise GatewayError(refused.code, refused.message, status=403) from None


def _prepared(request: ModelRequest, secret: str):
    """The operation's exact request with the credential presented as the adapter says, and
    the credential's forms to mask in whatever the provider answers (``adapters.echoes``)."""
    prepared = prepare_request(request.adapter, request.operation, provider_args(request))
    adapter = get_adapter(request.adapter)
    headers = dict(prepared.headers)
    headers[adapter.presentation.header] = adapter.presentation.header_value(secret)
    return prepared, headers, secret_forms(secret, adapter)


def _upstream_error(status: int, body: Any) -> GatewayError:
    """The provider's refusal, carrying only its status and its short error type and code
    (never its message or body, which may echo a credential)."""
    error = body.get("error") if isinstance(body, dict) else None
    kind = error.get("type") if isinstance(error, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    details = {
        "upstream_status": status,
        "upstream_type": kind[:64] if isinstance(kind, str) else None,
        "upstream_code": code[:64] if isinstance(code, str) else None,
    }
    # A provider's 4xx (429 included) is the caller's to see and act on; its 5xx is ours.
    return GatewayError(
        "upstream_error",
        f"The model provider refused the request with HTTP {status}.",
        status=status if 400 <= status < 500 else 502,
        details=details,
    )


def _egress_failure(code: str) -> GatewayError:
    if code == "timeout":
        return GatewayError(
            "upstream_timeout", "The model provider did not answer in time.", status=504
        )
    return GatewayError(
        "upstream_unreachable",
        f"The model provider could not be reached ({code}).",
        status=502,
        details={"egress": code},
    )


def _parse(raw: bytes) -> Any:
    try:
        return json_loads(raw)
    except ValueError:
        return None


def _masked_answer(answer: bytes, forms: list[str]) -> tuple[bytes, Any]:
    """A whole answer without the credential: its bytes and its parsed JSON (or None).
    The bytes are masked as they came, and the parsed strings again, since JSON may spell
    the credential with escapes (``\\u0073k-...``) that only parsing reveals; the bytes are
    then the masked JSON."""
    raw = mask_bytes(answer, forms)
    body = _parse(raw)
    if body is None:
        return raw, None
    masked = mask_forms(body, forms)
    if masked != body:
        return json.dumps(masked, separators=(",", ":")).encode(), masked
    return raw, body


@dataclass
class _Call:
    """The state of one call between its reservation and its settlement."""

    request: ModelRequest
    usage: ModelUsage
    caller: Caller
    request_body: bytes = b""
    credential: str = ""
    started: float = field(default_factory=time.monotonic)
    digest: Any = field(default_factory=hashlib.sha256)
    response_bytes: int = 0

    def settle(self, outcome: str, **fields) -> ModelUsage:
        settlement = Settlement(
            outcome=outcome,
            credential=self.credential,
            request_bytes=len(self.request_body),
            request_sha256=hashlib.sha256(self.request_body).hexdigest()
            if self.request_body
            else "",
            response_bytes=self.response_bytes,
            response_sha256=self.digest.hexdigest() if self.response_bytes else "",
            duration_ms=int((time.monotonic() - self.started) * 1000),
            **fields,
        )
        settled = usage_settle(usage=self.usage, settlement=settlement, actor=self.caller.actor)
        return settled if settled is not None else self.usage


def _begin(
    *,
    project,
    request: ModelRequest,
    caller: Caller,
    surface: str,
    policy_version: str,
    credential,
    action,
) -> tuple[_Call, Any]:
    """Release the credential for this one call (refused: nothing reserved), then reserve."""
    organization = project.organization
    try:
        named = credential or credential_default(organization=organization, adapter=request.adapter)
    except CredentialRefused as refused:
        raise GatewayError(refused.code, refused.message, status=403) from None
    if named is None:
        raise _credential_missing(request)
    released = _release(
        organization=organization,
        request=request,
        reference={"credential": named},
        caller=caller,
    )
    usage = usage_reserve(
        project=project,
        surface=surface,
        provider=request.provider,
        model=request.model,
        tokens=reservation_tokens(messages=list(request.messages), max_tokens=request.max_tokens),
        requested_by=caller.actor.actor_id,
        policy_version=policy_version,
        action=action,
        stream=request.stream,
    )
    call = _Call(request=request, usage=usage, caller=caller, credential=released.record)
    return call, released


def model_call(
    *,
    project,
    request: ModelRequest,
    caller: Caller,
    surface: str,
    policy_version: str,
    credential: str | None = None,
    action=None,
    settle_after: bool = False,
) -> Exchange:
    """A whole (not streamed) call; raises GatewayError (reservation settled) on failure.

    ``settle_after``: a success is settled by the caller (``Exchange.settle``) once it has
    sent the answer on; until then the reservation holds the call's bound, so the budget is
    never short, and a process that dies first leaves it to expire (charged in full)."""
    call, released = _begin(
        project=project,
        request=request,
        caller=caller,
        surface=surface,
        policy_version=policy_version,
        credential=credential,
        action=action,
    )
    try:
        prepared, headers, forms = _prepared(request, released.secret)
        del released
        call.request_body = prepared.body or b""
        timeout_s, max_bytes = operation_limits(request)
        answer = egress_request(
            method=prepared.method,
            url=prepared.url,
            headers=headers,
            body=prepared.body,
            timeout_s=timeout_s,
            max_bytes=max_bytes,
        )
    except GatewayError as error:
        call.settle("failed", error_code=error.code)
        raise
    except EgressRefused as refused:
        call.settle("failed", error_code=refused.code)
        raise _egress_failure(refused.code) from None
    except EgressFailed as failed:
        call.settle(
            "failed", error_code=failed.code, charge_reservation=failed.code not in NOT_SENT
        )
        raise _egress_failure(failed.code) from None
    except BaseException:
        # Anything else (a bug, a worker being stopped): the provider may have done the work.
        call.settle("failed", error_code="internal", charge_reservation=True)
        raise
    call.digest.update(answer.body)
    call.response_bytes = len(answer.body)
    # What is passed on, parsed and kept never carries the credential, even echoed.
    raw, body = _masked_answer(answer.body, forms)
    input_tokens, output_tokens = usage_of(request.provider, body)
    if not 200 <= answer.status < 300:
        call.settle(
            "upstream_error",
            upstream_status=answer.status,
            error_code="upstream_error",
            input_tokens=input_tokens,
            output_tokens=output_tokens,
        )
        raise _upstream_error(answer.status, body)

    def settle() -> ModelUsage:
        return call.settle(
            "succeeded",
            upstream_status=answer.status,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            # A 2xx without usage: the work was done, so the bound is what is charged.
            charge_reservation=True,
        )

    return Exchange(
        usage=call.usage if settle_after else settle(),
        status=answer.status,
        body=body,
        raw=raw,
        text=completion_text(request.provider, body),
        settle=settle if settle_after else None,
    )


@dataclass
class Stream:
    """A streamed call that has begun: the provider answered 2xx; ``events`` yields the
    bytes to send on (OpenAI's event form) and settles the reservation when it ends, is
    closed early, or fails."""

    usage: ModelUsage
    events: Iterator[bytes]


def model_call_stream(
    *,
    project,
    request: ModelRequest,
    caller: Caller,
    surface: str,
    policy_version: str,
    include_usage: bool = True,
    credential: str | None = None,
) -> Stream:
    """A streamed call. Before the first byte is sent on, a refusal or a provider error
    raises GatewayError (settled); after it, the stream ends where the provider's did."""
    call, released = _begin(
        project=project,
        request=request,
        caller=caller,
        surface=surface,
        policy_version=policy_version,
        credential=credential,
        action=None,
    )
    stack = ExitStack()
    try:
        prepared, headers, forms = _prepared(request, released.secret)
        del released
        call.request_body = prepared.body or b""
        timeout_s, max_bytes = operation_limits(request)
        upstream = stack.enter_context(
            egress_stream(
                method=prepared.method,
                url=prepared.url,
                headers=headers,
                body=prepared.body,
                timeout_s=timeout_s,
                max_bytes=max_bytes,
            )
        )
        if not 200 <= upstream.status < 300:
            raw = b"".join(upstream.chunks())
            call.digest.update(raw)
            call.response_bytes = len(raw)
            _, body = _masked_answer(raw, forms)
            call.settle(
                "upstream_error", upstream_status=upstream.status, error_code="upstream_error"
            )
            stack.close()
            raise _upstream_error(upstream.status, body)
    except GatewayError as error:
        stack.close()
        if call.usage.state == "reserved" and error.code != "upstream_error":
            call.settle("failed", error_code=error.code)
        raise
    except EgressRefused as refused:
        stack.close()
        call.settle("failed", error_code=refused.code)
        raise _egress_failure(refused.code) from None
    except EgressFailed as failed:
        stack.close()
        call.settle(
            "failed", error_code=failed.code, charge_reservation=failed.code not in NOT_SENT
        )
        raise _egress_failure(failed.code) from None
    except BaseException:
        stack.close()
        call.settle("failed", error_code="internal", charge_reservation=True)
        raise
    status = upstream.status
    if request.provider == "openai":
        reader = StreamReader("openai")

        def passed(chunk: bytes) -> bytes:
            return reader.passed_on(chunk, include_usage=include_usage)

        def tail() -> bytes:
            return b""
    else:
        translator = AnthropicStreamToOpenAI(model=request.policy_name, include_usage=include_usage)
        reader = translator.reader
        # The translation writes what it decoded from the provider's JSON, where escapes
        # (``\u0073k-...``) that hid the credential from the byte mask are gone: what it
        # writes is masked again, as the whole answer is once parsed.
        written = EchoMask(forms)

        def passed(chunk: bytes) -> bytes:
            return written.feed(translator.feed(chunk))

        def tail() -> bytes:
            return written.feed(translator.finish()) + written.finish()

    echoes = EchoMask(forms)

    def events() -> Iterator[bytes]:
        outcome, error_code = "failed", "stream_closed"
        try:
            for chunk in upstream.chunks():
                call.digest.update(chunk)
                call.response_bytes += len(chunk)
                out = passed(echoes.feed(chunk))
                if out:
                    yield out
            last = passed(echoes.finish()) + tail()
            if last:
                yield last
            outcome, error_code = "succeeded", ""
        except EgressFailed as failed:
            error_code = failed.code
            logger.warning("model stream ended early", code=failed.code)
        finally:
            stack.close()
            call.settle(
                outcome,
                upstream_status=status,
                error_code=error_code,
                input_tokens=reader.input_tokens,
                output_tokens=reader.output_tokens,
                # Cut short, or whole but without a usage report: the bound is charged.
                charge_reservation=True,
            )

    return Stream(usage=call.usage, events=_Events(events(), call, stack))


class _Events:
    """The stream's bytes; closing it (the client went away, even before the first byte)
    settles the reservation if the stream itself did not."""

    def __init__(self, generator: Iterator[bytes], call: _Call, stack: ExitStack):
        self._generator = generator
        self._call = call
        self._stack = stack

    def __iter__(self) -> Iterator[bytes]:
        return self._generator

    def __next__(self) -> bytes:
        return next(self._generator)

    def close(self) -> None:
        self._generator.close()  # type: ignore[attr-defined]
        self._stack.close()
        # A no-op when the generator settled (usage_settle claims a reservation once).
        self._call.settle("failed", error_code="stream_closed", charge_reservation=True)
