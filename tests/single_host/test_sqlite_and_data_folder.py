"""A real single-host `serve` on SQLite: its data folder is the user's alone, and concurrent
approvals and actions queue for the database instead of failing with "database is locked"."""

from __future__ import annotations

import os
import shutil
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.single_host.support import Serve, short_data_dir

CONCURRENT = 12
POLICY = {
    "capabilities": {
        "fs.read": {"paths": ["**"]},
        "fs.write": {"paths": ["notes/**"], "approval": "always"},
        "shell.exec": {"limits": {"timeout_s": 30}},
    }
}


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """serve on a folder a user made as most tools do (0755) and migrated by hand first, so
    its database was created 0644 under the usual umask."""
    data_dir = short_data_dir()
    data_dir.chmod(0o755)
    serve = Serve(data_dir, log_dir=tmp_path_factory.mktemp("serve-logs"))
    migrated = serve.manage("migrate", "--verbosity", "0")
    assert migrated.returncode == 0, migrated.stderr
    assert mode_of(data_dir / "kestrel.sqlite3") & 0o077, "the setup needs a readable database"
    serve.start()
    try:
        serve.wait_until_calls_can_run()
        serve.owner_token()
        yield serve
    finally:
        serve.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


def agent_post(server: Serve, path: str, body: dict) -> requests.Response:
    """As the local agent: a loopback caller with no token."""
    return requests.post(f"{server.base}{path}", json=body, timeout=120)


def person_post(server: Serve, path: str) -> requests.Response:
    headers = {"Authorization": f"Bearer {server.token}"}
    return requests.post(f"{server.base}{path}", json={}, headers=headers, timeout=120)


def actions_url(server: Serve, name: str) -> str:
    env = server.call("POST", "/orgs/local/environments", {"name": name}, 201)
    server.call("PUT", f"/orgs/local/environments/{env['id']}/policy", POLICY)
    project = server.call(
        "POST", "/orgs/local/projects", {"name": name, "environment": env["id"]}, 201
    )
    threads = f"/orgs/local/projects/{project['id']}/threads"
    thread = server.call("POST", threads, {"title": "many at once", "mode": "agent"}, 201)
    return f"{threads}/{thread['id']}/actions"


def test_the_data_folder_is_private_to_its_user(server):
    data_dir = server.data_dir
    # Others may pass through the folder to a workspace when the runner is root and its
    # sandbox user is another; they never list or read anything.
    passage = 0o711 if os.geteuid() == 0 else 0o700
    corrected = [line for line in server.output.splitlines() if "permissions corrected" in line]
    assert any("kestrel.sqlite3 was 0644, now 0600" in line for line in corrected), corrected
    assert mode_of(data_dir) == passage
    for name in ("kestrel.sqlite3", "secret_key"):
        assert mode_of(data_dir / name) == 0o600, name
    for path in data_dir.iterdir():
        if path.is_file() and not path.is_symlink():
            assert mode_of(path) & 0o077 == 0, path
    # A workspace the runner makes for a call is private too.
    actions = actions_url(server, "private")
    listed = agent_post(server, f"{actions}?wait=60", {"tool": "fs.list", "args": {"path": "."}})
    assert listed.status_code == 201 and listed.json()["state"] == "succeeded", listed.text
    workspaces = data_dir / "workspaces"
    assert mode_of(workspaces) == passage
    modes = {path.name: mode_of(path) for path in workspaces.iterdir()}
    assert modes and set(modes.values()) == {0o700}, modes


def test_concurrent_approvals_and_actions_get_no_server_error(server):
    actions = actions_url(server, "concurrent")
    waiting = []
    for index in range(CONCURRENT):
        body = {"tool": "fs.write", "args": {"path": f"notes/{index}.txt", "content": "x"}}
        response = agent_post(server, actions, body)
        assert response.status_code == 201, response.text
        assert response.json()["state"] == "awaiting_approval"
        waiting.append(response.json()["id"])
    barrier = threading.Barrier(2 * CONCURRENT)

    def approve(action_id: str) -> requests.Response:
        barrier.wait()
        return person_post(server, f"{actions}/{action_id}/approve")

    def request(index: int) -> requests.Response:
        barrier.wait()
        return agent_post(server, actions, {"tool": "fs.list", "args": {"path": "."}})

    with ThreadPoolExecutor(max_workers=2 * CONCURRENT) as pool:
        approving = [pool.submit(approve, action_id) for action_id in waiting]
        requesting = [pool.submit(request, index) for index in range(CONCURRENT)]
        approvals = [future.result() for future in approving]
        requested = [future.result() for future in requesting]
    assert [r.status_code for r in approvals] == [200] * CONCURRENT, [
        r.text for r in approvals if r.status_code != 200
    ]
    assert [r.status_code for r in requested] == [201] * CONCURRENT, [
        r.text for r in requested if r.status_code != 201
    ]
    # Every approved call then ran: the runner's reports were recorded beside the requests.
    for action_id in waiting:
        action = server.call("GET", f"{actions}/{action_id}?wait=60")
        assert action["state"] == "succeeded", action
    assert "database is locked" not in server.output


def test_a_private_folder_still_lets_bubblewrap_reach_the_workspace(tmp_path):
    """bubblewrap starts as the sandbox user when the runner is root: the folder must let it
    pass through to its workspace, and nothing more."""
    data_dir = short_data_dir()
    serve = Serve(data_dir, log_dir=tmp_path, KESTREL_SANDBOX="bubblewrap").start()
    try:
        assert serve.wait_until_calls_can_run()["sandbox"] == "bubblewrap"
        serve.owner_token()
        actions = actions_url(serve, "bubblewrap")
        body = {"tool": "shell.exec", "args": {"argv": ["ls", "-a"]}}
        done = agent_post(serve, f"{actions}?wait=60", body).json()
        assert done["state"] == "succeeded" and done["result"]["exit_code"] == 0, done
        assert done["result"]["sandbox"] == "bubblewrap"
        assert mode_of(data_dir / "kestrel.sqlite3") == 0o600
    finally:
        serve.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
