"""``GET /api/v1/orgs/{org}/audit``: who may read it, filters, pages, projections, tenancy."""

from __future__ import annotations

import base64
from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from kestrel_one.accounts.principal import system_principal
from kestrel_one.accounts.scopes import Role
from kestrel_one.audit.models import AuditChain, AuditRecord
from kestrel_one.audit.selectors import audit_chain_verify
from kestrel_one.audit.services import audit_record
from kestrel_one.tenancy.services import environment_create
from tests.api.routes import BODIES, KWARGS, OWN_REFUSALS, QUERIES, org_scoped_routes
from tests.api.test_cross_tenant import call, fill
from tests.audit.helpers import tampering
from tests.conftest import make_person
from tests.factories import OrganizationFactory

URL = "/api/v1/orgs/acme/audit"
PLANTED = "kst_abcdefghijkl_Zx9Qw8Er7Ty6Ui5Op4As3Df2Gh1Jk0LzXcVbNmQwErTyU"


@pytest.fixture
def auditor(world):
    world.actors["auditor"] = make_person(world.org, Role.AUDITOR, name="auditor")
    return world["auditor"]


def every_page(client, url: str) -> list[dict]:
    items, next_url = [], url
    while next_url:
        response = client.get(next_url)
        assert response.status_code == 200, response.content
        items += response.json()["results"]
        next_url = response.json()["next"]
    return items


@pytest.mark.spec("AUD-7")
def test_owners_admins_and_auditors_read_members_and_viewers_do_not(world, auditor):
    for name in ("owner", "admin", "auditor"):
        response = world[name].client().get(URL)
        assert response.status_code == 200, (name, response.content)
        assert response.json()["results"]
    for name in ("member", "viewer", "limited"):
        response = world[name].client().get(URL)
        assert response.status_code == 403, name
        assert response.json()["error"]["code"] == "permission_denied"
    assert world["outsider"].client().get(URL).status_code == 404
    assert world["anonymous"].client().get(URL).status_code == 401


def test_an_auditor_changes_nothing(world, auditor):
    client = auditor.client()
    env = world.environment.public_id
    attempts = [
        client.post("/api/v1/orgs/acme/members", {"email": "x@y.z", "role": "viewer"}),
        client.patch(f"/api/v1/orgs/acme/environments/{env}", {"description": "x"}),
        client.put(
            f"/api/v1/orgs/acme/environments/{env}/policy", {"capabilities": {}}, format="json"
        ),
        client.post("/api/v1/orgs/acme/projects", {"name": "p", "environment": env}),
        client.delete(f"/api/v1/orgs/acme/runners/{world.runner.public_id}"),
    ]
    assert [response.status_code for response in attempts] == [403] * len(attempts)


def test_an_admin_can_appoint_an_auditor(world):
    response = (
        world["admin"]
        .client()
        .post(
            "/api/v1/orgs/acme/members",
            {"email": "aud@acme.example.com", "role": "auditor"},
            format="json",
        )
    )
    assert response.status_code == 201, response.content
    assert response.json()["role"] == "auditor"


@pytest.mark.spec("AUD-1", "AUD-2")
def test_filters_narrow_the_log(world):
    owner = world["owner"].client()
    member_token = world["member"].token.public_id
    every = every_page(owner, URL)
    assert {item["action"] for item in every} >= {"token.create", "runner.enroll"}

    by_action = every_page(owner, f"{URL}?action=token.create")
    assert by_action and {item["action"] for item in by_action} == {"token.create"}
    family = every_page(owner, f"{URL}?action=token.*")
    assert {item["action"] for item in family} <= {"token.create", "token.revoke"}

    by_target = every_page(owner, f"{URL}?target={member_token}")
    assert by_target and {item["target"]["id"] for item in by_target} == {member_token}

    world["member"].client().post("/api/v1/orgs/acme/members", {"email": "a@b.c", "role": "viewer"})
    refused = every_page(owner, f"{URL}?outcome=refused")
    assert [item["actor"]["id"] for item in refused] == [member_token]
    by_actor = every_page(owner, f"{URL}?actor={member_token}")
    assert [item["id"] for item in by_actor] == [item["id"] for item in refused]

    newest = every[0]["created_at"]
    assert every_page(owner, f"{URL}?since={newest}")[-1]["created_at"] == newest
    future = (timezone.now() + timedelta(days=1)).isoformat()
    past = (timezone.now() - timedelta(days=1)).isoformat()
    assert every_page(owner, f"{URL}?since={future}".replace("+", "%2B")) == []
    assert every_page(owner, f"{URL}?until={past}".replace("+", "%2B")) == []
    window = every_page(owner, f"{URL}?since={past}&until={future}".replace("+", "%2B"))
    assert len(window) == len(every_page(owner, URL))
    # Blank filters, as an empty form field sends them, filter nothing.
    blank = every_page(owner, f"{URL}?actor=&action=&target=&outcome=&since=&until=")
    assert [item["id"] for item in blank] == [item["id"] for item in every_page(owner, URL)]


