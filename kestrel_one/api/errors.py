"""The one JSON error shape: ``{"error": {"code", "message", "details"}}``."""

from __future__ import annotations

from django.http import Http404, JsonResponse
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from kestrel_one.audit.services import audit_authorization_refusal
from kestrel_one.common.errors import KestrelError

# One message for every 404 (TEN-4: a foreign object is answered exactly like a missing one),
# so it can only say where to look, never which part of the path was wrong.
NOT_FOUND_MESSAGE = (
    "Not found. Check the organization slug and the ids in the path; GET /api/v1/orgs lists "
    "the organizations you can address."
)


def error_body(code: str, message: str, details=None) -> dict:
    return {"error": {"code": code, "message": message, "details": details}}


def not_found_body() -> dict:
    # One body for "missing" and "not yours": nothing distinguishes the two.
    return error_body("not_found", NOT_FOUND_MESSAGE)


# A validation message names every field's first problem, up to this length.
VALIDATION_MESSAGE_MAX_CHARS = 1000
NON_FIELD_KEYS = {"non_field_errors", "detail"}
NOT_AUTHENTICATED_MESSAGE = (
    "This needs an API token: send 'Authorization: Bearer TOKEN' or 'X-Kestrel-Token: TOKEN'."
)


def _field_problems(details, path: str = ""):
    """(field path, first message, code) for each field in a DRF error tree."""
    if isinstance(details, dict):
        for key, value in details.items():
            key = str(key)
            if key in NON_FIELD_KEYS:
                child = path
            elif key.isdigit():
                child = f"{path}[{key}]"
            else:
                child = f"{path}.{key}" if path else key
            yield from _field_problems(value, child)
    elif isinstance(details, list):
        if details and not isinstance(details[0], dict | list):
            yield path, str(details[0]), getattr(details[0], "code", None)
        else:
            for index, value in enumerate(details):
                if value:
                    yield from _field_problems(value, f"{path}[{index}]")
    elif details:
        yield path, str(details), getattr(details, "code", None)


def _validation_message(details) -> str:
    """One line that says what to fix: the missing fields, then each other field's problem."""
    problems = list(_field_problems(details))
    if not problems:
        return "Invalid input."
    missing = [path for path, _, code in problems if code == "required" and path]
    parts = [f"Missing required field(s): {', '.join(missing)}."] if missing else []
    parts += [
        f"{path}: {message}" if path else message
        for path, message, code in problems
        if not (code == "required" and path)
    ]
    text = " ".join(parts)
    if len(text) > VALIDATION_MESSAGE_MAX_CHARS:
        text = text[: VALIDATION_MESSAGE_MAX_CHARS - 3] + "..."
    return text


def _method_not_allowed_message(context) -> str:
    """Names the methods the route takes: those it maps and, on an organization route, that
    its scope map allows (a mapped method without a scope is refused too). OPTIONS is never
    answered (the schema describes routes)."""
    view, request = context.get("view"), context.get("request")
    method = getattr(request, "method", "")[:16]
    methods = [m for m in getattr(view, "allowed_methods", []) if m != "OPTIONS"]
    scope_map = getattr(view, "scope_map", None)
    if scope_map:
        methods = [m for m in methods if m in scope_map or (m == "HEAD" and "GET" in scope_map)]
    takes = ", ".join(sorted(methods)) or "no method"
    return f"{method} is not allowed here; this route takes: {takes}."


def _unsupported_media_type_message(context) -> str:
    request = context.get("request")
    sent = (getattr(request, "content_type", "") or "").split(";")[0].strip()[:100]
    said = f'this request said "{sent}"' if sent else "this request sent none"
    if sent == "application/x-www-form-urlencoded":
        said += ", which is what curl -d sends unless told otherwise"
    return f"Send the body as JSON with the header 'Content-Type: application/json' ({said})."


def exception_handler(exc, context):
    response = _error_response(exc, context)
    if response is not None and response.status_code == status.HTTP_403_FORBIDDEN:
        _audit_refusal(exc, context)
    return response


def _audit_refusal(exc, context) -> None:
    """Record a member's 403 in the organization's audit log.

    Only views that resolved an organization *through* the principal carry one, so an
    outsider (who gets the 404 before that) can never write into another organization's log.
    """
    view = context.get("view")
    request = context.get("request")
    organization = getattr(view, "organization", None)
    if organization is None or request is None or request.auth is None:
        return
    audit_authorization_refusal(
        organization=organization,
        actor=request.auth,
        method=request.method,
        path=request.path,
        reason=str(getattr(exc, "message", None) or getattr(exc, "detail", "")),
        # A refusal by a policy (a model the endpoint may not call) names its versions.
        policy_version=details.get("policy_version", "")
        if isinstance(details := getattr(exc, "details", None), dict)
        else "",
    )


def _error_response(exc, context):
    if isinstance(exc, KestrelError):
        return Response(error_body(exc.code, exc.message, exc.details), status=exc.status)
    if isinstance(exc, Http404 | exceptions.NotFound):
        return Response(not_found_body(), status=status.HTTP_404_NOT_FOUND)
    if isinstance(exc, exceptions.ValidationError):
        return Response(
            error_body("invalid", _validation_message(exc.detail), exc.detail),
            status=status.HTTP_400_BAD_REQUEST,
        )
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    code = {
        401: "not_authenticated",
        403: "permission_denied",
        405: "method_not_allowed",
        406: "not_acceptable",
        415: "unsupported_media_type",
        429: "throttled",
    }.get(response.status_code, getattr(exc, "default_code", "error"))
    if isinstance(exc, exceptions.ParseError):
        code = "parse_error"
    detail = response.data.get("detail") if isinstance(response.data, dict) else response.data
    message = str(detail)
    if isinstance(exc, exceptions.UnsupportedMediaType):
        message = _unsupported_media_type_message(context)
    elif isinstance(exc, exceptions.NotAuthenticated):
        message = NOT_AUTHENTICATED_MESSAGE
    elif isinstance(exc, exceptions.MethodNotAllowed):
        message = _method_not_allowed_message(context)
    response.data = error_body(code, message)
    return response


def json_404(request, exception=None):
    return JsonResponse(not_found_body(), status=404)


def json_500(request):
    return JsonResponse(error_body("server_error", "Something went wrong on our side."), status=500)
