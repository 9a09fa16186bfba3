"""Unrestricted networking as a recorded risk (MCP-4): only for a custom server, only with
an admin's justified, expiring acceptance bound to the image and base profile; network-off
again once it expires, is withdrawn, or the server changes. Impossible for managed ones."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
from django.conf import settings
from django.utils import timezone
from rest_framework.test import APIClient

from kestrel_one.accounts.principal import Principal, PrincipalKind
from kestrel_one.accounts.services import token_create
from kestrel_one.audit.models import AuditRecord
from kestrel_one.execution.keys import control_private_key
from kestrel_one.mcp.discovery import mcp_sweep
from kestrel_one.mcp.models import McpRiskAcceptance, McpServer
from kestrel_one.mcp.profiles import base_profile_sha256, server_profile
from runners.contract.mcp import base_profile, profile_digest
from runners.contract.names import control_exchange
from runners.contract.tokens import public_key_pem, verify_control_message
from tests.mcp.api_support import ECHO, URL, deployer_token, discovered, installed
from tests.mcp.test_calls import Mcp, mcp_policy

pytestmark = pytest.mark.spec("MCP-4")


def later(**delta) -> str:
    return (timezone.now() + timedelta(**delta)).isoformat()


@pytest.fixture
def ready(world) -> dict:
    server = installed(world["admin"].client(), world)
    discovered(server["id"], ECHO)
    return server


def accept(client, server_id: str, **fields):
    body = {
        "justification": "It calls the vendor's API, which has no fixed hosts.",
        "expires_at": later(days=7),
    }
    body.update(fields)
    body = {key: value for key, value in body.items() if value is not ...}
    return client.post(f"{URL}/{server_id}/risk-acceptances", body, format="json")


def network(client, server_id: str) -> dict:
    return client.get(f"{URL}/{server_id}").json()["network"]


@pytest.mark.parametrize("justification", [..., "", "   \n\t ", None, 7])
def test_a_risk_acceptance_without_a_justification_is_refused(world, ready, justification):
    response = accept(world["admin"].client(), ready["id"], justification=justification)
    assert response.status_code == 400, response.content
    assert "justification" in response.json()["error"]["details"]
    assert not McpRiskAcceptance.objects.exists()
    assert network(world["admin"].client(), ready["id"])["mode"] == "none"


def test_a_risk_acceptance_for_a_managed_server_is_refused(world):
    admin = world["admin"].client()
    server = installed(admin, world, name="files", image=None, managed="filesystem")
    discovered(server["id"], image_id="sha256:" + "e" * 64)
    response = accept(admin, server["id"])
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["code"] == "managed_server_network"
    assert "impossible for managed servers" in error["message"]
    assert not McpRiskAcceptance.objects.exists()
    assert network(admin, server["id"]) == {
        "mode": "none",
        "egress": "none",
        "risk_acceptance": None,
    }


@pytest.mark.parametrize(
    ("expires_at", "words"),
    [
        (later(minutes=-1), "must be in the future"),
        (later(days=-30), "must be in the future"),
        (later(days=91), "at most 90 days ahead"),
        ("next week", "Datetime has wrong format"),
    ],
)
def test_an_expiry_in_the_past_or_too_far_ahead_is_refused(world, ready, expires_at, words):
    response = accept(world["admin"].client(), ready["id"], expires_at=expires_at)
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert "expires_at" in error["details"] and words in error["message"], error
    assert not McpRiskAcceptance.objects.exists()


def test_the_longest_expiry_is_a_setting(world, ready, settings):
    settings.KESTREL_MCP_RISK_MAX_DAYS = 3
    admin = world["admin"].client()
    assert accept(admin, ready["id"], expires_at=later(days=4)).status_code == 400
    assert accept(admin, ready["id"], expires_at=later(days=2)).status_code == 201


@pytest.mark.spec("POL-5")
def test_only_a_person_holding_actions_approve_accepts_the_risk(world, ready):
    """Accepting the risk gives a server the network: a decision, like an approval. An
    integration token holding ``mcp:write`` used to make it (``accepted_by`` empty), and so
    did an admin's token minted by another token, the agent's kind. Both are refused; the
    admin's own token is not."""
    admin = world["admin"]
    integration = deployer_token(world)
    _, minted = token_create(
        actor=Principal(PrincipalKind.TOKEN, user=admin.user, token=admin.token),
        organization=world.org,
        name="agent",
        scopes=["org:read", "mcp:write"],
    )
    for token, words in ((integration, "Only a person"), (minted, "actions:approve")):
        client = APIClient(REMOTE_ADDR="203.0.113.7", HTTP_AUTHORIZATION=f"Bearer {token}")
        assert client.get(f"{URL}/{ready['id']}").status_code == 200  # mcp:write works
        refused = accept(client, ready["id"])
        assert refused.status_code == 403, refused.content
        assert refused.json()["error"]["code"] == "permission_denied"
        assert words in refused.json()["error"]["message"]
    assert not McpRiskAcceptance.objects.exists()
    assert network(admin.client(), ready["id"])["mode"] == "none"
    made = accept(admin.client(), ready["id"])
    assert made.status_code == 201, made.content
    assert McpRiskAcceptance.objects.get().accepted_by == admin.user


