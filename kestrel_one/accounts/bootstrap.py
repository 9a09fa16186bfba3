"""Creating (or reusing) an organization with its owner and a fresh owner token."""

from __future__ import annotations

import secrets

from django.db import transaction

from kestrel_one.accounts.principal import system_principal
from kestrel_one.accounts.scopes import SCOPES, Role
from kestrel_one.accounts.services import token_create, user_get_or_create
from kestrel_one.common.errors import Conflict
from kestrel_one.tenancy.models import Membership, Organization
from kestrel_one.tenancy.services import membership_add, organization_create


@transaction.atomic
def bootstrap(*, org_slug: str, email: str, set_password: bool = False) -> dict:
    """Return ``{"org", "user", "token"}`` and, with ``set_password``, a new password."""
    actor = system_principal("bootstrap")
    user, _ = user_get_or_create(email=email)
    password = None
    if set_password:
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
    _, plaintext = token_create(
        actor=actor,
        organization=organization,
        name="bootstrap",
        scopes=sorted(SCOPES),
        user=user,
    )
    result = {"org": organization.slug, "user": user.email, "token": plaintext}
    if password:
        result["password"] = password
    return result
