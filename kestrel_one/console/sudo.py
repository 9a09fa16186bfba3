"""Sudo mode: the sensitive console operations need a sign-in within the last few minutes.

Approving or denying, accepting a plan, publishing a policy, creating a token with
``actions:approve``, and every decision only a person may make (``require_person``: accepting
a networking risk, an MCP tool's new definition or egress entries, installing an MCP server)
are each one POST a person makes on purpose; a session left open on a shared screen should
not be enough for them. Signing in
(or confirming one's password again on ``/console/sudo``) stamps the session; the stamp is
fresh for ``KESTREL_CONSOLE_SUDO_SECONDS``. A sensitive POST without a fresh stamp changes
nothing and sends the person to confirm, then back to the page they were on, where they
press the button again: a POST is never replayed on their behalf.
"""

from __future__ import annotations

import time
from urllib.parse import urlencode

from django.conf import settings
from django.contrib.auth.signals import user_logged_in
from django.dispatch import receiver
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.utils.http import url_has_allowed_host_and_scheme

SESSION_KEY = "kestrel_sudo_at"


@receiver(user_logged_in)
def _stamp_on_sign_in(sender, request, user, **kwargs) -> None:
    if request is not None and hasattr(request, "session"):
        sudo_stamp(request)


def sudo_stamp(request: HttpRequest) -> None:
    request.session[SESSION_KEY] = int(time.time())


def sudo_fresh(request: HttpRequest) -> bool:
    stamped = request.session.get(SESSION_KEY)
    if not isinstance(stamped, int):
        return False
    return 0 <= time.time() - stamped <= settings.KESTREL_CONSOLE_SUDO_SECONDS


def sudo_seconds_left(request: HttpRequest) -> int:
    stamped = request.session.get(SESSION_KEY)
    if not isinstance(stamped, int):
        return 0
    return max(0, int(settings.KESTREL_CONSOLE_SUDO_SECONDS - (time.time() - stamped)))


def safe_next(request: HttpRequest, candidate: str | None, default: str = "/console/") -> str:
    """Only a path on this site: never an open redirect."""
    if candidate and url_has_allowed_host_and_scheme(
        candidate, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        return candidate
    return default


def sudo_redirect(request: HttpRequest, *, back_to: str, what: str) -> HttpResponse:
    """Send the person to confirm who they are, then back to ``back_to`` (a GET page)."""
    location = "/console/sudo?" + urlencode({"next": back_to, "for": what})
    if request.headers.get("HX-Request") == "true":
        response = HttpResponse(status=204)
        response["HX-Redirect"] = location
        return response
    return HttpResponseRedirect(location, status=303)