def test_a_server_not_yet_discovered_cannot_be_accepted(world):
    admin = world["admin"].client()
    server = installed(admin, world)  # still discovering: its image is not verified yet
    response = accept(admin, server["id"])
    assert response.status_code == 409, response.content
    assert "not ready" in response.json()["error"]["message"]


def test_an_acceptance_bridges_the_server_until_it_expires(world, ready):
    admin = world["admin"].client()
    made = accept(admin, ready["id"], justification="  Needs its vendor's API.  ")
    assert made.status_code == 201, made.content
    acceptance = made.json()
    assert acceptance["id"].startswith("rsk_") and acceptance["state"] == "active"
    assert acceptance["justification"] == "Needs its vendor's API."
    assert acceptance["image_id"] == ready["image_id"]
    assert network(admin, ready["id"]) == {
        "mode": "bridge",
        "egress": "none",
        "risk_acceptance": acceptance["id"],
    }
    server = McpServer.objects.get(public_id=ready["id"])
    assert server_profile(server)["network"] == "bridge"
    assert server_profile(server)["risk_acceptance"] == acceptance["id"]
    # The runner is told when it lapses, so it stops the server then whatever it hears.
    lapses = McpRiskAcceptance.objects.get(public_id=acceptance["id"]).expires_at
    assert server_profile(server)["risk_expires_at"] == math.floor(lapses.timestamp())
    # ...and what egress grants bind to (the profile without its networking) is unchanged.
    assert profile_digest(base_profile(server_profile(server))) == base_profile_sha256(server)
    record = AuditRecord.objects.get(action="mcp.risk.accept", target_id=acceptance["id"])
    assert record.data["justification"] == "Needs its vendor's API."
    assert record.data["server"] == ready["id"] and record.data["image_id"] == ready["image_id"]

    # Its expiry passes (the sweep that records it in the audit log is not needed for this).
    McpRiskAcceptance.objects.filter(public_id=acceptance["id"]).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    assert network(admin, ready["id"]) == {
        "mode": "none",
        "egress": "none",
        "risk_acceptance": None,
    }
    assert server_profile(server)["network"] == "none"
    listed = world["viewer"].client().get(f"{URL}/{ready['id']}/risk-acceptances").json()
    assert [(a["id"], a["state"]) for a in listed["results"]] == [(acceptance["id"], "expired")]


def test_withdrawing_ends_it_at_once(world, ready):
    admin = world["admin"].client()
    first = accept(admin, ready["id"]).json()
    second = accept(admin, ready["id"], expires_at=later(days=2)).json()
    assert network(admin, ready["id"])["risk_acceptance"] == second["id"]  # the newest
    base = f"{URL}/{ready['id']}/risk-acceptances"
    for acceptance in (second, first):
        withdrawn = admin.post(f"{base}/{acceptance['id']}/withdraw", {}, format="json")
        assert withdrawn.status_code == 200, withdrawn.content
        assert withdrawn.json()["state"] == "withdrawn"
        assert withdrawn.json()["withdrawn_by"] == world["admin"].user.public_id
    assert network(admin, ready["id"])["mode"] == "none"
    again = admin.post(f"{base}/{first['id']}/withdraw", {}, format="json")
    assert again.status_code == 409
    listed = admin.get(base).json()["results"]
    assert [a["id"] for a in listed] == [second["id"], first["id"]]  # newest first
    assert {a["state"] for a in listed} == {"withdrawn"}
    assert AuditRecord.objects.filter(action="mcp.risk.withdraw").count() == 2
    missing = admin.post(f"{base}/rsk_00000000000000000000000000/withdraw", {}, format="json")
    assert missing.status_code == 404


