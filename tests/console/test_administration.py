"""The console's administration pages: tokens, members, runners, the audit log, retention
and webhooks, each through the API's selectors and services (the walker covers who may open
and post what; these cover what the pages do)."""

from __future__ import annotations

import json
import re
from datetime import timedelta
from html import unescape

import pytest
from django.db import connection, transaction
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from kestrel_one.accounts.models import ApiToken
from kestrel_one.accounts.principal import system_principal
from kestrel_one.accounts.scopes import Role
from kestrel_one.accounts.services import token_create
from kestrel_one.artifacts.models import OrganizationRetention
from kestrel_one.audit.heads import verified_head_claims
from kestrel_one.audit.models import AuditRecord
from kestrel_one.audit.services import audit_record
from kestrel_one.console.sudo import SESSION_KEY
from kestrel_one.execution.enrollment import runner_enroll
from kestrel_one.tenancy.models import Membership
from kestrel_one.webhooks.models import WebhookDelivery, WebhookEndpoint
from runners.contract.tokens import generate_private_key_pem, public_key_pem
from tests.audit.helpers import append_records, tampering
from tests.conftest import make_person
from tests.console.pages import acme_webhook

pytestmark = pytest.mark.spec("SURF-2")


def signed_in(user, *, sudo: bool = True) -> Client:
    client = Client()
    client.force_login(user)  # a sign-in, which starts sudo mode
    if not sudo:
        session = client.session
        session.pop(SESSION_KEY, None)
        session.save()
    return client


def secret_in(html: str, element_id: str) -> str | None:
    found = re.search(rf'<code id="{element_id}">([^<]+)</code>', html)
    return found.group(1) if found else None


# --- tokens ------------------------------------------------------------------------------------


def test_a_token_made_in_the_console_shows_its_secret_once(world):
    client = signed_in(world["viewer"].user)
    made = client.post(
        "/console/acme/tokens", {"name": "read only", "scopes": ["org:read"], "days": "7"}
    )
    assert made.status_code == 200
    assert made["Cache-Control"] == "no-store"
    plaintext = secret_in(made.content.decode(), "token")
    assert plaintext and plaintext.startswith("kst_")
    token = ApiToken.objects.get(name="read only")
    assert token.user == world["viewer"].user and token.scopes == ["org:read"]
    assert token.expires_at - timezone.now() < timedelta(days=7, minutes=1)

    again = client.get("/console/acme/tokens").content.decode()
    assert plaintext not in again and secret_in(again, "token") is None
    assert token.public_id in again and "read only" in again
    # A viewer is offered only the scopes they hold.
    assert 'value="tokens:write"' in again and 'value="members:write"' not in again


def test_a_token_that_can_approve_needs_sudo_mode(world):
    stale = signed_in(world["member"].user, sudo=False)
    body = {"name": "deciding", "scopes": ["org:read", "actions:approve"]}
    refused = stale.post("/console/acme/tokens", body)
    assert refused.status_code == 303
    assert refused["Location"].startswith("/console/sudo?")
    assert not ApiToken.objects.filter(name="deciding").exists()
    # Any other token does not need it.
    plain = stale.post("/console/acme/tokens", {"name": "reading", "scopes": ["org:read"]})
    assert plain.status_code == 200 and ApiToken.objects.filter(name="reading").exists()
    assert signed_in(world["member"].user).post("/console/acme/tokens", body).status_code == 200
    assert ApiToken.objects.filter(name="deciding").exists()


def test_the_service_refuses_a_scope_the_person_lacks_on_the_page(world):
    refused = signed_in(world["member"].user).post(
        "/console/acme/tokens", {"name": "wide", "scopes": ["members:write"]}
    )
    assert refused.status_code == 403
    assert "You cannot grant scope(s) you do not hold: members:write." in refused.content.decode()


def test_a_person_revokes_their_own_token(world):
    member = world["member"]
    client = signed_in(member.user)
    revoked = client.post(f"/console/acme/tokens/{member.token.public_id}/revoke")
    assert revoked.status_code == 303
    member.token.refresh_from_db()
    assert member.token.revoked_at is not None
    page = client.get(revoked["Location"]).content.decode()
    assert f"Token <code>{member.token.public_id}</code> is revoked" in page
    assert "revoked</span>" in page