def test_bad_filters_are_a_400_naming_them(world):
    owner = world["owner"].client()
    for query, field in [
        ("since=yesterday", "since"),
        ("target=" + "x" * 100, "target"),
        ("colour=blue", "colour"),
        ("since=2026-01-02T00:00:00Z&until=2026-01-01T00:00:00Z", "until"),
    ]:
        response = owner.get(f"{URL}?{query}")
        assert response.status_code == 400, query
        assert field in response.json()["error"]["details"], query


def test_cursor_pages_walk_the_log_newest_first_without_repeats(world):
    append = system_principal("tests")
    with transaction.atomic():
        for index in range(30):
            audit_record(
                organization=world.org, actor=append, action="test.page", data={"i": index}
            )
    items = every_page(world["owner"].client(), f"{URL}?limit=7")
    sequences = [item["sequence"] for item in items]
    assert sequences == sorted(sequences, reverse=True)
    assert len(set(sequences)) == len(sequences) == world.org.audit_records.count()
    first = items[-1]
    assert first["sequence"] == 1 and first["prev_hash"] == "0" * 64
    assert all(len(item["hash"]) == 64 for item in items)


@pytest.mark.spec("API-6")
@pytest.mark.parametrize(
    ("url", "raw"),
    [
        (URL, "p=abc"),
        (URL, "p=1e400"),
        *(
            (url, raw)
            for url in (URL, "/api/v1/orgs/acme/artifacts", "/api/v1/orgs/acme/webhooks")
            for raw in ("p=%00", "o=5&p=%00", "o=x", "not base64!")
        ),
    ],
)
def test_a_hand_edited_cursor_is_a_400_naming_it(world, url, raw):
    """A cursor is opaque but only base64: one edited to a position the ordering field cannot
    hold (a word where the audit log orders by sequence, a NUL) was a 500, and one that does
    not decode a 404 that blamed the organization slug."""
    cursor = raw if " " in raw else base64.b64encode(raw.encode()).decode()
    response = world["owner"].client().get(url, {"cursor": cursor})
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["code"] == "invalid" and "cursor" in error["details"], error
    assert "next" in error["message"], error


@pytest.mark.spec("AUD-2", "CRED-1")
def test_items_are_redacted_bounded_projections(world):
    with transaction.atomic():
        record = audit_record(
            organization=world.org,
            actor=system_principal("tests"),
            action="test.secret",
            data={"note": f"used {PLANTED}", "huge": "y" * 50_000, "password": "hunter2"},
        )
    # A row written before today's rules (or by hand) still leaves redacted.
    with tampering():
        AuditRecord.objects.filter(pk=record.pk).update(data={"legacy": f"Bearer {PLANTED}"})
    response = world["owner"].client().get(f"{URL}?action=test.secret")
    text = response.content.decode()
    assert PLANTED not in text and "hunter2" not in text
    assert "[redacted]" in text
    assert len(text) < 8000
    stored = AuditRecord.objects.filter(action="test.secret").values_list("data", flat=True)
    assert PLANTED in str(stored[0]), "the stored row was raw: the projection redacted it"