@pytest.mark.spec("MCP-2")
@pytest.mark.parametrize(
    "change",
    [
        {"image": "kestrel-test/mcp-custom@sha256:" + "c" * 64},
        {"limits": {"memory_mb": 1024}},
        {"workspace": "ro"},
    ],
)
def test_a_new_image_or_profile_voids_the_acceptance_and_the_egress_grant(world, change):
    admin = world["admin"].client()
    egress = [{"host": "api.example.com", "port": 443, "protocol": "https"}]
    server = installed(admin, world, egress=egress)
    discovered(server["id"], ECHO)
    acceptance = accept(admin, server["id"]).json()
    # Accepting the risk leaves the allowlist's grant as it was (both bind the base profile).
    assert network(admin, server["id"]) == {
        "mode": "bridge",
        "egress": "awaiting_gateway",
        "risk_acceptance": acceptance["id"],
    }
    patched = admin.patch(f"{URL}/{server['id']}", change, format="json")
    assert patched.status_code == 200, patched.content
    if "image" in change:  # a new image is discovered again; then it is ready
        discovered(server["id"])
    assert network(admin, server["id"]) == {
        "mode": "none",
        "egress": "void",
        "risk_acceptance": None,
    }
    listed = admin.get(f"{URL}/{server['id']}/risk-acceptances").json()["results"]
    assert [a["state"] for a in listed] == ["void"]


@pytest.mark.spec("POL-5")
def test_changing_the_server_back_does_not_revive_a_voided_acceptance(world, ready):
    """A change voids the acceptance for good. It used to be void only while the server
    differed from what it was made for: a token holding ``mcp:write``, which cannot accept
    a risk, changed the limits back and the server had the network again, under a person's
    decision that had ended."""
    admin = world["admin"].client()
    acceptance = accept(admin, ready["id"]).json()
    integration = deployer_token(world)
    deployer = APIClient(REMOTE_ADDR="203.0.113.7", HTTP_AUTHORIZATION=f"Bearer {integration}")
    limits = admin.get(f"{URL}/{ready['id']}").json()["limits"]
    for memory_mb in (limits["memory_mb"] * 2, limits["memory_mb"]):
        patched = deployer.patch(
            f"{URL}/{ready['id']}", {"limits": {"memory_mb": memory_mb}}, format="json"
        )
        assert patched.status_code == 200, patched.content
    assert admin.get(f"{URL}/{ready['id']}").json()["limits"] == limits  # as accepted
    assert network(admin, ready["id"])["mode"] == "none"
    listed = admin.get(f"{URL}/{ready['id']}/risk-acceptances").json()["results"]
    assert [(a["id"], a["state"]) for a in listed] == [(acceptance["id"], "void")]
    assert listed[0]["voided_at"] is not None
    server = McpServer.objects.get(public_id=ready["id"])
    assert server_profile(server)["network"] == "none"
    voiding = AuditRecord.objects.filter(action="mcp.update").order_by("pk").first()
    assert voiding.data["risk_acceptances_voided"] == [acceptance["id"]]
    withdrawn = admin.post(
        f"{URL}/{ready['id']}/risk-acceptances/{acceptance['id']}/withdraw", {}, format="json"
    )
    assert withdrawn.status_code == 409 and "void" in withdrawn.json()["error"]["message"]
    # Only a person's new decision gives it the network again.
    assert accept(admin, ready["id"]).status_code == 201
    assert network(admin, ready["id"])["mode"] == "bridge"


class ControlMessages:
    """The broker stand-in for control messages: the ``mcp.risk.end`` notices sent, as
    (type, org, env, prj, thr, rsk), each verified with the control key."""

    def __init__(self, monkeypatch) -> None:
        self.sent: list[dict] = []
        monkeypatch.setattr(
            "kestrel_one.celery.app.send_task", lambda *args, **options: self.sent.append(options)
        )

    def risk_ends(self) -> list[tuple]:
        pool = settings.KESTREL_DEFAULT_POOL
        control_public = public_key_pem(control_private_key())
        found = []
        for options in self.sent:
            if options.get("exchange") is None:
                continue  # a command
            assert options["exchange"].name == control_exchange(pool)
            (token,) = options["args"]
            found.append(
                verify_control_message(token, control_public_key=control_public, pool=pool)
            )
        self.sent.clear()
        return [(m.type, m.org, m.env, m.prj, m.thr, m.rsk) for m in found]


@pytest.fixture
def called(world, monkeypatch, django_capture_on_commit_callbacks):
    """A custom server of which the default pool ran a call, and the control messages."""
    mcp = Mcp(world, mcp_policy())
    messages = ControlMessages(monkeypatch)
    with django_capture_on_commit_callbacks(execute=True):
        mcp.call("echo", {"text": "hello"})
    messages.sent.clear()
    return mcp, messages


