"""Writes for people and API tokens."""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from typing import Any

from axes.models import AccessAttempt
from django.conf import settings
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from kestrel_one.accounts import tokens
from kestrel_one.accounts.models import AUDIENCE_API, AUDIENCES, ApiToken, User
from kestrel_one.accounts.principal import Principal, PrincipalKind, missing_scope_message
from kestrel_one.accounts.scopes import (
    BEYOND_SOME_PROJECTS,
    ORGANIZATION_SCOPES,
    PERSON_ONLY_SCOPES,
    Role,
    outranks,
    unknown_scopes,
)
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


# ``projects`` left out of token_create: an integration token sees what its creator sees.
AS_CREATOR: Any = object()
CHECK_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,99}$")


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
    projects: Any = AS_CREATOR,
    checks: list[str] | None = None,
    limit_to_projects: list | None = None,
    audience: str = AUDIENCE_API,
    replacing: ApiToken | None = None,
) -> tuple[ApiToken, str]:
    """Create a token and return it with its plaintext, which is never stored or shown again.

    A token can never hold a scope its creator lacks in the organization, nor outlive the
    token that made it; ``actions:approve`` is put on a token only from a console session or
    an operator's command (``PERSON_ONLY_SCOPES``). An integration token sees ``projects``
    (None: every project; left out: what its creator sees), never more than its creator, and
    may record verifications as ``checks``. ``user`` is only for trusted callers (the
    bootstrap command); API callers get a token for themselves or, with ``integration``, for
    no person. ``limit_to_projects`` is for trusted callers too (the OAuth token endpoint): a
    person's token that sees only those projects, each one the person sees; and so is
    ``audience`` (``ApiToken.audience``: the OAuth token endpoint's tokens work only on the
    MCP endpoint). A token minted by a token works where its parent does, no further.
    ``replacing`` is for the OAuth token endpoint too: the token a refresh replaces, whose
    agent the new one is (its ``lineage``), as a token minted by a token is.
    """
    if audience not in AUDIENCES:
        raise ValidationFailed(f"Unknown token audience: {audience!r}.")
    if actor.token is not None and actor.token.audience:
        audience = actor.token.audience
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
        why = ""
        if set(exceeding) <= ORGANIZATION_SCOPES and actor.limited_in(organization):
            why = f" Each {BEYOND_SOME_PROJECTS}."
        raise PermissionDenied(
            f"You cannot grant scope(s) you do not hold: {', '.join(exceeding)}.{why}"
        )
    if integration and "tokens:admin" not in held:
        # Integration tokens are made with tokens:admin; the message says why it is missing.
        raise PermissionDenied(missing_scope_message(actor, "tokens:admin", organization))
    if integration and "actions:approve" in scopes:
        raise ValidationFailed(
            "Integration tokens cannot approve: approvals are made by people.",
            details={"scopes": ["actions:approve needs a person"]},
        )
    person_only = sorted(PERSON_ONLY_SCOPES & set(scopes))
    if person_only and actor.kind not in {PrincipalKind.SESSION, PrincipalKind.SYSTEM}:
        raise PermissionDenied(
            f"The scope(s) {', '.join(person_only)} can be put on a token only by a person "
            f"signed in to the console (/console/{organization.slug}/tokens) or by an operator "
            "on the server, never by another token: a token minted by a token is the same "
            "agent.",
            details={"scopes": [f"{scope}: console only" for scope in person_only]},
        )
    if not integration and (projects is not AS_CREATOR or checks):
        raise ValidationFailed(
            "projects and checks are for integration tokens: a person's token sees the "
            "person's projects and never speaks for a check.",
            details={"integration": ["required for projects and checks"]},
        )
    expires_at = _token_expiry(actor, expires_at)
    owner = None if integration else (user or actor.user)
    if owner is None and not integration:
        raise ValidationFailed(
            "This caller is not a person; ask for an integration token instead.",
            details={"integration": ["required for a caller that is not a person"]},
        )
    if (
        limit_to_projects is None
        and not integration
        and actor.token is not None
        and actor.token.limited_to_projects
    ):
        # Minted by a token limited to some projects: the same agent, limited as much.
        limit_to_projects = list(actor.token.projects.all())
    if limit_to_projects is not None and (integration or not limit_to_projects):
        raise ValidationFailed(
            "limit_to_projects names at least one project, and only for a person's token.",
            details={"projects": ["a person's token limited to no project sees nothing"]},
        )
    if integration:
        all_projects, chosen = _token_projects(actor, organization, projects)
    elif limit_to_projects is not None:
        all_projects, chosen = _token_projects(actor, organization, limit_to_projects)
    else:
        all_projects, chosen = False, []
    organization_wide = sorted(ORGANIZATION_SCOPES & set(scopes))
    if organization_wide and not all_projects and (integration or limit_to_projects is not None):
        raise ValidationFailed(
            f"A token limited to some projects cannot hold {', '.join(organization_wide)}: "
            "those act on the whole organization. Give it every project, or leave them out.",
            details={"scopes": [f"{scope}: needs every project" for scope in organization_wide]},
        )
    checks = sorted(set(checks or []))
    _check_bindable(actor, checks)
    plaintext, key_id, secret_hash = tokens.generate()
    token = ApiToken.objects.create(
        organization=organization,
        user=owner,
        created_by=actor.user,
        parent=actor.token,
        name=name,
        key_id=key_id,
        secret_hash=secret_hash,
        scopes=sorted(set(scopes)),
        all_projects=all_projects,
        limited_to_projects=limit_to_projects is not None,
        checks=checks,
        expires_at=expires_at,
        audience=audience,
        lineage=replacing.lineage if replacing is not None else "",
    )
    token.projects.set(chosen)
    data: dict[str, Any] = {
        "name": name,
        "scopes": token.scopes,
        "integration": integration,
        "expires_at": expires_at.isoformat(),
    }
    if actor.token is not None:
        data["parent"] = actor.token.public_id
    if audience:
        data["audience"] = audience
    if integration:
        data["projects"] = "all" if all_projects else sorted(p.public_id for p in chosen)
        data["checks"] = checks
    elif limit_to_projects is not None:
        data["projects"] = sorted(p.public_id for p in chosen)
    audit_record(
        organization=organization, actor=actor, action="token.create", target=token, data=data
    )
    return token, plaintext