def test_admins_see_everyones_tokens_and_the_rank_rule_is_shown(world):
    admin = signed_in(world["admin"].user)
    page = admin.get("/console/acme/tokens").content.decode()
    assert world["owner"].token.public_id in page and world["viewer"].token.public_id in page
    assert world["outsider"].token.public_id not in page
    refused = admin.post(f"/console/acme/tokens/{world['owner'].token.public_id}/revoke")
    assert refused.status_code == 403
    assert "cannot revoke the token of a member who is owner" in refused.content.decode()
    # A member sees only their own.
    mine = signed_in(world["member"].user).get("/console/acme/tokens").content.decode()
    assert world["member"].token.public_id in mine
    assert world["owner"].token.public_id not in mine


# --- members -----------------------------------------------------------------------------------


def test_an_admin_adds_a_member_and_sees_the_sign_in_link_once(world):
    client = signed_in(world["admin"].user)
    added = client.post(
        "/console/acme/members",
        {
            "email": "New.Person@acme.example.com",
            "role": "member",
            "access": "some",
            "projects": [world.project.public_id],
        },
    )
    assert added.status_code == 200, added.content
    assert added["Cache-Control"] == "no-store"
    link = secret_in(added.content.decode(), "sign-in-link")
    assert link and "/login/set-password/" in link
    membership = Membership.objects.get(user__email="new.person@acme.example.com")
    assert membership.role == "member" and not membership.all_projects
    page = client.get("/console/acme/members").content.decode()
    assert link not in page
    assert "new.person@acme.example.com" in page and "launchpad" in page


def test_the_grant_rules_are_the_services_and_their_refusal_is_shown(world):
    admin = signed_in(world["admin"].user)
    refused = admin.post(
        "/console/acme/members",
        {"email": "boss@acme.example.com", "role": "owner", "access": "all"},
    )
    assert refused.status_code == 403
    assert "Your role cannot grant the role" in refused.content.decode()
    assert not Membership.objects.filter(user__email="boss@acme.example.com").exists()
    owner = world["owner"].membership
    changed = admin.post(
        f"/console/acme/members/{owner.public_id}", {"role": "viewer", "access": "all"}
    )
    assert changed.status_code == 403
    assert "cannot change or remove a member who is owner" in changed.content.decode()
    owner.refresh_from_db()
    assert owner.role == "owner"


def test_an_owner_changes_a_members_role_and_projects(world):
    member = world["member"].membership
    client = signed_in(world["owner"].user)
    url = f"/console/acme/members/{member.public_id}"
    saved = client.post(
        url, {"role": "viewer", "access": "some", "projects": [world.other_project.public_id]}
    )
    assert saved.status_code == 303, saved.content
    member.refresh_from_db()
    assert member.role == "viewer" and not member.all_projects
    page = client.get(saved["Location"]).content.decode()
    assert "Saved." in page and "hangar" in page
    unchanged = client.post(
        url, {"role": "viewer", "access": "some", "projects": [world.other_project.public_id]}
    )
    assert unchanged["Location"].endswith("changed=nothing")
    client.post(url, {"role": "viewer", "access": "all"})
    member.refresh_from_db()
    assert member.all_projects


def test_removing_a_member_stops_their_tokens(world):
    member = world["member"]
    client = signed_in(world["admin"].user)
    removed = client.post(f"/console/acme/members/{member.membership.public_id}/remove")
    assert removed.status_code == 303
    assert not Membership.objects.filter(pk=member.membership.pk).exists()
    assert not ApiToken.objects.filter(pk=member.token.pk).exists()
    assert member.user.email in client.get(removed["Location"]).content.decode()


def test_a_viewer_sees_members_without_forms(world):
    page = signed_in(world["viewer"].user).get("/console/acme/members").content.decode()
    assert world["limited"].user.email in page and "hangar" in page  # limited to hangar
    assert 'action="/console/acme/members"' not in page


