"""Egress allowlists: exact entries parsed strictly, every error at its path (MCP-2), and an
allowlisted server that stays network-off while no trusted egress gateway exists (MCP-3)."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from kestrel_one.audit.models import AuditRecord
from kestrel_one.mcp.egress import MAX_EGRESS_ENTRIES, EgressInvalid, egress_parse
from kestrel_one.mcp.models import McpServer
from kestrel_one.mcp.profiles import server_profile
from tests.mcp.api_support import ECHO, URL, deployer_token, discovered, install, installed

GOOD = {"host": "api.example.com", "port": 443, "protocol": "https"}


def entry(**fields):
    """GOOD with ``fields`` changed (a value of ... removes the field)."""
    changed = {**GOOD, **fields}
    return {key: value for key, value in changed.items() if value is not ...}


# (the entry, the path its error is reported at, words of the message)
MALFORMED = [
    (entry(host="*.example.com"), "host", "wildcards are not allowed"),
    (entry(host="api.*.example.com"), "host", "wildcards"),
    (entry(host="*"), "host", "wildcards"),
    (entry(host="10.0.0.1"), "host", "IP addresses are not allowed"),
    (entry(host="169.254.169.254"), "host", "IP addresses"),
    (entry(host="::1"), "host", "IP addresses"),
    (entry(host="[2001:db8::1]"), "host", "IP addresses"),
    (entry(host="api.example.com:443"), "host", "must not carry a port"),
    (entry(host="https://api.example.com"), "host", "without a scheme"),
    (entry(host="api.example.com/v1"), "host", "without a path"),
    (entry(host="user@api.example.com"), "host", "user"),
    (entry(host="api.example.com."), "host", "must not end with a dot"),
    (entry(host="API.Example.com"), "host", "must be lower case: use 'api.example.com'"),
    (entry(host="localhost"), "host", "at least two labels"),
    (entry(host="api..example.com"), "host", "empty label"),
    (entry(host="-api.example.com"), "host", "not starting or ending with a hyphen"),
    (entry(host="api_v2.example.com"), "host", "letters, digits or hyphens"),
    (entry(host="a" * 64 + ".example.com"), "host", "1 to 63"),
    (entry(host=("a" * 60 + ".") * 5 + "com"), "host", "at most 253"),
    (entry(host="bücher.example"), "host", "'xn--bcher-kva.example'"),
    (entry(host="xn--zz.example"), "host", "not valid IDNA"),
    (entry(host="1.2.3"), "host", "numeric label"),
    (entry(host="api.example.com "), "host", "spaces"),
    (entry(host=""), "host", "must not be empty"),
    (entry(host=["api.example.com"]), "host", "must be a string"),
    (entry(host=...), "host", "required"),
    (entry(port="443"), "port", "not a string"),
    (entry(port=True), "port", "must be an integer"),
    (entry(port=0), "port", "1 to 65535"),
    (entry(port=65536), "port", "1 to 65535"),
    (entry(port=-1), "port", "1 to 65535"),
    (entry(port=443.0), "port", "must be an integer"),
    (entry(port="8000-8100"), "port", "range"),
    (entry(port=[80, 443]), "port", "must be an integer"),
    (entry(port=...), "port", "required"),
    (entry(protocol="http"), "protocol", "plain http is not allowed"),
    (entry(protocol="HTTPS"), "protocol", "must be lower case: use 'https'"),
    (entry(protocol="udp"), "protocol", "must be one of: https, tcp"),
    (entry(protocol="*"), "protocol", "must be one of"),
    (entry(protocol=None), "protocol", "must be one of"),
    (entry(protocol=...), "protocol", "required"),
    ({**GOOD, "methods": ["GET"]}, "methods", "unknown field"),
    ({**GOOD, "path": "/v1"}, "path", "unknown field"),
]


@pytest.mark.spec("MCP-2")
@pytest.mark.parametrize(("bad", "field", "words"), MALFORMED)
def test_a_malformed_entry_is_refused_at_its_exact_path(bad, field, words):
    with pytest.raises(EgressInvalid) as refused:
        egress_parse([GOOD, {**GOOD, "port": 8443}, bad])
    details = refused.value.details
    assert list(details) == [f"egress[2].{field}"], details
    assert words in details[f"egress[2].{field}"][0], details


@pytest.mark.spec("MCP-2")
@pytest.mark.parametrize("host", ["127.0.0.0x1", "0x7f.0x1", "0x7f.0.0.0x1", "10.0x0", "api.0x"])
def test_a_host_an_address_parser_reads_as_an_ip_is_refused(host):
    """``ipaddress`` reads only the dotted quad, but a resolver (``inet_aton``) reads hex and
    octal parts too: ``127.0.0.0x1`` is 127.0.0.1. A name that ends in such a number is an
    IP literal in disguise, and used to be accepted as a DNS name."""
    with pytest.raises(EgressInvalid) as refused:
        egress_parse([{**GOOD, "host": host}])
    (problem,) = refused.value.details["egress[0].host"]
    assert "IP addresses are not allowed" in problem


@pytest.mark.spec("MCP-2")
@pytest.mark.parametrize(
    ("raw", "path", "words"),
    [
        ({"host": "api.example.com"}, "egress", "must be a list"),
        ("api.example.com:443", "egress", "must be a list"),
        (["api.example.com:443"], "egress[0]", "must be an object"),
        ([GOOD] * (MAX_EGRESS_ENTRIES + 1), "egress", f"at most {MAX_EGRESS_ENTRIES}"),
        ([GOOD, {**GOOD, "port": 8443}, dict(GOOD)], "egress[2]", "duplicates egress[0]"),
    ],
)
def test_the_allowlist_itself_is_checked(raw, path, words):
    with pytest.raises(EgressInvalid) as refused:
        egress_parse(raw)
    assert words in refused.value.details[path][0], refused.value.details


@pytest.mark.spec("MCP-2")
def test_every_problem_of_every_entry_is_reported_at_once():
    with pytest.raises(EgressInvalid) as refused:
        egress_parse(
            [
                {"host": "*.example.com", "port": "443", "protocol": "http"},
                GOOD,
                {"host": "10.0.0.1", "extra": 1},
            ]
        )
    assert set(refused.value.details) == {
        "egress[0].host",
        "egress[0].port",
        "egress[0].protocol",
        "egress[2].host",
        "egress[2].extra",
        "egress[2].port",
        "egress[2].protocol",
    }


@pytest.mark.spec("MCP-2")
def test_exact_entries_are_kept_exactly_as_authored():
    entries = [
        GOOD,
        {"protocol": "tcp", "port": 5432, "host": "db.internal.example.com"},
        {"host": "xn--bcher-kva.example", "port": 443, "protocol": "https"},
        {"host": "api.example.com", "port": 8443, "protocol": "https"},
    ]
    assert egress_parse(entries) == [
        {"host": e["host"], "port": e["port"], "protocol": e["protocol"]} for e in entries
    ]
    assert egress_parse([]) == []


@pytest.mark.spec("MCP-2")
def test_the_api_refuses_a_malformed_allowlist_at_its_path_and_installs_nothing(world):
    admin = world["admin"].client()
    response = install(admin, world, egress=[GOOD, {**GOOD, "port": "443"}])
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["code"] == "invalid"
    assert list(error["details"]) == ["egress[1].port"]
    assert error["message"].startswith("egress[1].port: must be an integer")
    assert not McpServer.objects.exists()
    server = installed(admin, world)
    patched = admin.patch(
        f"{URL}/{server['id']}", {"egress": [{**GOOD, "host": "*.example.com"}]}, format="json"
    )
    assert patched.status_code == 400 and "egress[0].host" in patched.json()["error"]["details"]
    assert McpServer.objects.get(public_id=server["id"]).egress == []


@pytest.mark.spec("MCP-3")
def test_an_allowlisted_server_stays_network_disabled(world):
    admin = world["admin"].client()
    server = installed(admin, world, egress=[GOOD])
    assert server["network"] == {
        "mode": "none",
        "egress": "awaiting_gateway",
        "risk_acceptance": None,
    }
    discovered(server["id"], ECHO)
    detail = admin.get(f"{URL}/{server['id']}").json()
    assert detail["state"] == "ready" and detail["egress"] == [GOOD]
    assert detail["network"] == {
        "mode": "none",
        "egress": "awaiting_gateway",
        "risk_acceptance": None,
    }
    # What a container of it is started with: no network, whatever the allowlist says.
    profile = server_profile(McpServer.objects.get(public_id=server["id"]))
    assert profile["network"] == "none" and profile["risk_acceptance"] is None
    assert "egress" not in profile


@pytest.mark.spec("MCP-2", "POL-5")
def test_only_a_person_approves_an_egress_entry_the_grant_does_not_hold(world):
    """Authoring entries approves them for the server's image and profile, and that grant is
    what a gateway will enforce. An integration token holding ``mcp:write`` used to author
    any entry, or bind entries again after a new profile voided them: a widening with no
    person deciding. Dropping entries only narrows, and stays open to it."""
    admin = world["admin"].client()
    other = {"host": "files.example.com", "port": 443, "protocol": "https"}
    server = installed(admin, world, egress=[GOOD, other])
    discovered(server["id"], ECHO)
    deployer = APIClient(
        REMOTE_ADDR="203.0.113.7", HTTP_AUTHORIZATION=f"Bearer {deployer_token(world)}"
    )
    path = f"{URL}/{server['id']}"
    added = {"host": "upload.example.com", "port": 443, "protocol": "https"}
    refused = deployer.patch(path, {"egress": [GOOD, added]}, format="json")
    assert refused.status_code == 403, refused.content
    assert refused.json()["error"]["code"] == "permission_denied"
    assert "Only a person can approve egress entries" in refused.json()["error"]["message"]
    assert McpServer.objects.get(public_id=server["id"]).egress == [GOOD, other]

    narrowed = deployer.patch(path, {"egress": [GOOD]}, format="json")
    assert narrowed.status_code == 200, narrowed.content
    assert narrowed.json()["egress"] == [GOOD]
    assert narrowed.json()["network"]["egress"] == "awaiting_gateway"
    # The grant it narrowed is still the admin's.
    assert McpServer.objects.get(public_id=server["id"]).egress_approved_by == world["admin"].user

    # New limits void the grant; binding the same entries again approves them again.
    voided = deployer.patch(path, {"limits": {"cpus": 0.5}}, format="json")
    assert voided.status_code == 200 and voided.json()["network"]["egress"] == "void"
    rebound = deployer.patch(path, {"egress": [GOOD]}, format="json")
    assert rebound.status_code == 403, rebound.content
    assert deployer.patch(path, {"egress": []}, format="json").status_code == 200

    approved = admin.patch(path, {"egress": [GOOD, added]}, format="json")
    assert approved.status_code == 200, approved.content
    assert approved.json()["network"]["egress"] == "awaiting_gateway"


@pytest.mark.spec("MCP-2")
def test_changing_the_server_back_does_not_revive_a_voided_egress_grant(world):
    """A new profile voids the grant until an admin saves the entries again. It used to be
    void only while the server differed from what it was approved for: a token holding
    ``mcp:write``, which cannot approve an entry, changed the limits back and the grant was
    in force again, without anyone saving it."""
    admin = world["admin"].client()
    server = installed(admin, world, egress=[GOOD])
    discovered(server["id"], ECHO)
    detail = f"{URL}/{server['id']}"
    assert admin.get(detail).json()["network"]["egress"] == "awaiting_gateway"
    deployer = APIClient(
        REMOTE_ADDR="203.0.113.7", HTTP_AUTHORIZATION=f"Bearer {deployer_token(world)}"
    )
    memory_mb = admin.get(detail).json()["limits"]["memory_mb"]
    for limit in (memory_mb * 2, memory_mb):
        changed = deployer.patch(detail, {"limits": {"memory_mb": limit}}, format="json")
        assert changed.status_code == 200, changed.content
        assert changed.json()["network"]["egress"] == "void"
    voiding = AuditRecord.objects.filter(action="mcp.update").order_by("pk").first()
    assert voiding.data["egress"]["status"] == "void"
    # Only a person saving the entries again approves them.
    resaved = admin.patch(detail, {"egress": [GOOD]}, format="json")
    assert resaved.json()["network"]["egress"] == "awaiting_gateway"