def test_stored_data_is_redacted_and_bounded_at_write(world):
    with transaction.atomic():
        record = audit_record(
            organization=world.org,
            actor=system_principal("tests"),
            action="test.secret",
            data={"note": f"used {PLANTED}", "huge": "y" * 50_000, "api_key": "abc"},
        )
    record.refresh_from_db()
    assert PLANTED not in str(record.data)
    assert record.data["api_key"] == "[redacted]"
    assert record.data["huge"].endswith("[truncated]")
    assert audit_chain_verify(world.org).ok


@pytest.mark.spec("AUD-1", "AUD-2", "TEN-1")
def test_a_cross_org_audit_query_returns_nothing_foreign(world):
    acme_ids = set(world.org.audit_records.values_list("public_id", flat=True))
    acme_targets = {world["owner"].token.public_id, world.project.public_id}
    outsider = world["outsider"].client()
    own = every_page(outsider, "/api/v1/orgs/globex/audit")
    assert own, "the outsider reads its own organization's log"
    assert not acme_ids & {item["id"] for item in own}
    text = str(own)
    assert not [marker for marker in acme_targets if marker in text]
    for query in (f"target={world.project.public_id}", f"actor={world['owner'].token.public_id}"):
        assert every_page(outsider, f"/api/v1/orgs/globex/audit?{query}") == []
    missing = outsider.get("/api/v1/orgs/no-such-org/audit")
    assert outsider.get(URL).content == missing.content


def mutating_probes(world):
    for route in org_scoped_routes():
        for method in route.actions:
            # A route whose success the walker's world cannot reach (OWN_REFUSALS) proves its
            # one audit row where it can succeed (tests/gateway: one model.invoke per call).
            if method == "get" or (route.name, method) in QUERIES | set(OWN_REFUSALS):
                continue
            body = BODIES[(route.name, method)](world) if (route.name, method) in BODIES else None
            yield route, method, fill(route, world, "acme"), body


@pytest.mark.spec("AUD-1", "AUD-2")
def test_every_mutating_endpoint_writes_exactly_one_audit_row(world):
    owner = world["owner"].client()
    probed = []
    for route, method, url, body in mutating_probes(world):
        with transaction.atomic():
            before = set(AuditRecord.objects.values_list("pk", flat=True))
            response = call(owner, method, url, body)
            new = AuditRecord.objects.exclude(pk__in=before)
            rows = list(new.values("organization_id", "action", "outcome"))
            verified = audit_chain_verify(world.org)
            transaction.set_rollback(True)
        where = f"{route.name} {method.upper()}"
        assert 200 <= response.status_code < 300, (where, response.content[:300])
        assert len(rows) == 1, (where, rows)
        assert rows[0]["organization_id"] == world.org.pk, where
        assert rows[0]["outcome"] != "refused", where
        assert verified.ok, (where, verified.summary())
        probed.append(where)
    assert len(probed) >= 10, probed
    assert set(KWARGS) >= {route.name for route in org_scoped_routes()}


@pytest.mark.spec("AUD-1")
def test_a_rolled_back_write_leaves_no_audit_row(world):
    chain = AuditChain.objects.get(organization=world.org)
    head_before = (chain.last_sequence, chain.last_hash)
    count = AuditRecord.objects.count()
    with pytest.raises(RuntimeError), transaction.atomic():
        environment_create(actor=system_principal("tests"), organization=world.org, name="gone")
        assert AuditRecord.objects.count() == count + 1
        raise RuntimeError("the caller failed after the write")
    assert AuditRecord.objects.count() == count
    chain.refresh_from_db()
    assert (chain.last_sequence, chain.last_hash) == head_before

    # A write the service refuses (a duplicate name is a 409) records nothing either.
    response = (
        world["owner"]
        .client()
        .post("/api/v1/orgs/acme/environments", {"name": "production"}, format="json")
    )
    assert response.status_code == 409
    assert AuditRecord.objects.count() == count
    assert audit_chain_verify(world.org).ok


@pytest.mark.django_db(transaction=True)
def test_audit_record_refuses_to_run_outside_a_transaction():
    organization = OrganizationFactory()
    with pytest.raises(RuntimeError, match="inside"):
        audit_record(organization=organization, actor=system_principal("tests"), action="x")
    assert not AuditRecord.objects.filter(organization=organization).exists()
