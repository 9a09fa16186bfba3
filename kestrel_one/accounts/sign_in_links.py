"""One-time sign-in links: how a person added without a password gets in the first time.

A link is Django's password-reset token (``PasswordResetTokenGenerator``) at
``/login/set-password/<uidb64>/<token>/``, where the person chooses a password and is signed
in. Django's token is a keyed hash of the person's state, so the link stops working once a
password is set or the person signs in, and after ``KESTREL_SIGN_IN_LINK_HOURS``
(``PASSWORD_RESET_TIMEOUT``). Nothing about a link is stored: it is shown once, to whoever
added the person, and never written to the audit log.

Whoever holds a link becomes that person, so it is only made for someone nobody else relies
on yet: no usable password, no operator rights, and no organization besides the one adding
them. Otherwise an admin of one organization could add someone another organization (or the
operator) already works with and take over their account. The same facts are part of the
token, so a link also stops working when the person's memberships change.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.auth.tokens import PasswordResetTokenGenerator
from django.urls import reverse
from django.utils import timezone
from django.utils.encoding import force_bytes, force_str
from django.utils.http import urlsafe_base64_decode, urlsafe_base64_encode

from kestrel_one.accounts.models import User
from kestrel_one.common.errors import ValidationFailed


class SignInLinkTokenGenerator(PasswordResetTokenGenerator):
    """Django's reset tokens, with their own salt and bound to who the person is now."""

    # Its own salt: a token made for any other Django flow never opens a sign-in link.
    key_salt = "kestrel_one.accounts.sign_in_links"

    def _make_hash_value(self, user, timestamp):
        # Each membership's own id: joining another organization, or being removed and
        # added again, ends every link made before.
        memberships = ",".join(
            user.memberships.order_by("public_id").values_list("public_id", flat=True)
        )
        rights = f"{user.is_active}{user.is_staff}{user.is_superuser}"
        return f"{super()._make_hash_value(user, timestamp)}|{rights}|{memberships}"


sign_in_link_tokens = SignInLinkTokenGenerator()


def sign_in_link_allowed(user: User, organization) -> bool:
    """Whether a link may be made for ``user`` on being added to ``organization``."""
    return (
        user.is_active
        and not user.has_usable_password()
        and not user.is_staff
        and not user.is_superuser
        and not user.memberships.exclude(organization=organization).exists()
    )


def sign_in_link_path(user: User) -> str:
    uidb64 = urlsafe_base64_encode(force_bytes(user.public_id))
    token = sign_in_link_tokens.make_token(user)
    return reverse("set_password", kwargs={"uidb64": uidb64, "token": token})


def sign_in_link_expires_at(now: datetime | None = None) -> datetime:
    return (now or timezone.now()) + timedelta(seconds=settings.PASSWORD_RESET_TIMEOUT)


def sign_in_link_user(uidb64: str) -> User | None:
    """The active person a link's ``uidb64`` names (their public id, never the primary key)."""
    try:
        public_id = force_str(urlsafe_base64_decode(uidb64))
    except (TypeError, ValueError, UnicodeDecodeError):
        return None
    return User.objects.filter(public_id=public_id, is_active=True).first()


def public_base_url() -> str:
    """Where people reach the console, for a link made outside a request."""
    if settings.KESTREL_PUBLIC_URL:
        return settings.KESTREL_PUBLIC_URL
    if settings.SINGLE_HOST:
        # What `make run` and `manage.py serve` listen on unless told otherwise.
        return f"http://127.0.0.1:{os.environ.get('PORT') or 8000}"
    raise ValidationFailed(
        "Set KESTREL_PUBLIC_URL to the address people open the console at (for example "
        "https://kestrel.example.com), so that a sign-in link can point there.",
        details={"KESTREL_PUBLIC_URL": ["not set"]},
    )
