"""Reads for API tokens: which tokens a caller sees in an organization."""

from __future__ import annotations

from django.apps import apps
from django.db.models import Exists, OuterRef, QuerySet

from kestrel_one.accounts.models import ApiToken

# How many of a person's integration tokens a member's page and removal record name.
MADE_BY_LISTED = 50


def _creator_is_member():
    """Whether a token's creator is still a member of its organization (through the app
    label: accounts names no tenancy module)."""
    membership = apps.get_model("tenancy", "Membership")
    return Exists(
        membership.objects.filter(
            user=OuterRef("created_by"), organization=OuterRef("organization")
        )
    )


def tokens_visible_to(*, principal, organization) -> QuerySet[ApiToken]:
    """Everyone sees their own tokens; ``tokens:admin`` sees every token of the organization.
    The API and the console's tokens page both list (and revoke) through this."""
    queryset = (
        ApiToken.objects.filter(organization=organization)
        .select_related("user", "parent", "created_by")
        .prefetch_related("projects")
        .annotate(made_by_member=_creator_is_member())
    )
    if "tokens:admin" in principal.scopes_in(organization):
        return queryset
    if principal.user is None:
        return queryset.none()
    return queryset.filter(user=principal.user)


def integration_tokens_made_by(*, user, organization) -> list[ApiToken]:
    """The integration tokens ``user`` made in ``organization`` that still work, newest
    first, at most ``MADE_BY_LISTED``. They belong to the organization, so they outlive
    their maker's membership; whoever removes the maker should know of them (they saw each
    secret once)."""
    return list(
        ApiToken.objects.active()
        .filter(organization=organization, user__isnull=True, created_by=user)
        .order_by("-created_at", "-pk")[:MADE_BY_LISTED]
    )
