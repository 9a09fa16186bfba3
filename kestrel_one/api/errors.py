"""The one JSON error shape: ``{"error": {"code", "message", "details"}}``."""

from __future__ import annotations

from django.http import Http404, JsonResponse
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from kestrel_one.common.errors import KestrelError

NOT_FOUND_MESSAGE = "Not found."


def error_body(code: str, message: str, details=None) -> dict:
    return {"error": {"code": code, "message": message, "details": details}}


def not_found_body() -> dict:
    # One body for "missing" and "not yours": nothing distinguishes the two.
    return error_body("not_found", NOT_FOUND_MESSAGE)


def _validation_message(details) -> str:
    if isinstance(details, dict) and details:
        fields = ", ".join(sorted(str(k) for k in details))
        return f"Invalid input in: {fields}."
    if isinstance(details, list) and details:
        return str(details[0])
    return "Invalid input."


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
    from kestrel_one.audit.services import audit_authorization_refusal

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
    response.data = error_body(code, str(detail))
    return response


def json_404(request, exception=None):
    return JsonResponse(not_found_body(), status=404)


def json_500(request):
    return JsonResponse(error_body("server_error", "Something went wrong on our side."), status=500)
