"""The single-host loopback rule, against a real server process bound to a real port."""

from __future__ import annotations

import json
import re
import socket
import sys

import pytest
import requests

from tests.support import Server, free_port, manage, single_host_env

pytestmark = pytest.mark.spec("API-3")
ALL_INTERFACES = "0.0.0.0"  # noqa: S104 - binding everywhere is what these tests exercise


def non_loopback_address() -> str:
    """An address of this machine that is not loopback, to connect *from* a non-loopback source."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        # UDP connect sends nothing; it only picks the outgoing interface's address.
        sock.connect(("192.0.2.1", 9))
        address = sock.getsockname()[0]
    assert not address.startswith("127."), "this machine has no non-loopback IPv4 address"
    return address


@pytest.fixture
def data_dir(tmp_path):
    return tmp_path / "var"


AGENT_SCOPES = ["org:read", "projects:read", "projects:write"]


@pytest.mark.spec("LOCAL-2")
def test_serve_first_run_prints_sign_in_and_an_agent_token_and_loopback_is_the_agent(data_dir):
    env = single_host_env(data_dir)
    port = free_port()
    server = Server(
        env, [sys.executable, "manage.py", "serve", "--port", str(port), "--workers", "1"], port
    )
    try:
        server.wait_ready()
        base = f"http://127.0.0.1:{port}/api/v1"
        anonymous = requests.get(f"{base}/orgs", timeout=10)
        assert anonymous.status_code == 200
        assert [o["slug"] for o in anonymous.json()] == ["local"]
        # The local agent is not the owner: no role, and only the agent's scopes.
        assert anonymous.json()[0]["role"] is None
        assert anonymous.json()[0]["scopes"] == AGENT_SCOPES
        bad = requests.get(f"{base}/orgs", headers={"Authorization": "Bearer wrong"}, timeout=10)
        assert bad.status_code == 401, "an invalid token must never fall back to the loopback rule"
    finally:
        output = server.stop()
    assert "password " in output and "/login" in output
    [agent_token] = re.findall(r"Agent token: (kst_\S+)", output)
    assert "API token" not in output, "no owner token is printed"
    # The printed token is an agent's too, usable with the server token gate or remotely.
    port = free_port()
    again = Server(
        env, [sys.executable, "manage.py", "serve", "--port", str(port), "--workers", "1"], port
    )
    try:
        again.wait_ready()
        base = f"http://127.0.0.1:{port}/api/v1"
        org = requests.get(
            f"{base}/orgs/local", headers={"Authorization": f"Bearer {agent_token}"}, timeout=10
        ).json()
        assert org["role"] is None and org["scopes"] == AGENT_SCOPES
    finally:
        output = again.stop()
    assert "Agent token" not in output and "password" not in output, "credentials print once"


def test_serve_refuses_non_loopback_bind_without_server_token(data_dir):
    result = manage(
        single_host_env(data_dir), "serve", "--host", ALL_INTERFACES, "--port", str(free_port())
    )
    assert result.returncode != 0
    assert "KESTREL_SERVER_TOKEN" in result.stderr


def test_non_loopback_request_without_token_is_rejected(data_dir):
    """gunicorn bound to all interfaces (as a proxy-less misconfiguration would be): a request
    arriving from a non-loopback source gets 401, while loopback is served."""
    address = non_loopback_address()
    # The host name must be allowed so that the request reaches authentication at all.
    env = single_host_env(data_dir, KESTREL_ALLOWED_HOSTS=address)
    assert manage(env, "migrate", "-v0").returncode == 0
    assert manage(env, "bootstrap", "--org", "local", "--email", "owner@localhost").returncode == 0
    port = free_port()
    server = Server(
        env,
        [
            sys.executable,
            "-m",
            "gunicorn",
            "kestrel_one.wsgi:application",
            "-b",
            f"{ALL_INTERFACES}:{port}",
            "--workers",
            "1",
            "--forwarded-allow-ips",
            "",
        ],
        port,
    )
    try:
        server.wait_ready()
        loopback = requests.get(f"http://127.0.0.1:{port}/api/v1/orgs", timeout=10)
        assert loopback.status_code == 200
        remote = requests.get(
            f"http://{address}:{port}/api/v1/orgs",
            timeout=10,
            headers={"X-Forwarded-For": "127.0.0.1", "X-Real-IP": "127.0.0.1"},
        )
        assert remote.status_code == 401
        assert remote.json()["error"]["code"] == "not_authenticated"
    finally:
        server.stop()


def test_with_server_token_loopback_must_present_it(data_dir):
    secret = "a-long-random-test-secret-value"
    env = single_host_env(data_dir, KESTREL_SERVER_TOKEN=secret)
    port = free_port()
    server = Server(
        env, [sys.executable, "manage.py", "serve", "--port", str(port), "--workers", "1"], port
    )
    try:
        server.wait_ready()
        base = f"http://127.0.0.1:{port}/api/v1"
        assert requests.get(f"{base}/orgs", timeout=10).status_code == 401
        ok = requests.get(f"{base}/orgs", headers={"X-Kestrel-Token": secret}, timeout=10)
        assert ok.status_code == 200
        # The server token only opens the door: what it may do is the local agent's.
        assert ok.json()[0]["role"] is None and ok.json()[0]["scopes"] == AGENT_SCOPES
        wrong = requests.get(f"{base}/orgs", headers={"Authorization": "Bearer not-it"}, timeout=10)
        assert wrong.status_code == 401
        # Health needs no token, server token or not.
        health = requests.get(f"{base}/health", timeout=10)
        assert health.status_code == 200 and health.json()["status"] in {"ok", "degraded"}
    finally:
        output = server.stop()
    assert secret not in output


def test_bootstrap_prints_one_line_of_json(data_dir):
    env = single_host_env(data_dir)
    assert manage(env, "migrate", "-v0").returncode == 0
    first = manage(env, "bootstrap", "--org", "acme", "--email", "ada@example.com")
    assert first.returncode == 0, first.stderr
    lines = first.stdout.strip().splitlines()
    assert len(lines) == 1
    body = json.loads(lines[0])
    assert body["org"] == "acme" and body["user"] == "ada@example.com"
    assert body["token"].startswith("kst_")
    assert len(body["password"]) >= 16, "a user made here gets a password to sign in with"
    second = json.loads(
        manage(env, "bootstrap", "--org", "acme", "--email", "ada@example.com").stdout
    )
    assert second["token"] != body["token"], "each run prints a new token"
    assert "password" not in second, "an existing user's password is left alone"
    bad = manage(env, "bootstrap", "--org", "Not A Slug!", "--email", "ada@example.com")
    assert bad.returncode != 0 and "--org" in bad.stderr
    # What bootstrap audited was chained on SQLite too (no row locks there).
    verify = manage(env, "audit_verify", "--org", "acme")
    assert verify.returncode == 0, verify.stderr
    assert "intact" in verify.stdout and "not chained" not in verify.stdout


@pytest.mark.spec("CRED-1")
def test_access_log_never_carries_tokens_from_urls(data_dir):
    """Share links put their token in the path; gunicorn's own access log must mask it."""
    env = single_host_env(data_dir)
    port = free_port()
    server = Server(
        env, [sys.executable, "manage.py", "serve", "--port", str(port), "--workers", "1"], port
    )
    share = "ksh_" + "Zq7" * 15
    api_token = "kst_abcdefghijkl_" + "Q9x" * 15
    try:
        server.wait_ready()
        base = f"http://127.0.0.1:{port}/api/v1"
        assert requests.get(f"{base}/shared/{share}/content", timeout=10).status_code == 404
        requests.get(f"{base}/orgs?token={api_token}", timeout=10)
    finally:
        output = server.stop()
    assert "/api/v1/shared/" in output, "the request is logged"
    assert share not in output and api_token not in output
