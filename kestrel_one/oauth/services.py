"""Writes of the OAuth flow: a person's consent becomes a one-time code; the code (and later
the refresh token) becomes a Kestrel API token limited to one Project.

Authority is the consenting person's: every token is theirs (``ApiToken.user``), limited to the
Project they chose, with at most ``OAUTH_SCOPES`` and only those their role still holds when
it is minted. Nothing here can put ``actions:approve`` or an administrative scope on a token.
Secrets (codes, refresh tokens) are kept as SHA-256 digests; the access token is an ApiToken,
hashed at rest by accounts.
"""

from __future__ import annotations

import hashlib
import re
from datetime import datetime, timedelta
from urllib.parse import urlsplit

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from kestrel_one.accounts.models import AUDIENCE_MCP, ApiToken
from kestrel_one.accounts.principal import Principal, PrincipalKind
from kestrel_one.accounts.services import token_create, token_revoke
from kestrel_one.accounts.tokens import matches, parse_key_id
from kestrel_one.audit.services import audit_record
from kestrel_one.common.errors import KestrelError
from kestrel_one.oauth.models import (
    AuthorizationCode,
    ClientRegistration,
    OAuthGrant,
    RetiredRefreshToken,
)
from kestrel_one.tenancy.models import Project

# The most an OAuth client is ever given: read and work in one Project. Never
# actions:approve (authority stays with the person in the console) nor any admin scope.
OAUTH_SCOPES = ("projects:read", "projects:write")
# Where a client may be sent back to.
REDIRECT_SCHEMES = ["https", "http"]
# What S256 makes of any verifier: 32 bytes, base64url without padding (RFC 7636 4.2).
S256_CHALLENGE = re.compile(r"[A-Za-z0-9_-]{43}")
# A host name or an IP address, as a CSP source may name one (nothing that ends a directive).
_CSP_HOST = re.compile(r"[a-z0-9.-]+|[0-9a-f:.]+")


class GrantRefused(Exception):
    """The code or refresh token can no longer become a token; the message says why."""