@pytest.mark.spec("SURF-1", "SURF-2")
def test_members_name_only_the_projects_the_reader_can_see(world):
    """A member limited to hangar reads who else is limited where, but not the names of the
    projects they cannot see: those are only counted."""
    both = make_person(
        world.org, Role.MEMBER, name="both", projects=[world.project, world.other_project]
    )
    elsewhere = make_person(world.org, Role.MEMBER, name="elsewhere", projects=[world.project])
    reader = signed_in(world["limited"].user)
    for url in (
        "/console/acme/members",
        f"/console/acme/members/{both.membership.public_id}",
        f"/console/acme/members/{elsewhere.membership.public_id}",
    ):
        page = reader.get(url)
        assert page.status_code == 200
        html = page.content.decode()
        assert world.project.name not in html, url  # launchpad: not theirs
        assert "1 project you cannot see" in html, url
    listed = reader.get("/console/acme/members").content.decode()
    assert "hangar, <span" in listed  # both: hangar by name, launchpad counted
    owner = signed_in(world["owner"].user).get("/console/acme/members").content.decode()
    assert "hangar, launchpad" in owner and "cannot see" not in owner


def _queries(client, url: str) -> int:
    with CaptureQueriesContext(connection) as captured:
        assert client.get(url).status_code == 200
    return len(captured)


def test_the_members_page_makes_as_many_queries_for_many_members(world):
    client = signed_in(world["owner"].user)
    few = _queries(client, "/console/acme/members")
    for index in range(30):
        projects = [world.project] if index % 2 else None
        make_person(world.org, Role.MEMBER, name=f"extra{index}", projects=projects)
    assert _queries(client, "/console/acme/members") == few


# --- runners -----------------------------------------------------------------------------------


def test_runners_show_and_revoke_the_organizations_own_only(world):
    shared = runner_enroll(
        actor=system_principal("tests"),
        pool="default",
        public_key_pem=public_key_pem(generate_private_key_pem()).decode(),
    )
    client = signed_in(world["admin"].user)
    page = client.get("/console/acme/runners").content.decode()
    assert world.runner.public_id in page and shared.public_id in page and "shared" in page
    assert f"/runners/{shared.public_id}/revoke" not in page  # no button for it
    refused = client.post(f"/console/acme/runners/{shared.public_id}/revoke")
    assert refused.status_code == 403
    assert "only the operator can revoke it" in refused.content.decode()
    revoked = client.post(f"/console/acme/runners/{world.runner.public_id}/revoke")
    assert revoked.status_code == 303
    world.runner.refresh_from_db()
    assert world.runner.revoked_at is not None


# --- audit -------------------------------------------------------------------------------------


