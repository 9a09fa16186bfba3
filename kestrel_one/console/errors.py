"""Error pages: the console's own look for browser paths, JSON for everything else.

A page of an organization the person cannot see and one that does not exist render the
same 404 (same bytes), so the answer says nothing about what exists.
"""

from __future__ import annotations

from django.http import JsonResponse
from django.shortcuts import render

from kestrel_one.api.errors import error_body, json_404, json_500

BROWSER_PREFIXES = ("/console", "/login", "/logout")


def _is_browser_path(request) -> bool:
    return request.path == "/" or request.path.startswith(BROWSER_PREFIXES)


def not_found(request, exception=None):
    if not _is_browser_path(request):
        return json_404(request, exception)
    context = {
        "status": 404,
        "title": "Not found",
        "message": "There is nothing here, or you do not have access to it.",
    }
    return render(request, "console/error.html", context, status=404)


def server_error(request):
    if not _is_browser_path(request):
        return json_500(request)
    # No request context: the failure may be in what a context processor needs.
    context = {
        "status": 500,
        "title": "Something went wrong",
        "message": "Something went wrong on our side. Try again; if it keeps happening, "
        "tell your administrator the time it happened.",
    }
    return render(None, "console/error.html", context, status=500)


def csrf_failure(request, reason=""):
    """A form posted without its CSRF token (or from another site): refused, nothing done."""
    message = (
        "This form could not be accepted: it came without this site's security token, or "
        "from another site. Reload the page and try again."
    )
    if not _is_browser_path(request):
        return JsonResponse(error_body("csrf_failed", message), status=403)
    context = {"status": 403, "title": "Form refused", "message": message}
    return render(request, "console/error.html", context, status=403)
