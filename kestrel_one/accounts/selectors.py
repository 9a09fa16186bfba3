"""Reads for API tokens: which tokens a caller sees in an organization."""

from __future__ import annotations

from django.db.models import QuerySet

from kestrel_one.accounts.models import ApiToken


def tokens_visible_to(*, principal, organization) -> QuerySet[ApiToken]:
    """Everyone sees their own tokens; ``tokens:admin`` sees every token of the organization.
    The API and the console's tokens page both list (and revoke) through this."""
    queryset = (
        ApiToken.objects.filter(organization=organization)
        .select_related("user", "parent")
        .prefetch_related("projects")
    )
    if "tokens:admin" in principal.scopes_in(organization):
        return queryset
    if principal.user is None:
        return queryset.none()
    return queryset.filter(user=principal.user)
