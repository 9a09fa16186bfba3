"""Browser sign-in: exchanges credentials for a short-lived HttpOnly session cookie.

The session serves the console only; the REST API never accepts it.
"""

from __future__ import annotations

from django import forms
from django.conf import settings
from django.contrib.auth import authenticate, login, logout
from django.contrib.auth.forms import SetPasswordForm
from django.contrib.auth.views import PasswordResetConfirmView
from django.shortcuts import redirect, render
from django.urls import reverse_lazy
from django.views import View
from django.views.decorators.http import require_POST

from kestrel_one.accounts.backends import server_token_sign_in_enabled
from kestrel_one.accounts.principal import Principal, PrincipalKind
from kestrel_one.accounts.services import user_password_set
from kestrel_one.accounts.sign_in_links import sign_in_link_tokens, sign_in_link_user
from kestrel_one.console.sudo import safe_next


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
        if not server_token_sign_in_enabled():
            # No server token configured: the field is neither shown nor read, so posting
            # one signs nobody in (it never reaches a backend).
            del self.fields["server_token"]

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
        return redirect(safe_next(request, request.POST.get("next"), settings.LOGIN_REDIRECT_URL))


def sign_in_page(request, form, *, status=200, locked_out=None):
    context = {
        "form": form,
        "next": safe_next(request, request.GET.get("next") or request.POST.get("next"), ""),
        "server_token": server_token_sign_in_enabled(),
        "locked_out": locked_out,
    }
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


class SignInLinkPasswordForm(SetPasswordForm):
    """Django's form for choosing a password; saving goes through the audited service."""

    def save(self, commit=True):
        return user_password_set(
            actor=Principal(PrincipalKind.SESSION, user=self.user),
            user=self.user,
            password=self.cleaned_data["new_password1"],
            via="sign_in_link",
        )


class SetPasswordView(PasswordResetConfirmView):
    """A one-time sign-in link (accounts/sign_in_links.py): choose a password, then signed in.

    Django's view keeps the token out of the page's own address: the first request moves it
    into the session and redirects to ``.../set-password/``, so it is never sent on in a
    Referer. A link that is used, expired or altered is a 400 saying what to do instead.
    """

    form_class = SignInLinkPasswordForm
    template_name = "accounts/set_password.html"
    token_generator = sign_in_link_tokens
    post_reset_login = True
    post_reset_login_backend = "django.contrib.auth.backends.ModelBackend"
    success_url = reverse_lazy("console_home")
    title = "Choose your password"

    def get_user(self, uidb64):
        return sign_in_link_user(uidb64)

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        if self.validlink:
            context["email"] = self.user.email
        return context

    def render_to_response(self, context, **response_kwargs):
        if not self.validlink:
            response_kwargs["status"] = 400
        return super().render_to_response(context, **response_kwargs)

    def form_invalid(self, form):
        return self.render_to_response(self.get_context_data(form=form), status=400)


@require_POST
def logout_view(request):
    logout(request)
    return redirect(settings.LOGIN_URL)


def home(request):
    """``/``: the console's list of the person's organizations."""
    return redirect("console_home")