def test_the_audit_log_filters_like_the_api(world):
    owner = world["owner"]
    client = signed_in(owner.user)
    signed_in(world["member"].user).post(
        "/console/acme/tokens", {"name": "filtered", "scopes": ["org:read"]}
    )
    made = ApiToken.objects.get(name="filtered")

    def records(query: str) -> list[dict]:
        response = client.get(f"/console/acme/audit?{query}")
        api = owner.client().get(f"/api/v1/orgs/acme/audit?{query}")
        assert response.status_code == api.status_code == 200
        shown = re.findall(r'<code class="action">([^<]+)</code>', response.content.decode())
        assert shown == [item["action"] for item in api.json()["results"]][: len(shown)]
        return shown

    assert records("action=token.create")[0] == "token.create"
    assert set(records("action=token.*")) <= {"token.create", "token.revoke"}
    assert records(f"target={made.public_id}") == ["token.create"]
    member_id = world["member"].user.public_id
    assert records(f"actor={member_id}&action=token.create") == ["token.create"]
    later = (timezone.now() + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M")
    assert records(f"since={later}") == []
    assert (
        "No audit records match these filters."
        in client.get(f"/console/acme/audit?since={later}").content.decode()
    )
    bad = client.get(f"/console/acme/audit?since={later}&until=2020-01-01T00:00")
    assert bad.status_code == 400 and "Must be after since." in bad.content.decode()


def test_the_audit_log_is_paged_newest_first(world):
    append_records(world.org, 60)
    client = signed_in(world["owner"].user)
    first = client.get("/console/acme/audit").content.decode()
    sequences = [int(s) for s in re.findall(r'<span class="seq">#(\d+)</span>', first)]
    assert len(sequences) == 50 and sequences == sorted(sequences, reverse=True)
    older = re.search(r'<a href="\?([^"]+)">Older</a>', first).group(1).replace("&amp;", "&")
    second = client.get(f"/console/acme/audit?{older}").content.decode()
    rest = [int(s) for s in re.findall(r'<span class="seq">#(\d+)</span>', second)]
    assert rest and max(rest) < min(sequences)


def test_the_audit_page_makes_as_many_queries_for_many_records(world):
    client = signed_in(world["owner"].user)
    append_records(world.org, 5)
    few = _queries(client, "/console/acme/audit")
    append_records(world.org, 80, start=5)
    assert _queries(client, "/console/acme/audit") == few


def test_audit_data_is_the_apis_redacted_projection(world):
    with transaction.atomic():
        audit_record(
            organization=world.org,
            actor=system_principal("tests"),
            action="test.note",
            data={"note": "x" * 10_000},
        )
    page = signed_in(world["owner"].user).get("/console/acme/audit?action=test.note")
    html = page.content.decode()
    assert "test.note" in html and "x" * 5000 not in html  # bounded as the API bounds it


def test_verify_shows_the_chain_intact_and_a_signed_head(world):
    append_records(world.org, 12)
    client = signed_in(world["owner"].user)
    page = client.post("/console/acme/audit/verify")
    html = page.content.decode()
    assert page.status_code == 200 and "The chain is intact." in html
    seq = int(re.search(r'<dd id="head-seq">(\d+)</dd>', html).group(1))
    shown = re.search(r'<pre id="head-json"[^>]*>([^<]+)</pre>', html).group(1)
    head = json.loads(unescape(shown))
    claims = verified_head_claims(head, organization=world.org)
    assert claims["seq"] == seq == AuditRecord.objects.filter(organization=world.org).count()
    # htmx asks for the result alone.
    fragment = client.post("/console/acme/audit/verify", HTTP_HX_REQUEST="true").content.decode()
    assert fragment.lstrip().startswith('<section id="verification"')


def test_verify_names_a_broken_chain(world):
    records = append_records(world.org, 5)
    with tampering():
        AuditRecord.objects.filter(pk=records[2].pk).update(action="token.revoke")
    html = signed_in(world["owner"].user).post("/console/acme/audit/verify").content.decode()
    assert "The chain is broken" in html
    assert records[2].public_id in html and "edited" in html


# --- retention ---------------------------------------------------------------------------------


def test_an_admin_changes_retention_and_a_viewer_reads_it(world):
    admin = signed_in(world["admin"].user)
    body = {"events_days": 30, "artifacts_days": 60, "checkpoints_days": 7, "audit_days": 400}
    saved = admin.post("/console/acme/retention", body)
    assert saved.status_code == 303
    retention = OrganizationRetention.objects.get(organization=world.org)
    assert (retention.events_days, retention.audit_days) == (30, 400)
    assert AuditRecord.objects.filter(organization=world.org, action="retention.update").exists()
    viewer = signed_in(world["viewer"].user).get("/console/acme/retention").content.decode()
    assert "400 days" in viewer and 'method="post" action="/console/acme/retention"' not in viewer
    too_long = admin.post("/console/acme/retention", {**body, "audit_days": 99_999})
    assert too_long.status_code == 400
    retention.refresh_from_db()
    assert retention.audit_days == 400


# --- webhooks ----------------------------------------------------------------------------------


def test_a_webhook_secret_is_shown_once_and_then_only_its_fingerprint(world):
    client = signed_in(world["admin"].user)
    made = client.post(
        "/console/acme/webhooks",
        {"url": "https://hooks.example.com/in", "event_types": ["action.failed"], "enabled": "on"},
    )
    assert made.status_code == 200 and made["Cache-Control"] == "no-store"
    secret = secret_in(made.content.decode(), "webhook-secret")
    assert secret and secret.startswith("whsec_")
    endpoint = WebhookEndpoint.objects.get(url="https://hooks.example.com/in")
    page = client.get("/console/acme/webhooks").content.decode()
    assert secret not in page and endpoint.secret_fingerprint in page
    detail = client.get(f"/console/acme/webhooks/{endpoint.public_id}").content.decode()
    assert secret not in detail and "Nothing has been sent to this endpoint yet." in detail
    refused = client.post(
        "/console/acme/webhooks", {"url": "http://10.0.0.1/x", "event_types": ["action.failed"]}
    )
    assert refused.status_code == 400 and "cannot receive webhooks" in refused.content.decode()


def test_a_finished_delivery_is_redelivered(world):
    ids = acme_webhook(world)
    client = signed_in(world["owner"].user)
    page = client.get(f"/console/acme/webhooks/{ids['whk']}").content.decode()
    assert ids["dlv"] in page and "failed</span>" in page
    url = f"/console/acme/webhooks/{ids['whk']}/deliveries/{ids['dlv']}/redeliver"
    again = client.post(url)
    assert again.status_code == 303
    delivery = WebhookDelivery.objects.get(public_id=ids["dlv"])
    assert delivery.state == "pending" and delivery.attempts == 0
    # Pending now: it will be attempted anyway, as the API says.
    refused = client.post(url)
    assert refused.status_code == 409
    assert "it will be attempted anyway" in refused.content.decode()


def test_an_endpoint_is_switched_off_and_on(world):
    ids = acme_webhook(world)
    client = signed_in(world["admin"].user)
    url = f"/console/acme/webhooks/{ids['whk']}"
    assert client.post(url, {"enabled": "off"}).status_code == 303
    endpoint = WebhookEndpoint.objects.get(public_id=ids["whk"])
    assert not endpoint.enabled
    redeliver = f"{url}/deliveries/{ids['dlv']}/redeliver"
    refused = client.post(redeliver)
    assert refused.status_code == 409 and "This endpoint is disabled" in refused.content.decode()
    assert client.post(url, {"enabled": "on"}).status_code == 303
    endpoint.refresh_from_db()
    assert endpoint.enabled
    assert client.post(redeliver).status_code == 303


def test_the_tokens_page_makes_as_many_queries_for_many_tokens(world):
    client = signed_in(world["owner"].user)
    few = _queries(client, "/console/acme/tokens")
    for index in range(25):
        for name in ("owner", "viewer"):
            token_create(
                actor=system_principal("tests"),
                organization=world.org,
                name=f"{name} extra {index}",
                scopes=["org:read"],
                user=world[name].user,
            )
    assert _queries(client, "/console/acme/tokens") == few


def test_no_administration_page_carries_a_stored_secret(world):
    """Token hashes, webhook secrets (sealed or not), runner keys and broker hashes never
    reach a page; the one-time secrets are checked above."""
    ids = acme_webhook(world)
    endpoint = WebhookEndpoint.objects.get(public_id=ids["whk"])
    stored = [endpoint.secret_encrypted, world.runner.public_key.splitlines()[1]]
    stored += [t.secret_hash for t in ApiToken.objects.filter(organization=world.org)]
    if world.runner.broker_password_sha256:
        stored.append(world.runner.broker_password_sha256)
    client = signed_in(world["owner"].user)
    for path in (
        "/console/acme/tokens",
        "/console/acme/members",
        f"/console/acme/members/{world['member'].membership.public_id}",
        "/console/acme/runners",
        "/console/acme/audit",
        "/console/acme/retention",
        "/console/acme/webhooks",
        f"/console/acme/webhooks/{ids['whk']}",
    ):
        html = client.get(path).content.decode()
        assert not [value for value in stored if value and value in html], path
    verified = client.post("/console/acme/audit/verify").content.decode()
    assert not [value for value in stored if value and value in verified]


def test_the_last_owner_cannot_leave_and_is_told_why(world):
    owner = world["owner"]
    client = signed_in(owner.user)
    refused = client.post(f"/console/acme/members/{owner.membership.public_id}/remove")
    assert refused.status_code == 409
    assert "An organization must keep at least one owner." in refused.content.decode()
    assert Membership.objects.filter(pk=owner.membership.pk).exists()
    # Anyone else with members:write may leave: back to their organizations.
    admin = world["admin"]
    left = signed_in(admin.user).post(f"/console/acme/members/{admin.membership.public_id}/remove")
    assert left.status_code == 303 and left["Location"] == "/console/"
