"""Through HTTP against a real `manage.py serve` (web, control worker, scheduler, runner) and
Docker: a shell call that needs approval waits, a person approves, it runs in a container,
and its receipt and events are there."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import requests

from tests.support import free_port, stop

ROOT = Path(__file__).resolve().parents[2]
BROKER = os.environ.get("TEST_E2E_REDIS_URL", "redis://127.0.0.1:6379/10")  # flushed
pytestmark = pytest.mark.docker

OWNER = "owner@localhost"  # the owner serve makes on its first start
# The script the agent writes and then asks to run: it says what the call can see of its sandbox.
HELLO = """echo shipped
echo "uid=$(id -u)"
echo "net=$(ls /sys/class/net | tr '\\n' ' ' | sed 's/ $//')"
if touch /rootfs-probe 2>/dev/null; then echo root=rw; else echo root=ro; fi
echo "caps=$(sed -n 's/^CapEff:[[:space:]]*//p' /proc/self/status)"
echo "nnp=$(sed -n 's/^NoNewPrivs:[[:space:]]*//p' /proc/self/status)"
echo "pids=$(cat /sys/fs/cgroup/pids/pids.max 2>/dev/null || cat /sys/fs/cgroup/pids.max)"
v1=/sys/fs/cgroup/memory/memory.limit_in_bytes
echo "memory=$(cat $v1 2>/dev/null || cat /sys/fs/cgroup/memory.max)"
echo "tmpdir=$TMPDIR"
if touch "$TMPDIR/probe"; then echo tmpdir_writable=yes; else echo tmpdir_writable=no; fi
"""

POLICY = {
    "capabilities": {
        "fs.read": {"paths": ["**"]},
        "fs.write": {"paths": ["**"]},
        "shell.exec": {"approval": "always", "limits": {"timeout_s": 30}},
    }
}


@pytest.fixture
def server(tmp_path, docker_backend):
    redis.Redis.from_url(BROKER).flushdb()
    port = free_port()
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("KESTREL_", "DJANGO_", "TEST_"))
    }
    env.update(
        KESTREL_MODE="single-host",
        KESTREL_DATA_DIR=str(tmp_path / "var"),
        REDIS_URL=BROKER,
        KESTREL_SANDBOX="docker",
        DJANGO_SETTINGS_MODULE="kestrel_one.settings",
    )
    log = open(tmp_path / "serve.log", "w+")
    process = subprocess.Popen(
        [sys.executable, "manage.py", "serve", "--port", str(port), "--workers", "1"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(300):
            assert process.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                requests.get(f"{base}/api/v1/health", timeout=10)
                break
            except requests.RequestException:
                time.sleep(0.2)
        token = re.search(r"Agent token: (kst_\S+)", (tmp_path / "serve.log").read_text()).group(1)
        # The person: the owner, with a token of their own that a command on the server prints.
        person = subprocess.run(
            [sys.executable, "manage.py", "bootstrap", "--org", "local", "--email", OWNER],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        yield {
            "base": base,
            "token": token,
            "person": json.loads(person.stdout)["token"],
            "log": tmp_path / "serve.log",
        }
    finally:
        stop(process, timeout=60)
        log.close()


def call(server, method: str, path: str, token: str, body=None, expect: int = 200):
    response = requests.request(
        method,
        f"{server['base']}/api/v1{path}",
        json=body,
        timeout=60,
        headers={"Authorization": f"Bearer {token}"},
    )
    assert response.status_code == expect, (response.status_code, response.text)
    return response.json()


@pytest.mark.spec("POL-5", "AUD-3", "AUD-5", "RUN-3")
def test_shell_call_waits_for_a_person_then_runs_with_receipt_and_events(server):
    agent_token = server["token"]  # printed once by serve on first run
    person_token = server["person"]
    env = call(server, "POST", "/orgs/local/environments", person_token, {"name": "dev"}, 201)
    call(server, "PUT", f"/orgs/local/environments/{env['id']}/policy", person_token, POLICY)
    project = call(
        server,
        "POST",
        "/orgs/local/projects",
        person_token,
        {"name": "site", "environment": env["id"]},
        201,
    )
    threads = f"/orgs/local/projects/{project['id']}/threads"
    thread = call(server, "POST", threads, agent_token, {"title": "ship it", "mode": "agent"}, 201)
    actions = f"{threads}/{thread['id']}/actions"

    wrote = call(
        server,
        "POST",
        f"{actions}?wait=60",
        agent_token,
        {"tool": "fs.write", "args": {"path": "hello.sh", "content": HELLO}},
        201,
    )
    assert wrote["state"] == "succeeded", wrote

    requested = call(
        server,
        "POST",
        f"{actions}?wait=5",
        agent_token,
        {"tool": "shell.exec", "args": {"argv": ["sh", "hello.sh"]}},
        201,
    )
    assert requested["state"] == "awaiting_approval"
    action = f"{actions}/{requested['id']}"

    # The agent's own token cannot approve what it asked for, nor mint a token that could.
    call(server, "POST", f"{action}/approve", agent_token, {}, 403)
    minted = {"name": "approver", "scopes": ["org:read", "projects:read", "actions:approve"]}
    call(server, "POST", "/orgs/local/tokens", agent_token, minted, 403)
    # The owner, as a person with a token of their own, approves.
    approved = call(server, "POST", f"{action}/approve", person_token, {"reason": "ok"})
    assert approved["state"] in {"queued", "running", "succeeded"}

    finished = call(server, "GET", f"{action}?wait=60", agent_token)
    assert finished["state"] == "succeeded", (finished["error"], finished["result"])
    assert finished["result"]["exit_code"] == 0
    first, *probe = finished["result"]["stdout"].splitlines()
    assert first == "shipped"
    # What the call saw of its own sandbox (RUN-3), through the whole stack.
    seen = dict(line.split("=", 1) for line in probe)
    assert seen["uid"] != "0"
    assert seen["net"] == "lo"  # no network but loopback
    assert seen["root"] == "ro"
    assert seen["caps"] == "0000000000000000" and seen["nnp"] == "1"
    assert seen["pids"].isdigit() and seen["memory"].isdigit()
    assert int(seen["memory"]) < 2**40  # a limit, not the unlimited sentinel
    assert seen["tmpdir"] not in {"", "/tmp"} and seen["tmpdir_writable"] == "yes"

    receipt = call(server, "GET", f"{action}/receipt", agent_token)
    assert receipt["call_id"] == requested["id"]
    assert receipt["args"] == {"argv": ["sh", "hello.sh"]}
    assert receipt["sandbox"] == "docker" and receipt["runner"].startswith("run_")
    assert receipt["policy_version"] == requested["policy_version"]

    events = call(server, "GET", f"{threads}/{thread['id']}/events", agent_token)["results"]
    kinds = [e["kind"] for e in events if e["action"] == requested["id"]]
    assert kinds == [
        "action.requested",
        "action.decided",
        "action.approved",
        "action.started",
        "action.finished",
    ]
    sequences = [e["sequence"] for e in events]
    assert sequences == list(range(1, len(events) + 1))
