"""Reads of credentials and connections, scoped the way every surface scopes them."""

from __future__ import annotations

from kestrel_one.credentials.models import Connection, Credential


def credentials_of(organization):
    """The organization's credentials, revoked ones included (their fingerprints stay)."""
    return Credential.objects.for_org(organization).order_by("public_id")


def connections_of(principal, organization):
    """The caller's own connections in the organization, and nobody else's (TEN-5)."""
    return Connection.objects.visible_to(principal, organization).order_by("public_id")
