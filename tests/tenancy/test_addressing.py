"""Which organization a request may address (``organization_addressed``): what
``Organization.objects.visible_to`` allows, read for a person together with the membership
their role and scopes come from."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from kestrel_one.accounts.principal import Principal, PrincipalKind
from kestrel_one.accounts.scopes import Role
from kestrel_one.tenancy.models import Membership, Organization
from kestrel_one.tenancy.selectors import organization_addressed
from tests.factories import MembershipFactory


def token_principal(actor) -> Principal:
    return Principal(PrincipalKind.TOKEN, user=actor.user, token=actor.token)


def test_a_person_gets_the_organization_and_the_role_in_one_query(world):
    principal = token_principal(world["member"])
    with CaptureQueriesContext(connection) as captured:
        organization = organization_addressed(principal, "acme")
        role = principal.role_in(organization)
        scopes = principal.scopes_in(organization)
    assert organization == world.org
    assert role == Role.MEMBER and "projects:write" in scopes
    assert len(captured.captured_queries) == 1


def test_it_allows_exactly_what_visible_to_allows(world):
    # The member of acme also joins globex: their acme token still addresses acme only.
    member = world["member"]
    MembershipFactory(organization=world.other_org, user=member.user, role=Role.OWNER)
    integration = world.agent
    cases = [
        (token_principal(member), "acme"),
        (token_principal(member), "globex"),
        (token_principal(member), "nowhere"),
        (token_principal(world["outsider"]), "acme"),
        (token_principal(world["outsider"]), "globex"),
        (integration, "acme"),
        (integration, "globex"),
        (Principal(PrincipalKind.SESSION), "acme"),
    ]
    for principal, slug in cases:
        expected = Organization.objects.visible_to(principal).filter(slug=slug).first()
        assert organization_addressed(principal, slug) == expected, (principal, slug)
    assert organization_addressed(token_principal(member), "globex") is None
    assert organization_addressed(integration, "acme") == world.org

    # A person who left the organization addresses it no more, whatever their token says.
    Membership.objects.filter(user=member.user, organization=world.org).delete()
    assert organization_addressed(token_principal(member), "acme") is None


def test_a_principal_keeps_only_its_own_membership(world):
    principal = token_principal(world["member"])
    other = Membership.objects.get(user=world["owner"].user, organization=world.org)
    with pytest.raises(ValueError):
        principal.membership_known(other)
    assert principal.role_in(world.org) == Role.MEMBER
