"""The console pages that belong to no organization: the list of one's organizations and
the sudo-mode confirmation."""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth import authenticate
from django.contrib.auth.decorators import login_required
from django.shortcuts import redirect
from django.views import View

from kestrel_one.accounts.backends import is_server_token, server_token_sign_in_enabled
from kestrel_one.console.base import page_drawn
from kestrel_one.console.sudo import safe_next, sudo_stamp


@login_required
def home(request):
    memberships = request.user.memberships.select_related("organization").order_by(
        "organization__slug"
    )
    return page_drawn(request, "console/home.html", {"memberships": memberships})


class SudoView(View):
    """``/console/sudo``: confirm the password (or, on a single host whose person signs in
    with the server token, that token) to enter sudo mode for a few minutes."""

    def _uses_server_token(self, request) -> bool:
        return server_token_sign_in_enabled() and not request.user.has_usable_password()

    def _page(self, request, *, next_url: str, what: str, error: str = "", status: int = 200):
        context = {
            "next": next_url,
            "what": what[:200],
            "error": error,
            "server_token": self._uses_server_token(request),
            "minutes": max(1, settings.KESTREL_CONSOLE_SUDO_SECONDS // 60),
        }
        return page_drawn(request, "console/sudo.html", context, status=status)

    def get(self, request):
        if not request.user.is_authenticated:
            return redirect(settings.LOGIN_URL)
        return self._page(
            request,
            next_url=safe_next(request, request.GET.get("next")),
            what=request.GET.get("for", ""),
        )

    def post(self, request):
        if not request.user.is_authenticated:
            return redirect(settings.LOGIN_URL)
        next_url = safe_next(request, request.POST.get("next"))
        what = request.POST.get("for", "")
        if self._uses_server_token(request):
            confirmed = is_server_token(request.POST.get("server_token"))
        else:
            # Through the backends, so django-axes counts a wrong password here as well.
            user = authenticate(
                request, username=request.user.email, password=request.POST.get("password", "")
            )
            confirmed = user is not None and user.pk == request.user.pk
        if not confirmed:
            return self._page(
                request,
                next_url=next_url,
                what=what,
                error="That did not match. Try again.",
                status=400,
            )
        sudo_stamp(request)
        return redirect(next_url)
