"""Browser sign-in: exchanges credentials for a short-lived HttpOnly session cookie.

The session serves the console only; the REST API never accepts it.
"""

from __future__ import annotations

import hmac

from django import forms
from django.conf import settings
from django.contrib.auth import authenticate, login, logout
from django.contrib.auth.decorators import login_required
from django.shortcuts import redirect, render
from django.views import View
from django.views.decorators.http import require_POST

from kestrel_one.api.authentication import local_owner


class LoginForm(forms.Form):
    email = forms.EmailField(required=False)
    password = forms.CharField(widget=forms.PasswordInput, required=False)
    server_token = forms.CharField(
        widget=forms.PasswordInput,
        required=False,
        help_text="Single-host mode: the configured KESTREL_SERVER_TOKEN.",
    )

    def __init__(self, *args, request=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.request = request
        self.user = None

    def clean(self):
        data = super().clean()
        server_token = settings.KESTREL_SERVER_TOKEN
        if data.get("server_token"):
            if (
                settings.SINGLE_HOST
                and server_token
                and hmac.compare_digest(data["server_token"].encode(), server_token.encode())
            ):
                self.user = local_owner()
        elif data.get("email") and data.get("password"):
            self.user = authenticate(
                self.request, username=data["email"].lower(), password=data["password"]
            )
        if self.user is None or not self.user.is_active:
            # One message for every failure: no hint which part was wrong.
            raise forms.ValidationError("Those credentials did not work.")
        return data


class LoginView(View):
    template_name = "accounts/login.html"

    def get(self, request):
        return render(
            request, self.template_name, {"form": LoginForm(), "single_host": settings.SINGLE_HOST}
        )

    def post(self, request):
        form = LoginForm(request.POST, request=request)
        if not form.is_valid():
            return render(
                request,
                self.template_name,
                {"form": form, "single_host": settings.SINGLE_HOST},
                status=400,
            )
        login(request, form.user, backend="django.contrib.auth.backends.ModelBackend")
        return redirect(settings.LOGIN_REDIRECT_URL)


@require_POST
def logout_view(request):
    logout(request)
    return redirect(settings.LOGIN_URL)


@login_required
def home(request):
    memberships = request.user.memberships.select_related("organization").order_by(
        "organization__slug"
    )
    return render(request, "accounts/home.html", {"memberships": memberships})
