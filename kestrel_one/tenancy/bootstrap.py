"""Setting up an organization from the server itself: its owner, an owner token, and the
single-host agent token."""

from __future__ import annotations

import secrets

from django.db import transaction

from kestrel_one.accounts.principal import system_principal
from kestrel_one.accounts.scopes import LOCAL_AGENT_SCOPES, SCOPES, Role
from kestrel_one.accounts.services import token_create, user_get_or_create
from kestrel_one.common.errors import Conflict
from kestrel_one.tenancy.models import Membership, Organization
from kestrel_one.tenancy.services import membership_add, organization_create


@transaction.atomic
def bootstrap(*, org_slug: str, email: str, owner_token: bool = True) -> dict:
    """Create (or reuse) the organization and its owner.

    Returns ``{"org", "user"}``, plus ``"token"`` (a new owner token) with ``owner_token``,
    and ``"password"`` when the user was created here, so that person can sign in.
    """
    actor = system_principal("bootstrap")
    user, created = user_get_or_create(email=email)
    password = None
    if created:
        password = secrets.token_urlsafe(18)
        user.set_password(password)
        user.save(update_fields=["password"])
    organization = Organization.objects.filter(slug=org_slug).first()
    if organization is None:
        organization = organization_create(actor=actor, slug=org_slug, name=org_slug, owner=user)
    else:
        membership = Membership.objects.filter(organization=organization, user=user).first()
        if membership is None:
            membership_add(actor=actor, organization=organization, user=user, role=Role.OWNER)
        elif membership.role != Role.OWNER:
            raise Conflict(
                f"{user.email} is already a {membership.role} of '{org_slug}'; "
                "an owner can change the role through the API."
            )
    result = {"org": organization.slug, "user": user.email}
    if owner_token:
        _, result["token"] = token_create(
            actor=actor,
            organization=organization,
            name="bootstrap",
            scopes=sorted(SCOPES),
            user=user,
        )
    if password:
        result["password"] = password
    return result


def agent_token_create(*, org_slug: str) -> str:
    """A token for local agents (no person): it reads, makes threads and requests actions,
    and can never approve, accept a plan, publish a policy or make tokens."""
    _, plaintext = token_create(
        actor=system_principal("serve"),
        organization=Organization.objects.get(slug=org_slug),
        name="local agent",
        scopes=sorted(LOCAL_AGENT_SCOPES),
        integration=True,
    )
    return plaintext
