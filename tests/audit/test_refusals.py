"""Refusals are audited in the organization the caller proved it belongs to, and only there."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from kestrel_one.accounts.models import ApiToken
from kestrel_one.audit.models import AuditRecord
from kestrel_one.audit.selectors import audit_chain_verify
from tests.api.routes import BODIES, org_scoped_routes
from tests.api.test_cross_tenant import call, fill
from tests.audit.helpers import tampering


def refused(org):
    return AuditRecord.objects.filter(organization=org, outcome="refused").order_by("sequence")


@pytest.mark.spec("AUD-1")
def test_a_members_403_is_recorded_as_refused(world):
    response = (
        world["member"]
        .client()
        .post("/api/v1/orgs/acme/environments", {"name": "staging"}, format="json")
    )
    assert response.status_code == 403
    [record] = refused(world.org)
    assert record.action == "request.refused"
    assert record.actor_id == world["member"].token.public_id
    assert record.data["method"] == "POST"
    assert record.data["path"] == "/api/v1/orgs/acme/environments"
    assert "environments:write" in record.data["reason"]
    assert record.source_address == "203.0.113.7" and record.request_id
    assert not world.org.environments.filter(name="staging").exists(), "nothing else changed"
    assert audit_chain_verify(world.org).ok


@pytest.mark.spec("AUD-1")
@pytest.mark.parametrize("state", ["revoked", "expired"])
def test_a_revoked_or_expired_token_is_recorded(world, state):
    token = world["viewer"].token
    now = timezone.now()
    changes = (
        {"revoked_at": now} if state == "revoked" else {"expires_at": now - timedelta(seconds=1)}
    )
    ApiToken.objects.filter(pk=token.pk).update(**changes)
    response = world["viewer"].client().get("/api/v1/orgs/acme")
    assert response.status_code == 401
    [record] = refused(world.org)
    assert (record.action, record.target_id, record.data) == (
        "auth.refused",
        token.public_id,
        {"reason": state},
    )
    assert audit_chain_verify(world.org).ok


def test_a_wrong_secret_for_a_real_key_id_records_nothing(world):
    plaintext = world["owner"].plaintext
    forged = plaintext[:-4] + ("AAAA" if not plaintext.endswith("AAAA") else "BBBB")
    client = world["anonymous"].client()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {forged}")
    assert client.get("/api/v1/orgs/acme").status_code == 401
    client.credentials(HTTP_AUTHORIZATION="Bearer kst_aaaaaaaaaaaa_garbage")
    assert client.get("/api/v1/orgs/acme").status_code == 401
    assert not refused(world.org).exists()


@pytest.mark.spec("AUD-1", "TEN-1")
def test_an_outsiders_probes_never_write_into_the_victims_log(world):
    # Filling the URLs and bodies first: some world objects are made on first use.
    probes = [
        (
            method,
            fill(route, world, "acme"),
            BODIES.get((route.name, method), lambda w: None)(world),
        )
        for route in org_scoped_routes()
        for method in route.actions
    ]
    before = AuditRecord.objects.filter(organization=world.org).count()
    outsider = world["outsider"].client()
    for method, url, body in probes:
        assert call(outsider, method, url, body).status_code == 404, (method, url)
    assert len(probes) > 10
    assert AuditRecord.objects.filter(organization=world.org).count() == before


@pytest.mark.spec("AUD-1")
def test_a_refused_request_repeated_in_a_loop_stops_growing_the_log(world, settings, caplog):
    settings.KESTREL_AUDIT_REFUSALS_PER_MINUTE = 3
    member = world["member"].client()
    for _ in range(6):
        response = member.post("/api/v1/orgs/acme/environments", {"name": "x"}, format="json")
        assert response.status_code == 403  # answered the same, recorded or not
    assert refused(world.org).count() == 3
    capped = [r for r in caplog.records if "audit.refusals_capped" in r.getMessage()]
    assert len(capped) == 1  # logged once for the minute, not once per request
    # Another actor, or another kind of refusal, has its own allowance.
    viewer = world["viewer"].client()
    refused_again = viewer.post("/api/v1/orgs/acme/environments", {"name": "x"}, format="json")
    assert refused_again.status_code == 403
    assert refused(world.org).filter(actor_id=world["viewer"].token.public_id).count() == 1
    # Once the minute has passed, refusals are recorded again.
    with tampering():  # the records age by a minute at once
        AuditRecord.objects.filter(organization=world.org, outcome="refused").update(
            created_at=timezone.now() - timedelta(minutes=2)
        )
    member.post("/api/v1/orgs/acme/environments", {"name": "x"}, format="json")
    assert refused(world.org).count() == 5
