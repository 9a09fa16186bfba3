"""Console sign-in: the single-host server token as a backend, and who an attempt was for.

Both ways in (email and password, or the server token) go through Django's `authenticate`,
so django-axes counts every failure and refuses a locked-out attempt before any secret is
compared.
"""

from __future__ import annotations

import hmac

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.backends import BaseBackend

from kestrel_one.common.addresses import client_network

# What a server-token attempt counts against in the lockout: there is one such secret.
SERVER_TOKEN_ATTEMPT = "(server token)"  # noqa: S105 - a label, not the token


def server_token_sign_in_enabled() -> bool:
    """Whether the console offers the server token: only where it can sign anyone in
    (single-host mode with KESTREL_SERVER_TOKEN configured)."""
    return bool(settings.SINGLE_HOST and settings.KESTREL_SERVER_TOKEN)


def is_server_token(value: str | None) -> bool:
    """Single-host mode: ``value`` is the configured KESTREL_SERVER_TOKEN (constant time)."""
    expected = settings.KESTREL_SERVER_TOKEN
    return bool(
        settings.SINGLE_HOST
        and expected
        and value
        and hmac.compare_digest(value.encode(), expected.encode())
    )


def local_owner():
    """The owner whose organizations the local agent acts in; created by ``serve`` on an empty
    database."""
    # The person of the oldest active owner membership, read through the reverse relation
    # (tenancy.Membership.user) so accounts, below tenancy, names no tenancy module; the
    # ordering reuses the filter's join, so it is that owner membership's creation time.
    return (
        get_user_model()
        .objects.filter(memberships__role="owner", is_active=True)
        .order_by("memberships__created_at")
        .first()
    )


class ServerTokenBackend(BaseBackend):
    """Single-host mode: the configured KESTREL_SERVER_TOKEN signs in as the local owner."""

    def authenticate(self, request, server_token=None, **credentials):
        return local_owner() if is_server_token(server_token) else None


def sign_in_username(request, credentials) -> str:
    """The lockout's username: the email as it signs in (lower case), or the server token.

    django-axes asks with the credentials given to `authenticate` when it checks a lockout,
    and with Django's cleansed copy of them when it counts a failure; both name the same.
    """
    credentials = credentials or {}
    if credentials.get("username"):
        return str(credentials["username"]).lower()
    if credentials.get("server_token"):
        return SERVER_TOKEN_ATTEMPT
    return str(request.POST.get("email", "")).lower()


def sign_in_address(request) -> str:
    """The lockout's address: REMOTE_ADDR only, like every other rule here (a client-sent
    X-Forwarded-For would let anyone pick a fresh address per attempt), an IPv6 one as its
    /64 (``client_network``)."""
    return client_network(request.META.get("REMOTE_ADDR")) or ""