def _token_expiry(actor: Principal, expires_at: datetime | None) -> datetime:
    """Within the maximum, and never after the token making it expires (its parent)."""
    now = timezone.now()
    max_expiry = now + settings.KESTREL_TOKEN_MAX_TTL
    parent = actor.token
    if expires_at is None:
        expires_at = now + settings.KESTREL_TOKEN_DEFAULT_TTL
        if parent is not None:
            # Left out: the default, clipped to the parent's expiry.
            expires_at = min(expires_at, parent.expires_at)
    if expires_at <= now or expires_at > max_expiry:
        raise ValidationFailed(
            "expires_at must be in the future and at most "
            f"{settings.KESTREL_TOKEN_MAX_TTL.days} days away.",
            details={"expires_at": ["out of range"]},
        )
    if parent is not None and expires_at > parent.expires_at:
        raise ValidationFailed(
            "expires_at is after the token making this one expires "
            f"({parent.expires_at.isoformat()}): a token never outlives its parent. Ask for "
            "an earlier expiry, or make a longer-lived token from the console.",
            details={"expires_at": [f"after the parent token's expiry {parent.expires_at}"]},
        )
    return expires_at


def _token_projects(actor: Principal, organization, projects) -> tuple[bool, list]:
    """(all_projects, projects) for an integration token (or a person's token limited to
    projects): never wider than its creator's.

    ``organization.projects`` is tenancy's ProjectQuerySet (through the reverse relation, so
    accounts names no tenancy module); its ``limit_of`` is None when the creator sees every
    project, else the projects it is limited to.
    """
    limit = organization.projects.limit_of(actor, organization)
    if projects is AS_CREATOR:
        return (True, []) if limit is None else (False, list(limit))
    if projects is None:
        if limit is not None:
            raise PermissionDenied(
                "You are limited to some projects, so you cannot make a token that sees every "
                "project: name the projects (only ones you can see), or leave projects out.",
                details={"projects": ["all projects is wider than yours"]},
            )
        return True, []
    if limit is not None:
        held = set(limit.values_list("pk", flat=True))
        beyond = sorted(p.public_id for p in projects if p.pk not in held)
        if beyond:
            raise PermissionDenied(
                f"You cannot give a token project(s) you cannot see: {', '.join(beyond)}.",
                details={"projects": beyond},
            )
    return False, list(projects)


def _check_bindable(actor: Principal, checks: list[str]) -> None:
    bad = [name for name in checks if not CHECK_NAME.match(name)]
    if bad:
        raise ValidationFailed(
            "A check name is 1-100 lowercase letters, digits, '.', '_' or '-'.",
            details={"checks": [f"invalid: {name[:100]}" for name in bad]},
        )
    # A token binds only checks it speaks for itself; a person (tokens:admin) binds any.
    if actor.token is not None and actor.token.is_integration:
        unbound = sorted(set(checks) - set(actor.token.checks))
        if unbound:
            raise PermissionDenied(
                f"This token cannot bind check(s) it is not bound to: {', '.join(unbound)}.",
                details={"checks": unbound},
            )


@transaction.atomic
def token_revoke(*, actor: Principal, token: ApiToken) -> ApiToken:
    """Revoke a token. Someone else's person token needs a higher role than that person's
    (owners revoke owners' tokens): an admin cannot lock an owner out of the API."""
    if (
        actor.kind != PrincipalKind.SYSTEM
        and token.user_id is not None
        and (actor.user is None or actor.user.pk != token.user_id)
    ):
        target = token.user.memberships.filter(organization=token.organization).first()
        if target is not None and not outranks(
            actor.role_in(token.organization), Role(target.role)
        ):
            raise PermissionDenied(
                f"Your role cannot revoke the token of a member who is {target.role}."
            )
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