def test_an_ended_acceptance_tells_the_runners_that_ran_the_servers_calls(
    world, called, django_capture_on_commit_callbacks
):
    """A warm container started under an acceptance has its network for as long as it
    lives: when the acceptance is withdrawn, or the sweep records its expiry, every runner
    pool that ran a call of the server gets a signed ``mcp.risk.end`` naming it."""
    mcp, messages = called
    admin = world["admin"].client()
    withdrawn = accept(admin, mcp.server.public_id).json()
    expiring = accept(admin, mcp.server.public_id).json()
    assert messages.risk_ends() == []

    base = f"{URL}/{mcp.server.public_id}/risk-acceptances"
    with django_capture_on_commit_callbacks(execute=True):
        answer = admin.post(f"{base}/{withdrawn['id']}/withdraw", {}, format="json")
    assert answer.status_code == 200, answer.content
    scope = (world.org.public_id, mcp.environment.public_id, None, None)
    assert messages.risk_ends() == [("mcp.risk.end", *scope, withdrawn["id"])]

    McpRiskAcceptance.objects.filter(public_id=expiring["id"]).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    with django_capture_on_commit_callbacks(execute=True):
        assert mcp_sweep()["risk_expiries_recorded"] == 1
    assert messages.risk_ends() == [("mcp.risk.end", *scope, expiring["id"])]
    with django_capture_on_commit_callbacks(execute=True):
        assert mcp_sweep()["risk_expiries_recorded"] == 0
    assert messages.risk_ends() == []


def test_a_change_that_voids_the_acceptances_or_a_removal_ends_them_on_the_runners(
    world, called, django_capture_on_commit_callbacks
):
    mcp, messages = called
    admin = world["admin"].client()
    server_url = f"{URL}/{mcp.server.public_id}"
    first = accept(admin, mcp.server.public_id).json()
    second = accept(admin, mcp.server.public_id).json()
    scope = (world.org.public_id, mcp.environment.public_id, None, None)

    # Authoring an allowlist changes nothing the acceptances bind.
    egress = [{"host": "api.example.com", "port": 443, "protocol": "https"}]
    with django_capture_on_commit_callbacks(execute=True):
        answer = admin.patch(server_url, {"egress": egress}, format="json")
    assert answer.status_code == 200, answer.content
    assert messages.risk_ends() == []

    with django_capture_on_commit_callbacks(execute=True):
        answer = admin.patch(server_url, {"limits": {"memory_mb": 1024}}, format="json")
    assert answer.status_code == 200, answer.content
    assert sorted(messages.risk_ends()) == sorted(
        [("mcp.risk.end", *scope, first["id"]), ("mcp.risk.end", *scope, second["id"])]
    )

    third = accept(admin, mcp.server.public_id).json()
    with django_capture_on_commit_callbacks(execute=True):
        assert admin.delete(server_url).status_code in (200, 204)
    assert messages.risk_ends() == [("mcp.risk.end", *scope, third["id"])]


def test_limits_sent_as_another_spelling_of_the_same_numbers_change_nothing(world, ready):
    """``cpus: 1`` for the 1.0 a server has, or ``memory_mb: 512.0`` (an integer to JSON
    Schema), read as no change, yet were stored as sent: the base profile's digest moved, so
    the egress grant went void and the risk acceptance was voided for good, a person's
    decision ended by a change the audit row said was none. Limits are stored in one form
    (integers as integers, cpus as a number with a fraction), so the same numbers are the
    same profile."""
    admin = world["admin"].client()
    server_url = f"{URL}/{ready['id']}"
    entries = [{"host": "api.example.com", "port": 443, "protocol": "https"}]
    assert admin.patch(server_url, {"egress": entries}, format="json").status_code == 200
    assert accept(admin, ready["id"]).status_code == 201
    before = admin.get(server_url).json()
    assert before["limits"]["cpus"] == 1.0 and before["network"]["mode"] == "bridge"
    for same in ({"cpus": 1}, {"memory_mb": 512.0, "pids": 128.0}):
        answer = admin.patch(server_url, {"limits": same}, format="json")
        assert answer.status_code == 200, answer.content
        assert answer.json()["network"] == before["network"], same
        assert answer.json()["limits"] == before["limits"]
    assert not McpRiskAcceptance.objects.filter(voided_at__isnull=False).exists()
    stored = McpServer.objects.get(public_id=ready["id"]).limits
    assert [type(stored[k]) for k in ("memory_mb", "cpus", "pids", "tmp_mb")] == [
        int,
        float,
        int,
        int,
    ]
