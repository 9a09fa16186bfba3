"""Console: the organization's credentials (admins) and a person's own App connections
(CRED-1, TEN-5).

As everywhere in the console, each page asks for the scope the API's viewset asks for, reads
through the same selectors and writes through the same services. Secrets are write-only here
too: a form takes one and no page ever shows it again, not even on a refused form (the
secret field is always rendered empty); lists show fingerprints.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.http import Http404, HttpResponseRedirect
from django.urls import URLPattern, path
from django.utils.http import urlencode

from kestrel_one.adapters.registry import ADAPTERS
from kestrel_one.common.errors import KestrelError
from kestrel_one.console.base import ConsoleView
from kestrel_one.credentials import services
from kestrel_one.credentials.selectors import connections_of, credentials_of

TEMPLATES = "console/credentials/"
ADAPTER_CHOICES = [(name, f"{name}: {a.summary}") for name, a in sorted(ADAPTERS.items())]


def _back(url: str, **notice: str) -> HttpResponseRedirect:
    query = f"?{urlencode(notice)}" if notice else ""
    return HttpResponseRedirect(url + query, status=303)


class SecretFormField(forms.Field):
    """The secret, checked by the service; its refusal never repeats it, and the widget never
    renders a value back."""

    widget = forms.PasswordInput(render_value=False)

    def clean(self, value):
        try:
            return services.secret_check(value)
        except KestrelError as error:
            raise forms.ValidationError(error.details["secret"][0]) from None


class CredentialForm(forms.Form):
    name = forms.CharField(max_length=100)
    adapter = forms.ChoiceField(choices=ADAPTER_CHOICES)
    secret = SecretFormField()


class RotateForm(forms.Form):
    secret = SecretFormField()


class ConnectionForm(forms.Form):
    adapter = forms.ChoiceField(choices=ADAPTER_CHOICES)
    secret = SecretFormField()


def _first_error(form) -> str:
    for field, errors in form.errors.items():
        label = "" if field == "__all__" else f"{field}: "
        return f"{label}{errors[0]}"
    return "Check the form."


class CredentialsView(ConsoleView):
    """``/console/{org}/credentials``: the organization's credentials (name, adapter, kind,
    fingerprint, state) and a form to add one. Putting a secret in needs sudo mode."""

    scope_map = {"GET": "credentials:read", "POST": "credentials:write"}
    sudo_for = {"POST": "add, rotate or revoke a credential"}
    section = "credentials"

    def get(self, request, org: str):
        return self.credentials_page(CredentialForm())

    def post(self, request, org: str):
        form = CredentialForm(request.POST)
        if not form.is_valid():
            return self.credentials_page(form, status=400)
        try:
            credential = services.credential_create(
                actor=self.principal, organization=self.organization, **form.cleaned_data
            )
        except KestrelError as error:
            return self.credentials_page(form, status=error.status, error=error.message)
        return _back(f"/console/{org}/credentials", created=credential.public_id)

    def credentials_page(self, form, *, status: int = 200, error: str = "", **extra: Any):
        # At most MAX_CREDENTIALS_PER_ORGANIZATION active ones, plus the revoked: newest first.
        rows = credentials_of(self.organization).order_by("-created_at", "-pk")[:500]
        context = {
            "form": form,
            "credentials": rows,
            "adapters": ADAPTER_CHOICES,
            "can_write": self.can("credentials:write"),
            "notice": {
                key: self.request.GET.get(key, "")[:40] for key in ("created", "rotated", "revoked")
            },
            "error": error or (_first_error(form) if form.is_bound and form.errors else ""),
            **extra,
        }
        return self.page(TEMPLATES + "credentials.html", context, status=status)


class _OneCredential(CredentialsView):
    scope_map = {"POST": "credentials:write"}

    def resolve_parents(self, **kwargs: Any) -> None:
        self.credential = (
            credentials_of(self.organization).filter(public_id=kwargs.get("crd")).first()
        )
        if self.credential is None:
            raise Http404


class CredentialRotateView(_OneCredential):
    """``POST /console/{org}/credentials/{crd}/rotate``: as the API's ``POST .../rotate``."""

    def post(self, request, org: str, crd: str):
        form = RotateForm(request.POST)
        if not form.is_valid():
            return self.credentials_page(CredentialForm(), status=400, error=_first_error(form))
        try:
            services.credential_rotate(
                actor=self.principal, credential=self.credential, secret=form.cleaned_data["secret"]
            )
        except KestrelError as error:
            return self.credentials_page(CredentialForm(), status=error.status, error=error.message)
        return _back(f"/console/{org}/credentials", rotated=self.credential.public_id)


class CredentialRevokeView(_OneCredential):
    """``POST /console/{org}/credentials/{crd}/revoke``: as the API's ``DELETE``."""

    def post(self, request, org: str, crd: str):
        services.credential_revoke(actor=self.principal, credential=self.credential)
        return _back(f"/console/{org}/credentials", revoked=self.credential.public_id)


class ConnectionsView(ConsoleView):
    """``/console/{org}/connections``: your own App connections, and nobody else's (TEN-5)."""

    scope_map = {"GET": "connections:write", "POST": "connections:write"}
    section = "connections"

    def get(self, request, org: str):
        return self.connections_page(ConnectionForm())

    def post(self, request, org: str):
        form = ConnectionForm(request.POST)
        if not form.is_valid():
            return self.connections_page(form, status=400)
        try:
            connection = services.connection_create(
                actor=self.principal, organization=self.organization, **form.cleaned_data
            )
        except KestrelError as error:
            return self.connections_page(form, status=error.status, error=error.message)
        return _back(f"/console/{org}/connections", created=connection.public_id)

    def connections_page(self, form, *, status: int = 200, error: str = ""):
        rows = connections_of(self.principal, self.organization).order_by("-created_at", "-pk")
        context = {
            "form": form,
            "connections": rows[:500],
            "adapters": ADAPTER_CHOICES,
            "notice": {key: self.request.GET.get(key, "")[:40] for key in ("created", "revoked")},
            "error": error or (_first_error(form) if form.is_bound and form.errors else ""),
        }
        return self.page(TEMPLATES + "connections.html", context, status=status)


class ConnectionRevokeView(ConnectionsView):
    """``POST /console/{org}/connections/{con}/revoke``: your own only; anyone else's is the
    same 404 as a missing one."""

    scope_map = {"POST": "connections:write"}

    def resolve_parents(self, **kwargs: Any) -> None:
        self.connection = (
            connections_of(self.principal, self.organization)
            .filter(public_id=kwargs.get("con"))
            .first()
        )
        if self.connection is None:
            raise Http404

    def post(self, request, org: str, con: str):
        services.connection_revoke(actor=self.principal, connection=self.connection)
        return _back(f"/console/{org}/connections", revoked=self.connection.public_id)


ORG = "console/<slug:org>"

urlpatterns: list[URLPattern] = [
    path(f"{ORG}/credentials", CredentialsView.as_view(), name="console_credentials"),
    path(
        f"{ORG}/credentials/<str:crd>/rotate",
        CredentialRotateView.as_view(),
        name="console_credential_rotate",
    ),
    path(
        f"{ORG}/credentials/<str:crd>/revoke",
        CredentialRevokeView.as_view(),
        name="console_credential_revoke",
    ),
    path(f"{ORG}/connections", ConnectionsView.as_view(), name="console_connections"),
    path(
        f"{ORG}/connections/<str:con>/revoke",
        ConnectionRevokeView.as_view(),
        name="console_connection_revoke",
    ),
]
