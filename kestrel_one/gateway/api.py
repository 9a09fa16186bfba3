"""The OpenAI-compatible endpoint of a project, and the project's budget and usage.

``POST /api/v1/orgs/{org}/projects/{prj}/model/v1/chat/completions`` takes OpenAI's
chat-completions request with a Kestrel token as the bearer, so an agent's own model calls
go through Kestrel with no provider key of its own: the organization's credential is used,
the project's policy judges the model, the project's budget is reserved first and settled
after. ``"stream": true`` answers server-sent events, passed on as the provider sends them
(Anthropic's translated into OpenAI's chunk form), with the usage settled at the end.

Errors keep the project's shape and stable codes (``{"error": {"code", "message",
"details"}}``) and add OpenAI's ``type`` and ``param`` beside them, so an OpenAI client
reads them as its own.
"""

from __future__ import annotations

import json
from typing import Any

from django.conf import settings
from django.http import HttpResponse, StreamingHttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, renderers, serializers
from rest_framework.response import Response

from kestrel_one.adapters.registry import InvalidOperationArguments, validate_operation_args
from kestrel_one.api.base import ProjectScopedViewSet
from kestrel_one.api.errors import exception_handler
from kestrel_one.api.pagination import PublicIdCursorPagination
from kestrel_one.api.serializers import StrictSerializer
from kestrel_one.audit.services import audit_refusal_record
from kestrel_one.common.errors import KestrelError, PermissionDenied, ValidationFailed
from kestrel_one.gateway.calls import Caller, model_call, model_call_stream
from kestrel_one.gateway.models import ModelBudget, ModelUsage
from kestrel_one.gateway.providers import (
    ModelRequest,
    UnknownModel,
    anthropic_to_openai,
    provider_args,
    split_model_name,
)
from kestrel_one.gateway.selectors import budget_view
from kestrel_one.gateway.services import BudgetExceeded, budget_set
from kestrel_one.governance.selectors import effective_policy
from policies import DENY, NEEDS_APPROVAL, Mode, Request, decide

ROLES = ("system", "developer", "user", "assistant")
FIELDS = (
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "stream",
    "stream_options",
    # Taken and checked, sent on as what they mean: only one choice is made (n must be 1),
    # and an end-user id is for the caller's own records (not sent to the provider).
    "n",
    "user",
)

# The OpenAI error type for each status an answer of this endpoint can have.
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
}


def openai_exception_handler(exc, context):
    """The project's error (same code and message) with OpenAI's ``type`` and ``param``."""
    response = exception_handler(exc, context)
    if response is not None and isinstance(response.data, dict) and "error" in response.data:
        error = response.data["error"]
        code = error.get("code")
        error["type"] = (
            "insufficient_quota"
            if code == "budget_exceeded"
            else _OPENAI_TYPES.get(response.status_code, "api_error")
        )
        details = error.get("details")
        error["param"] = (
            next(iter(details), None) if isinstance(details, dict) and code == "invalid" else None
        )
    return response


class EventStreamRenderer(renderers.BaseRenderer):
    """Lets a client that accepts only ``text/event-stream`` be answered (errors as JSON)."""

    media_type = "text/event-stream"
    format = "event-stream"

    def render(self, data, accepted_media_type=None, renderer_context=None):
        return renderers.JSONRenderer().render(data)


def _invalid(field: str, message: str) -> ValidationFailed:
    return ValidationFailed(f"{field}: {message}", details={field: [message]})


def _messages(raw: Any) -> tuple[dict[str, str], ...]:
    """Text messages; OpenAI's content parts are taken when every part is text."""
    if not isinstance(raw, list) or not raw:
        raise _invalid("messages", "must be a non-empty list of {role, content}")
    messages = []
    for index, message in enumerate(raw):
        at = f"messages[{index}]"
        if not isinstance(message, dict):
            raise _invalid(at, "must be an object with role and content")
        unknown = sorted(set(message) - {"role", "content", "name"})
        if unknown:
            raise _invalid(
                f"{at}.{str(unknown[0])[:40]}", "unknown field; a message takes role, content"
            )
        if message.get("role") not in ROLES:
            raise _invalid(f"{at}.role", f"must be one of {', '.join(ROLES)}")
        content = message.get("content")
        if isinstance(content, list):
            if not all(
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
                for part in content
            ):
                raise _invalid(f"{at}.content", "only text content parts are taken")
            content = "".join(part["text"] for part in content)
        if not isinstance(content, str):
            raise _invalid(f"{at}.content", "must be text")
        messages.append({"role": message["role"], "content": content})
    return tuple(messages)


