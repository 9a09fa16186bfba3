"""A personal App connection is its owner's alone (TEN-5)."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from kestrel_one.accounts.principal import Principal, PrincipalKind, system_principal
from kestrel_one.accounts.services import token_create
from kestrel_one.credentials.models import Connection
from kestrel_one.credentials.release import (
    CredentialRefused,
    credential_default,
    reference_check,
    secret_release,
)
from kestrel_one.credentials.services import credential_create, credential_revoke
from kestrel_one.tenancy.models import Membership
from tests.credentials.helpers import assert_secret_free
from tests.factories import MembershipFactory

SECRET = "ghp_PersonalConnectionSecretAAAA1111"
URL = "/api/v1/orgs/acme/connections"
MISSING = "con_00000000000000000000000000"


def _connect(world, name="member", adapter="github"):
    response = world[name].client().post(URL, {"adapter": adapter, "secret": SECRET}, format="json")
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["id"].startswith("con_") and body["fingerprint"] and "secret" not in body
    assert_secret_free(response.content, SECRET)
    return body["id"]


def _refusal(world, connection_id, *, user, token, adapter="github"):
    with pytest.raises(CredentialRefused) as refused:
        reference_check(
            organization=world.org,
            adapter=adapter,
            reference={"connection": connection_id},
            user=user,
            token=token,
        )
    with pytest.raises(CredentialRefused) as released:
        secret_release(
            organization=world.org,
            adapter=adapter,
            reference={"connection": connection_id},
            user=user,
            token=token,
        )
    assert (refused.value.code, refused.value.message) == (
        released.value.code,
        released.value.message,
    )
    assert_secret_free(str(refused.value), SECRET)
    # Exactly the refusal a connection that does not exist gets.
    return refused.value.code, refused.value.message.replace(connection_id, "<id>")


def _missing(world, adapter="github"):
    return _refusal(world, MISSING, user=world["member"].user, token=None, adapter=adapter)


@pytest.mark.spec("TEN-5")
def test_the_owner_and_their_own_tokens_may_use_it(world):
    connection_id = _connect(world)
    owner = world["member"]
    ref = {"connection": connection_id}
    reference_check(
        organization=world.org, adapter="github", reference=ref, user=owner.user, token=owner.token
    )
    # An agent's token the person made for themselves acts for them.
    agent_token, _ = token_create(
        actor=Principal(PrincipalKind.TOKEN, user=owner.user, token=owner.token),
        organization=world.org,
        name="my agent",
        scopes=["projects:read", "projects:write"],
        user=owner.user,
    )
    released = secret_release(
        organization=world.org, adapter="github", reference=ref, user=None, token=agent_token
    )
    assert released.secret == SECRET and released.record == connection_id
    assert released.kind == "github_token"
    assert SECRET not in repr(released)


@pytest.mark.spec("TEN-5")
def test_nobody_else_can_see_it(world):
    connection_id = _connect(world)
    for name in ("owner", "admin", "limited"):
        client = world[name].client()
        listed = client.get(URL)
        assert listed.status_code == 200
        assert connection_id not in listed.content.decode()
        hidden = client.get(f"{URL}/{connection_id}")
        missing = client.get(f"{URL}/{MISSING}")
        assert hidden.status_code == missing.status_code == 404
        assert hidden.content == missing.content
    mine = world["member"].client().get(URL).json()["results"]
    assert [c["id"] for c in mine] == [connection_id]


@pytest.mark.spec("TEN-5")
def test_nobody_else_can_use_it_not_even_with_their_tokens(world):
    connection_id = _connect(world)
    missing = _missing(world)
    integration, _ = token_create(
        actor=system_principal("tests"),
        organization=world.org,
        name="integration",
        scopes=["projects:read", "projects:write"],
        integration=True,
    )
    other = world["limited"]
    owner_of_org = world["owner"]
    attempts = [
        {"user": other.user, "token": None},
        {"user": None, "token": other.token},
        {"user": owner_of_org.user, "token": owner_of_org.token},
        {"user": None, "token": integration},
        {"user": None, "token": None},
        # The owner's name with someone else's token: the two must agree.
        {"user": world["member"].user, "token": other.token},
    ]
    for attempt in attempts:
        assert _refusal(world, connection_id, **attempt) == missing
    # Another organization cannot reach it either.
    with pytest.raises(CredentialRefused) as refused:
        reference_check(
            organization=world.other_org,
            adapter="github",
            reference={"connection": connection_id},
            user=world["member"].user,
            token=None,
        )
    assert refused.value.code == "credential_not_found"


@pytest.mark.spec("TEN-5")
def test_nobody_can_rebind_it_to_another_person_or_adapter(world):
    connection_id = _connect(world)
    detail = f"{URL}/{connection_id}"
    for name in ("owner", "admin", "limited"):
        client = world[name].client()
        missing = client.delete(f"{URL}/{MISSING}")
        revoked = client.delete(detail)
        assert revoked.status_code == missing.status_code == 404
        assert revoked.content == missing.content
    for method in ("patch", "put"):
        response = getattr(world["member"].client(), method)(
            detail, {"adapter": "slack"}, format="json"
        )
        assert response.status_code == 405
    # Used for another adapter it is the same as missing, even by its owner.
    owner = world["member"]
    assert _refusal(world, connection_id, user=owner.user, token=None, adapter="slack") == (
        _missing(world, adapter="slack")
    )
    row = Connection.objects.get(public_id=connection_id)
    assert row.owner_id == owner.user.pk and row.adapter == "github" and row.revoked_at is None


@pytest.mark.spec("TEN-5")
def test_it_stops_working_when_its_owner_leaves_and_stays_dead_after_a_return(world):
    connection_id = _connect(world)
    member = world["member"]
    removed = (
        world["owner"].client().delete(f"/api/v1/orgs/acme/members/{member.membership.public_id}")
    )
    assert removed.status_code == 204, removed.content
    row = Connection.objects.get(public_id=connection_id)
    assert row.revoked_reason == "owner_left" and row.revoked_at is not None
    assert bytes(row.secret_ciphertext) == b""
    missing = _missing(world)
    assert _refusal(world, connection_id, user=member.user, token=None) == missing
    MembershipFactory(organization=world.org, user=member.user, role="member")
    assert _refusal(world, connection_id, user=member.user, token=None) == missing


@pytest.mark.spec("TEN-5")
def test_a_connection_whose_owner_has_no_membership_is_refused_even_before_the_revoke(world):
    """The release checks the membership itself, not only the revoke that removal makes."""
    connection_id = _connect(world)
    member = world["member"]
    Membership.objects.filter(pk=member.membership.pk).update(organization=world.other_org)
    assert _refusal(world, connection_id, user=member.user, token=None) == _missing(world)


@pytest.mark.spec("TEN-5")
def test_the_owner_revokes_it(world):
    connection_id = _connect(world)
    client = world["member"].client()
    assert client.delete(f"{URL}/{connection_id}").status_code == 204
    assert client.get(f"{URL}/{connection_id}").json()["state"] == "revoked"
    assert _refusal(world, connection_id, user=world["member"].user, token=None) == _missing(world)


@pytest.mark.spec("TEN-5")
def test_an_integration_token_cannot_make_a_connection(world):
    _, plaintext = token_create(
        actor=system_principal("tests"),
        organization=world.org,
        name="integration",
        scopes=["connections:write"],
        integration=True,
    )
    client = APIClient(REMOTE_ADDR="203.0.113.7")
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    response = client.post(URL, {"adapter": "github", "secret": SECRET}, format="json")
    assert response.status_code == 403
    assert_secret_free(response.content, SECRET)
    assert not Connection.objects.exists()


@pytest.mark.spec("CRED-1")
def test_org_credentials_are_usable_in_their_organization_for_their_adapter_only(world):
    actor = system_principal("tests")
    assert credential_default(organization=world.org, adapter="github") is None
    first = credential_create(
        actor=actor, organization=world.org, name="gh", adapter="github", secret=SECRET
    )
    assert credential_default(organization=world.org, adapter="github") == first.public_id
    ref = {"credential": first.public_id}
    for organization, adapter in ((world.other_org, "github"), (world.org, "slack")):
        with pytest.raises(CredentialRefused) as refused:
            reference_check(
                organization=organization, adapter=adapter, reference=ref, user=None, token=None
            )
        assert refused.value.code == "credential_not_found"
    for bad in ({}, {"credential": 1}, {"credential": "crd_x", "connection": "con_y"}, "crd_x"):
        with pytest.raises(CredentialRefused) as refused:
            reference_check(
                organization=world.org, adapter="github", reference=bad, user=None, token=None
            )
        assert refused.value.code == "credential_reference_invalid"
    with pytest.raises(CredentialRefused) as refused:
        reference_check(
            organization=world.org, adapter="gitlab", reference=ref, user=None, token=None
        )
    assert refused.value.code == "unknown_adapter"
    credential_create(
        actor=actor, organization=world.org, name="gh2", adapter="github", secret=SECRET
    )
    with pytest.raises(CredentialRefused) as refused:
        credential_default(organization=world.org, adapter="github")
    assert refused.value.code == "credential_ambiguous"
    credential_revoke(actor=actor, credential=first)
    with pytest.raises(CredentialRefused) as refused:
        secret_release(
            organization=world.org, adapter="github", reference=ref, user=None, token=None
        )
    assert refused.value.code == "credential_not_found"
