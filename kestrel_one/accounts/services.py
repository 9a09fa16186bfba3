"""Writes for people and API tokens."""

from __future__ import annotations

from datetime import datetime, timedelta

from axes.models import AccessAttempt
from django.conf import settings
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from kestrel_one.accounts import tokens
from kestrel_one.accounts.models import ApiToken, User
from kestrel_one.accounts.principal import Principal, PrincipalKind
from kestrel_one.accounts.scopes import unknown_scopes
from kestrel_one.audit.services import audit_record, audit_refusal_record
from kestrel_one.common.errors import PermissionDenied, ValidationFailed

# last_used_at is advisory; writing it at most this often keeps authentication read-only
# on the hot path.
LAST_USED_RESOLUTION = timedelta(minutes=1)


def user_get_or_create(*, email: str, name: str = "") -> tuple[User, bool]:
    email = User.objects.normalize_email(email).lower()
    user = User.objects.filter(email=email).first()
    if user is not None:
        return user, False
    return User.objects.create_user(email=email, name=name), True


@transaction.atomic
def token_create(
    *,
    actor: Principal,
    organization,
    name: str,
    scopes: list[str],
    integration: bool = False,
    expires_at: datetime | None = None,
    user: User | None = None,
) -> tuple[ApiToken, str]:
    """Create a token and return it with its plaintext, which is never stored or shown again.

    A token can never hold a scope its creator lacks in the organization. ``user`` is only
    for trusted callers (the bootstrap command); API callers get a token for themselves or,
    with ``integration``, for no person.
    """
    bad = unknown_scopes(scopes)
    if bad:
        raise ValidationFailed(
            f"Unknown scope(s): {', '.join(bad)}.",
            details={"scopes": [f"unknown: {s}" for s in bad]},
        )
    if not scopes:
        raise ValidationFailed("A token needs at least one scope.", details={"scopes": ["empty"]})
    # Every caller but an operator's command on the server is held to its own scopes: a
    # token never mints a token that could do more than the caller.
    held = actor.scopes_in(organization)
    exceeding = sorted(set(scopes) - held)
    if exceeding:
        raise PermissionDenied(
            f"You cannot grant scope(s) you do not hold: {', '.join(exceeding)}."
        )
    if integration and "tokens:admin" not in held:
        raise PermissionDenied("Creating integration tokens needs the 'tokens:admin' scope.")
    if integration and "actions:approve" in scopes:
        raise ValidationFailed(
            "Integration tokens cannot approve: approvals are made by people.",
            details={"scopes": ["actions:approve needs a person"]},
        )
    now = timezone.now()
    max_expiry = now + settings.KESTREL_TOKEN_MAX_TTL
    if expires_at is None:
        expires_at = now + settings.KESTREL_TOKEN_DEFAULT_TTL
    if expires_at <= now or expires_at > max_expiry:
        raise ValidationFailed(
            "expires_at must be in the future and at most "
            f"{settings.KESTREL_TOKEN_MAX_TTL.days} days away.",
            details={"expires_at": ["out of range"]},
        )
    owner = None if integration else (user or actor.user)
    if owner is None and not integration:
        raise ValidationFailed(
            "This caller is not a person; ask for an integration token instead.",
            details={"integration": ["required for a caller that is not a person"]},
        )
    plaintext, key_id, secret_hash = tokens.generate()
    token = ApiToken.objects.create(
        organization=organization,
        user=owner,
        created_by=actor.user,
        name=name,
        key_id=key_id,
        secret_hash=secret_hash,
        scopes=sorted(set(scopes)),
        expires_at=expires_at,
    )
    audit_record(
        organization=organization,
        actor=actor,
        action="token.create",
        target=token,
        data={
            "name": name,
            "scopes": token.scopes,
            "integration": integration,
            "expires_at": expires_at.isoformat(),
        },
    )
    return token, plaintext


@transaction.atomic
def token_revoke(*, actor: Principal, token: ApiToken) -> ApiToken:
    updated = ApiToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(
        revoked_at=timezone.now()
    )
    token.refresh_from_db()
    if updated:
        audit_record(
            organization=token.organization, actor=actor, action="token.revoke", target=token
        )
    return token


def token_authenticate(plaintext: str) -> ApiToken | None:
    """The active token this plaintext proves, or None. Constant-time on the secret."""
    key_id = tokens.parse_key_id(plaintext)
    if key_id is None:
        return None
    token = (
        ApiToken.objects.active()
        .select_related("organization", "user")
        .filter(key_id=key_id)
        .first()
    )
    if token is None or not tokens.matches(plaintext, token.secret_hash):
        return None
    if token.user is not None and not token.user.is_active:
        return None
    now = timezone.now()
    if token.last_used_at is None or now - token.last_used_at > LAST_USED_RESOLUTION:
        ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
        token.last_used_at = now
    return token


def sign_in_attempts_expire(*, now: datetime | None = None) -> int:
    """Delete failed sign-in attempts whose lockout window has passed; returns how many.

    django-axes clears them only when someone signs in again, so without this sweep the
    email, address and user agent of an old failure would stay for good.
    """
    cutoff = (now or timezone.now()) - settings.AXES_COOLOFF_TIME
    deleted, _ = AccessAttempt.objects.filter(attempt_time__lt=cutoff).delete()
    return deleted


@transaction.atomic
def user_password_set(*, actor: Principal, user: User, password: str, via: str) -> User:
    """Set a person's password after Django's AUTH_PASSWORD_VALIDATORS accept it.

    Audited in every organization the person belongs to (``via`` says how), never with the
    password. Setting it also ends any sign-in link they were given: the link's token is a
    hash over the stored password.
    """
    if not password:
        raise ValidationFailed("The password is empty.", details={"password": ["empty"]})
    try:
        validate_password(password, user=user)
    except ValidationError as exc:
        raise ValidationFailed(
            "That password is not accepted: " + " ".join(exc.messages),
            details={"password": exc.messages},
        ) from None
    user.set_password(password)
    user.save(update_fields=["password"])
    for membership in user.memberships.select_related("organization"):
        audit_record(
            organization=membership.organization,
            actor=actor,
            action="user.password_set",
            target=user,
            data={"via": via},
        )
    return user


def audit_authentication_failure(plaintext: str) -> None:
    """Record a failed sign-in with a token the organization really issued.

    Only the full secret of a known token counts: a wrong secret, an unknown key id or a
    malformed value is noise anyone can send, and recording it in the named organization
    would let outsiders write into (and flood) a log they cannot read.
    """
    key_id = tokens.parse_key_id(plaintext)
    if key_id is None:
        return
    token = ApiToken.objects.select_related("organization", "user").filter(key_id=key_id).first()
    if token is None or not tokens.matches(plaintext, token.secret_hash):
        return
    reason = _token_refusal_reason(token, now=timezone.now())
    if reason is None:
        return
    audit_refusal_record(
        organization=token.organization,
        actor=Principal(PrincipalKind.TOKEN, user=token.user, token=token),
        action="auth.refused",
        target=token,
        data={"reason": reason},
    )


def _token_refusal_reason(token, *, now: datetime) -> str | None:
    if token.revoked_at is not None:
        return "revoked"
    if token.expires_at <= now:
        return "expired"
    if token.user is not None and not token.user.is_active:
        return "user_inactive"
    return None
