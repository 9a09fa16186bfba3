"""``serve`` (single-host, SQLite, embedded broker) starts its own adapter worker: an
adapter call made over its API reaches the test upstream once, through that worker."""

from __future__ import annotations

import shutil

import pytest
import requests

from tests.single_host.support import Serve, short_data_dir

POLICY = {
    "capabilities": {
        "adapter.invoke": {"adapters": {"github": {"operations": ["issues.list"]}}},
    }
}


@pytest.mark.spec("CRED-2")
def test_serve_runs_an_adapter_call_through_its_own_adapter_worker(upstream, tmp_path):
    data_dir = short_data_dir()
    server = Serve(data_dir, log_dir=tmp_path, **upstream.env())
    server.start()
    try:
        server.wait_until_calls_can_run()
        server.owner_token()
        assert "adapter worker" in server.output
        credential = server.call(
            "POST",
            "/orgs/local/credentials",
            {"name": "ci", "adapter": "github", "secret": upstream.secret("github")},
            201,
        )
        env = server.call("POST", "/orgs/local/environments", {"name": "integrations"}, 201)
        server.call("PUT", f"/orgs/local/environments/{env['id']}/policy", POLICY)
        project = server.call(
            "POST", "/orgs/local/projects", {"name": "bots", "environment": env["id"]}, 201
        )
        threads = f"/orgs/local/projects/{project['id']}/threads"
        thread = server.call("POST", threads, {"title": "issues", "mode": "agent"}, 201)
        actions = f"{server.base}{threads}/{thread['id']}/actions"
        args = {
            "adapter": "github",
            "operation": "issues.list",
            "args": {"owner": "acme", "repo": "rockets"},
            "credential": credential["id"],
        }
        # As the local agent (loopback, no token): it may request actions.
        answer = requests.post(
            f"{actions}?wait=60", json={"tool": "adapter.invoke", "args": args}, timeout=120
        )
        assert answer.status_code == 201, answer.text
        action = answer.json()
        for _ in range(30):
            if action["state"] in ("succeeded", "failed"):
                break
            action = requests.get(f"{actions}/{action['id']}?wait=10", timeout=60).json()
        assert action["state"] == "succeeded", (action, server.output[-3000:])
        assert action["result"]["status"] == 200
        assert len(upstream.requests(host="github")) == 1
        assert upstream.secret("github") not in server.output
    finally:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
