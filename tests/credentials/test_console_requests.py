"""The credentials console pages meet a request they do not take with an error page, never a
server error: a method a page does not take, an id no row can hold."""

from __future__ import annotations

import pytest

from kestrel_one.accounts.principal import system_principal
from kestrel_one.credentials.services import credential_create


@pytest.fixture
def signed_in(world, client):
    client.force_login(world["admin"].user)
    return client


@pytest.mark.spec("API-6")
@pytest.mark.parametrize(
    "path",
    [
        "/console/acme/credentials/{crd}/rotate",
        "/console/acme/credentials/{crd}/revoke",
        "/console/acme/connections/con_01HZZZZZZZZZZZZZZZZZZZZZZZ/revoke",
    ],
)
def test_a_get_of_a_post_only_page_is_a_405_page(world, signed_in, path):
    credential = credential_create(
        actor=system_principal("tests"),
        organization=world.org,
        name="gh",
        adapter="github",
        secret="ghp_ConsoleMethodSecret00001111",
    )
    answer = signed_in.get(path.format(crd=credential.public_id))
    assert answer.status_code == 405
    assert "does not accept GET requests" in answer.content.decode()