def _whole(body: dict, name: str, default=None, *, lowest=1):
    value = body.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        raise _invalid(name, f"must be a whole number from {lowest}")
    return value


def model_request_from_openai(body: Any, *, default_max_tokens: int) -> tuple[ModelRequest, bool]:
    """The ModelRequest an OpenAI chat-completions body asks for, and whether it asks for
    the stream's usage chunk; a 400 naming the field for anything else."""
    if not isinstance(body, dict):
        raise ValidationFailed("Send a JSON object.")
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise _invalid(
            str(unknown[0])[:64], f"not taken by this endpoint; it takes: {', '.join(FIELDS)}"
        )
    try:
        provider, model = split_model_name(body.get("model"))
    except UnknownModel as error:
        raise _invalid("model", str(error)) from None
    max_tokens = _whole(body, "max_completion_tokens") or _whole(body, "max_tokens")
    temperature = body.get("temperature")
    if temperature is not None and (
        isinstance(temperature, bool) or not isinstance(temperature, int | float)
    ):
        raise _invalid("temperature", "must be a number")
    if body.get("n", 1) != 1 or isinstance(body.get("n"), bool):
        raise _invalid("n", "only one choice is made here: send 1 or leave it out")
    if not isinstance(body.get("user", ""), str):
        raise _invalid("user", "must be text")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _invalid("stream", "must be true or false")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise _invalid("stream_options", "takes only include_usage")
    request = ModelRequest(
        provider=provider,
        model=model,
        messages=_messages(body.get("messages")),
        max_tokens=max_tokens or default_max_tokens,
        temperature=temperature,
        stream=stream,
    )
    model_request_check(request)
    return request, bool(options.get("include_usage", False))


def model_request_check(request: ModelRequest, *, prefix: str = "") -> None:
    """The provider operation's own schema (a temperature above Anthropic's 1, ...)."""
    try:
        validate_operation_args(request.adapter, request.operation, provider_args(request))
    except InvalidOperationArguments as error:
        field = error.field.removeprefix("args.args.")
        raise _invalid(prefix + field, error.reason) from None


def model_judge(*, project, principal, request: ModelRequest) -> str:
    """The policy versions that allow this call: the project's effective policy on
    ``model.invoke`` for this model. The endpoint has no person to wait for, so a model that
    needs approval is refused here; a refusal names the versions too."""
    effective = effective_policy(project=project, principal=principal, mode=Mode.AGENT)
    decision = decide(
        effective.policy,
        Request(capability="model.invoke", model=request.policy_name),
        version=effective.version,
        mode=Mode.AGENT,
    )
    if decision.outcome == DENY:
        raise ModelRefused("model_denied", "; ".join(decision.reasons), effective.version)
    if decision.outcome == NEEDS_APPROVAL:
        raise ModelRefused(
            "approval_required",
            f"The policy needs a person's approval for every call of {request.policy_name}; "
            "this endpoint cannot wait for one. Call it as the model.invoke tool in a thread.",
            effective.version,
        )
    return effective.version


class ModelRefused(PermissionDenied):
    def __init__(self, code: str, message: str, policy_version: str):
        super().__init__(message, details={"policy_version": policy_version})
        self.code = code


class ChatCompletionsViewSet(ProjectScopedViewSet):
    """OpenAI's chat completions, through the project's policy, credential and budget."""

    scope_map = {"POST": "projects:write"}
    queryset = ModelUsage.objects.none()
    renderer_classes = [renderers.JSONRenderer, EventStreamRenderer]

    def get_exception_handler(self):
        return openai_exception_handler

    @extend_schema(
        request=OpenApiTypes.OBJECT,
        responses={200: OpenApiTypes.OBJECT},
        description="OpenAI's chat-completions request and answer (docs/gateway.md); "
        '``"stream": true`` answers text/event-stream.',
    )
    def create(self, request, *args, **kwargs):
        model_request, include_usage = model_request_from_openai(
            request.data, default_max_tokens=settings.KESTREL_GATEWAY_DEFAULT_MAX_TOKENS
        )
        principal = self.principal
        version = model_judge(project=self.project, principal=principal, request=model_request)
        caller = Caller(actor=principal, user=principal.user, token=principal.token)
        try:
            return self._call(model_request, caller, include_usage, version)
        except BudgetExceeded as refused:
            # A 403 is audited by the API's error handler; a budget's refusal (429) here.
            audit_refusal_record(
                organization=self.organization,
                actor=principal,
                action="model.invoke",
                target=self.project,
                data={
                    "code": refused.code,
                    "model": model_request.policy_name,
                    "policy_version": version,
                    **refused.details,
                },
            )
            raise

    def _call(self, model_request: ModelRequest, caller: Caller, include_usage: bool, version: str):
        if model_request.stream:
            stream = model_call_stream(
                project=self.project,
                request=model_request,
                caller=caller,
                surface="endpoint",
                policy_version=version,
                include_usage=include_usage,
            )
            response = StreamingHttpResponse(stream.events, content_type="text/event-stream")
            response["Cache-Control"] = "no-cache"
            response["X-Accel-Buffering"] = "no"
            response["X-Kestrel-Usage"] = stream.usage.public_id
            return response
        exchange = model_call(
            project=self.project,
            request=model_request,
            caller=caller,
            surface="endpoint",
            policy_version=version,
            settle_after=True,
        )
        if model_request.provider == "openai" and isinstance(exchange.body, dict):
            # The provider's answer as it came (it parsed as JSON): nothing to re-render.
            content = exchange.raw
        else:
            content = json.dumps(
                anthropic_to_openai(exchange.body, model=model_request.policy_name),
                separators=(",", ":"),
            ).encode()
        response = SettledOnClose(content, settle=exchange.settle)
        response["X-Kestrel-Usage"] = exchange.usage.public_id
        return response


