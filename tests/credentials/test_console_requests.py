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


@pytest.mark.spec("API-6", "TEN-4")
@pytest.mark.parametrize(
    "path",
    [
        "/console/acme/credentials/%00/revoke",
        "/console/acme/connections/con_%00/revoke",
        "/console/acme/projects/prj_%00/usage",
    ],
)
def test_an_id_no_row_can_hold_is_the_console_404(world, signed_in, path):
    assert signed_in.post(path, {}).status_code == 404


@pytest.mark.spec("API-6", "TEN-4")
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("get", "/api/v1/orgs/acme/credentials/crd_%00"),
        ("delete", "/api/v1/orgs/acme/credentials/%00"),
        ("post", "/api/v1/orgs/acme/credentials/%00/rotate"),
        ("get", "/api/v1/orgs/acme/connections/con_%00"),
        ("post", "/api/v1/orgs/acme/projects/prj_%00/model/v1/chat/completions"),
        ("get", "/api/v1/orgs/acme/projects/prj_%00/model/budget"),
        ("get", "/api/v1/orgs/acme/projects/prj_%00/model/usage"),
    ],
)
def test_an_id_no_row_can_hold_is_the_api_404(world, method, path):
    client = world["admin"].client()
    answer = getattr(client, method)(path, {"secret": "ghp_NeverStored000"}, format="json")
    assert answer.status_code == 404, answer.content
    missing = client.get("/api/v1/orgs/acme/credentials/crd_01HZZZZZZZZZZZZZZZZZZZZZZZ")
    # The same answer as a missing one (TEN-4); the OpenAI endpoint adds its type and param.
    error, expected = answer.json()["error"], missing.json()["error"]
    assert (error["code"], error["message"]) == (expected["code"], expected["message"])