def secret_digest(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def consenting_person(user) -> Principal:
    """The person whose consent (given in a signed-in console session) a token carries."""
    return Principal(PrincipalKind.SESSION, user=user)


def redirect_host(redirect_uri: str) -> str:
    parts = urlsplit(redirect_uri)
    return parts.netloc or redirect_uri[:100]


def redirect_origin(redirect_uri: str) -> str | None:
    """The origin of a client's redirect address as a CSP source (``http://127.0.0.1:8765``),
    or None for anything that is not a plain http(s) host and port."""
    parts = urlsplit(redirect_uri)
    try:
        port = parts.port
    except ValueError:
        return None
    host = parts.hostname or ""
    if parts.scheme not in REDIRECT_SCHEMES or not _CSP_HOST.fullmatch(host):
        return None
    host = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{host}" + (f":{port}" if port is not None else "")


@transaction.atomic
def client_register(*, name: str, redirect_uris: list[str], remote_addr: str | None):
    """A public client (no secret) for the authorization code grant. It holds no authority:
    only a person's consent on the authorize page gives it a token."""
    from oauth2_provider.models import get_application_model

    application_model = get_application_model()
    application = application_model.objects.create(
        name=name,
        client_type=application_model.CLIENT_PUBLIC,
        authorization_grant_type=application_model.GRANT_AUTHORIZATION_CODE,
        redirect_uris=" ".join(redirect_uris),
        skip_authorization=False,
        user=None,
        client_secret="",
        hash_client_secret=False,
    )
    ClientRegistration.objects.create(application=application, remote_addr=remote_addr)
    return application


def registrations_since(*, since: datetime, remote_addr: str | None) -> tuple[int, int]:
    """(from this address, from anywhere) registrations since ``since``."""
    recent = ClientRegistration.objects.filter(created_at__gte=since)
    return recent.filter(remote_addr=remote_addr).count(), recent.count()


@transaction.atomic
def authorization_code_create(
    *,
    actor: Principal,
    application,
    project: Project,
    scopes: list[str],
    resource: str,
    redirect_uri: str,
    code: str,
    code_challenge: str,
) -> AuthorizationCode:
    """Record a person's consent as a one-time code (its digest only), audited."""
    if not set(scopes) <= set(OAUTH_SCOPES) or not scopes:
        raise GrantRefused("An OAuth client may hold projects:read and projects:write only.")
    row = AuthorizationCode.objects.create(
        code_hash=secret_digest(code),
        application=application,
        user=actor.user,
        project=project,
        scopes=sorted(scopes),
        resource=resource,
        redirect_uri=redirect_uri,
        code_challenge=code_challenge,
        expires_at=timezone.now() + settings.KESTREL_OAUTH_CODE_TTL,
    )
    audit_record(
        organization=project.organization,
        actor=actor,
        action="oauth.consent",
        target=project,
        data={
            "client_id": application.client_id,
            "client_name": application.name,
            "redirect_host": redirect_host(redirect_uri),
            "scopes": sorted(scopes),
        },
    )
    return row


def authorization_code_claim(*, application, code: str) -> AuthorizationCode | None:
    """The code, now used, if it was unused and unexpired; else None.

    Claimed at once (one UPDATE), before the verifier is checked: a code is good for one
    attempt, so a stolen one cannot be tried against verifiers. A code presented again
    revokes what it produced (RFC 6749 section 4.1.2).
    """
    row = (
        AuthorizationCode.objects.select_related("user", "project__organization")
        .filter(code_hash=secret_digest(code), application=application)
        .first()
    )
    if row is None:
        return None
    now = timezone.now()
    claimed = AuthorizationCode.objects.filter(
        pk=row.pk, used_at__isnull=True, expires_at__gt=now
    ).update(used_at=now)
    if claimed:
        return row
    grant = OAuthGrant.objects.filter(code=row).first()
    if row.used_at is not None and grant is not None:
        oauth_grant_revoke(grant=grant, reason="code_reused")
    return None


def _mint(
    grant: OAuthGrant, scopes: list[str], replacing: ApiToken | None = None
) -> tuple[ApiToken, str, list[str]]:
    """A fresh API token for the grant: the person's, for the one Project, with the grant's
    scopes that the person's role still holds. Refused if they no longer see the Project.
    Replacing the grant's previous token, it is the same agent (``ApiToken.lineage``): what
    that one requested it cannot approve, and the MCP sessions it opened stay the client's."""
    person = consenting_person(grant.user)
    organization = grant.project.organization
    if not grant.user.is_active:
        raise GrantRefused("The person who allowed this client can no longer sign in.")
    if not Project.objects.visible_to(person, organization).filter(pk=grant.project_id).exists():
        raise GrantRefused("The person who allowed this client no longer sees the Project.")
    held = person.scopes_in(organization)
    granted = sorted(s for s in scopes if s in held and s in OAUTH_SCOPES and s in grant.scopes)
    if not granted:
        raise GrantRefused("The person's role no longer allows any of the scopes granted.")
    name = f"OAuth: {grant.application.name or grant.application.client_id}"[:200]
    try:
        token, plaintext = token_create(
            actor=person,
            organization=organization,
            name=name,
            scopes=granted,
            expires_at=timezone.now() + settings.KESTREL_OAUTH_ACCESS_TOKEN_TTL,
            limit_to_projects=[grant.project],
            audience=AUDIENCE_MCP,
            replacing=replacing,
        )
    except KestrelError as error:
        raise GrantRefused(str(error)) from None
    return token, plaintext, granted


@transaction.atomic
def oauth_tokens_issue(*, code: AuthorizationCode, refresh_token: str):
    """The first token of a consent, from its claimed code; returns (grant, plaintext, scopes)."""
    grant = OAuthGrant.objects.create(
        application=code.application,
        user=code.user,
        project=code.project,
        scopes=code.scopes,
        resource=code.resource,
        code=code,
        refresh_hash=secret_digest(refresh_token),
        refresh_expires_at=timezone.now() + settings.KESTREL_OAUTH_REFRESH_TOKEN_TTL,
    )
    token, plaintext, scopes = _mint(grant, code.scopes)
    grant.api_token = token
    grant.save(update_fields=["api_token"])
    return grant, plaintext, scopes


def oauth_grant_for_refresh(*, application, refresh_token: str) -> OAuthGrant | None:
    """The live grant this refresh token renews. A refresh token already rotated away (any
    of them, not only the last) is a replay (someone else holds a copy): the grant ends, for
    the client and the thief alike."""
    digest = secret_digest(refresh_token)
    grants = OAuthGrant.objects.select_related(
        "user", "project__organization", "application", "api_token"
    )
    grant = grants.filter(
        refresh_hash=digest,
        application=application,
        revoked_at__isnull=True,
        refresh_expires_at__gt=timezone.now(),
    ).first()
    if grant is not None and (grant.api_token is None or grant.api_token.revoked_at is not None):
        # The person revoked the client's token (the Tokens page): that ends the consent.
        oauth_grant_revoke(grant=grant, reason="token_revoked")
        return None
    if grant is None:
        replayed = grants.filter(
            retired__refresh_hash=digest, application=application, revoked_at__isnull=True
        ).first()
        if replayed is not None:
            oauth_grant_revoke(grant=replayed, reason="refresh_token_replayed")
    return grant


@transaction.atomic
def oauth_tokens_refresh(
    *, grant: OAuthGrant, refresh_token: str, new_refresh_token: str, scopes: list[str]
):
    """Rotate the refresh token and mint a fresh API token; the previous one is revoked."""
    now = timezone.now()
    rotated = OAuthGrant.objects.filter(
        pk=grant.pk, refresh_hash=secret_digest(refresh_token), revoked_at__isnull=True
    ).update(
        refresh_hash=secret_digest(new_refresh_token),
        refreshed_at=now,
        refresh_expires_at=now + settings.KESTREL_OAUTH_REFRESH_TOKEN_TTL,
    )
    if not rotated:
        raise GrantRefused("The refresh token was already used or revoked.")
    RetiredRefreshToken.objects.create(grant=grant, refresh_hash=secret_digest(refresh_token))
    previous = grant.api_token
    token, plaintext, granted = _mint(grant, scopes, replacing=previous)
    OAuthGrant.objects.filter(pk=grant.pk).update(api_token=token)
    if previous is not None and previous.revoked_at is None:
        token_revoke(actor=consenting_person(grant.user), token=previous)
    return grant, plaintext, granted


@transaction.atomic
def oauth_grant_revoke(*, grant: OAuthGrant, reason: str) -> None:
    """End a consent: its refresh token stops working and its API token is revoked."""
    updated = OAuthGrant.objects.filter(pk=grant.pk, revoked_at__isnull=True).update(
        revoked_at=timezone.now()
    )
    person = consenting_person(grant.user)
    token = ApiToken.objects.filter(pk=grant.api_token_id).first()
    if token is not None and token.revoked_at is None:
        token_revoke(actor=person, token=token)
    if updated:
        audit_record(
            organization=grant.project.organization,
            actor=person,
            action="oauth.revoke",
            target=grant.project,
            data={"client_id": grant.application.client_id, "reason": reason},
        )


def oauth_token_revoke(*, application, token: str) -> None:
    """RFC 7009: revoke the consent an access or refresh token of this client belongs to.
    A token that is not this client's (or not a token at all) changes nothing."""
    grant = None
    key_id = parse_key_id(token)
    if key_id is not None:
        candidate = (
            OAuthGrant.objects.select_related("api_token", "application", "project__organization")
            .filter(application=application, api_token__key_id=key_id)
            .first()
        )
        if candidate is not None and matches(token, candidate.api_token.secret_hash):
            grant = candidate
    else:
        grant = (
            OAuthGrant.objects.select_related("application", "project__organization")
            .filter(application=application, refresh_hash=secret_digest(token))
            .first()
        )
    if grant is not None:
        oauth_grant_revoke(grant=grant, reason="client_revoked")


# How long a used or expired code is kept: presented again within it, it revokes what it gave.
CODE_KEPT_AFTER_EXPIRY = timedelta(days=1)


def authorization_codes_trim(*, now: datetime) -> int:
    """Delete codes expired more than ``CODE_KEPT_AFTER_EXPIRY`` ago (a grant keeps its
    tokens); how many."""
    old = AuthorizationCode.objects.filter(expires_at__lt=now - CODE_KEPT_AFTER_EXPIRY)
    deleted = old.count()
    old.delete()
    return deleted