class SettledOnClose(HttpResponse):
    """A model call's answer whose reservation is settled when the server closes the
    response, after the body was sent: the client does not wait for the settlement and
    its audit record. ``close`` runs even when the client went away; the settlement runs
    before Django's own close (which may close the database connection)."""

    def __init__(self, content: bytes, *, settle):
        super().__init__(content, content_type="application/json")
        self._settle = settle

    def close(self) -> None:
        try:
            self._settle()
        finally:
            super().close()


class BudgetSerializer(StrictSerializer):
    tokens_per_day = serializers.IntegerField(min_value=0, allow_null=True, required=True)
    tokens_per_month = serializers.IntegerField(min_value=0, allow_null=True, required=True)


class BudgetViewSet(mixins.RetrieveModelMixin, ProjectScopedViewSet):
    """The project's token budget and what it has used this UTC day and month."""

    scope_map = {"GET": "projects:read", "PUT": "projects:manage"}
    queryset = ModelBudget.objects.none()
    serializer_class = BudgetSerializer

    @extend_schema(responses={200: OpenApiTypes.OBJECT})
    def retrieve(self, request, *args, **kwargs):
        return Response(budget_view(self.project))

    @extend_schema(request=BudgetSerializer, responses={200: OpenApiTypes.OBJECT})
    def update(self, request, *args, **kwargs):
        serializer = BudgetSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        budget_set(actor=self.principal, project=self.project, **serializer.validated_data)
        return Response(budget_view(self.project))


class UsageSerializer(serializers.ModelSerializer):
    """A model call as the API shows it: who, which model, tokens, sizes; never content."""

    id = serializers.CharField(source="public_id", read_only=True)
    model = serializers.SerializerMethodField()
    action = serializers.CharField(source="action.public_id", default=None, read_only=True)
    usage = serializers.SerializerMethodField()

    class Meta:
        model = ModelUsage
        fields = [
            "id",
            "surface",
            "model",
            "stream",
            "action",
            "requested_by",
            "policy_version",
            "credential",
            "state",
            "outcome",
            "upstream_status",
            "error_code",
            "usage",
            "request_bytes",
            "response_bytes",
            "duration_ms",
            "created_at",
            "settled_at",
        ]

    def get_model(self, usage: ModelUsage) -> str:
        return f"{usage.provider}/{usage.model}"

    def get_usage(self, usage: ModelUsage) -> dict:
        # Token counts as input/output/reserved/charged (as audit keeps them).
        return {
            "input": usage.input_tokens,
            "output": usage.output_tokens,
            "reserved": usage.reserved_tokens,
            "charged": usage.charged_tokens,
        }


class NewestFirst(PublicIdCursorPagination):
    ordering = "-public_id"


class UsageViewSet(mixins.ListModelMixin, ProjectScopedViewSet):
    """The project's model calls, newest first (cursor pages, ``?limit=``)."""

    scope_map = {"GET": "projects:read"}
    queryset = ModelUsage.objects.none()
    serializer_class = UsageSerializer

    pagination_class = NewestFirst

    def restrict(self, queryset):
        return queryset.filter(project=self.project).select_related("action")


__all__ = ["BudgetViewSet", "ChatCompletionsViewSet", "KestrelError", "UsageViewSet"]
