"""Browser sign-in: exchanges credentials for a short-lived HttpOnly session cookie.

The session serves the console only; the REST API never accepts it.
"""

from __future__ import annotations

from django import forms
from django.conf import settings
from django.contrib.auth import authenticate, login, logout
from django.contrib.auth.decorators import login_required
from django.shortcuts import redirect, render
from django.views import View
from django.views.decorators.http import require_POST


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
        if data.get("server_token"):
            credentials = {"server_token": data["server_token"]}
        elif data.get("email") and data.get("password"):
            credentials = {"username": data["email"].lower(), "password": data["password"]}
        else:
            credentials = None
        if credentials is not None:
            # A locked-out attempt gets None here too; the lockout middleware then answers.
            self.user = authenticate(self.request, **credentials)
        if self.user is None or not self.user.is_active:
            # One message for every failure: no hint which part was wrong.
            raise forms.ValidationError("Those credentials did not work.")
        return data


class LoginView(View):
    def get(self, request):
        return sign_in_page(request, LoginForm())

    def post(self, request):
        form = LoginForm(request.POST, request=request)
        if not form.is_valid():
            return sign_in_page(request, form, status=400)
        login(request, form.user, backend="django.contrib.auth.backends.ModelBackend")
        return redirect(settings.LOGIN_REDIRECT_URL)


def sign_in_page(request, form, *, status=200, locked_out=None):
    context = {"form": form, "single_host": settings.SINGLE_HOST, "locked_out": locked_out}
    return render(request, "accounts/login.html", context, status=status)


def locked_out(request, response, credentials):
    """django-axes' lockout answer: the sign-in page, 429, saying when to try again."""
    minutes = int(settings.AXES_COOLOFF_TIME.total_seconds() // 60)
    message = (
        "Too many failed sign-ins for this account from your address. "
        f"Try again in {minutes} minutes; each further attempt before then restarts the wait."
    )
    form = LoginForm(initial={"email": request.POST.get("email", "")})
    return sign_in_page(request, form, status=429, locked_out=message)


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
