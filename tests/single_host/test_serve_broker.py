"""serve and its broker, as real processes: hosted serve refuses a broker nobody answers,
single-host says it is degraded and refuses calls that would execute at once, and two
services with their own data folders and ports share nothing."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import pytest
import requests

from kestrel_one.local.runtime import runtime_paths
from runners.contract.tokens import generate_private_key_pem
from tests.single_host.support import (
    ROOT,
    Serve,
    agent_thread,
    alive,
    command_name,
    process_tree,
    short_data_dir,
    single_host_environment,
)
from tests.support import free_port


def test_hosted_serve_refuses_to_start_when_the_broker_does_not_answer(tmp_path):
    key = tmp_path / "control.pem"
    key.write_bytes(generate_private_key_pem())
    key.chmod(0o600)
    port = free_port()
    env = single_host_environment(
        tmp_path / "var",
        KESTREL_MODE="hosted",
        REDIS_URL=f"redis://kestrel:hunter2@127.0.0.1:{port}/0",
        DATABASE_URL="postgres://kestrel@127.0.0.1:5432/kestrel",
        DJANGO_SECRET_KEY="a-test-secret-key-that-is-long-enough-for-django-checks",
        KESTREL_ALLOWED_HOSTS="kestrel.example.com",
        KESTREL_SIGNING_KEY_FILE=str(key),
        # Hosted mode names the credentials key; serve refuses before ever reading it here.
        KESTREL_CREDENTIALS_KEY_FILE=str(tmp_path / "credentials.key"),
    )
    result = subprocess.run(
        [sys.executable, "manage.py", "serve", "--port", str(free_port())],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0
    assert "nobody answers at REDIS_URL" in result.stderr
    assert f"redis://127.0.0.1:{port}/0" in result.stderr  # where, for the operator
    assert "hunter2" not in result.stderr + result.stdout
    assert "Listening at" not in result.stdout + result.stderr


@pytest.fixture
def data_dir():
    folder = short_data_dir()
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_single_host_with_a_broker_nobody_answers_is_degraded_and_refuses_at_once(
    data_dir, tmp_path
):
    nobody = free_port()
    server = Serve(data_dir, log_dir=tmp_path, REDIS_URL=f"redis://127.0.0.1:{nobody}/0").start()
    try:
        health = server.wait_until_answering()
        assert health["status"] == "degraded" and "broker" in health["missing"]
        assert health["broker"] == "unreachable"
        assert f"Broker:  redis://127.0.0.1:{nobody}/0 (REDIS_URL) does not answer" in (
            server.output
        )
        server.owner_token()
        actions = agent_thread(server)
        # Generous client timeout, far below the wait asked for: the refusal does not wait.
        response = requests.post(
            f"{server.base}{actions}?wait=60",
            json={"tool": "fs.write", "args": {"path": "notes/a.txt", "content": "x"}},
            headers={"Authorization": f"Bearer {server.token}"},
            timeout=30,
        )
        assert response.status_code == 503, response.text
        assert "does not answer" in response.json()["error"]["message"]
        denied = server.call(
            "POST", actions, {"tool": "fs.write", "args": {"path": "etc/x", "content": "x"}}, 201
        )
        assert denied["state"] == "denied"
        assert server.call("GET", actions)["results"] == [denied]
    finally:
        server.stop()


def redis_child(server: Serve) -> int:
    (pid,) = [p for p in process_tree(server.process.pid) if command_name(p) == "redis-server"]
    return pid


def test_two_services_with_their_own_data_folders_do_not_disturb_each_other(tmp_path):
    first_dir = short_data_dir()
    # Too long a path for sockets under it: its run/ moves to a short private directory.
    second_dir = tmp_path / ("a-data-folder-with-a-rather-long-name-" * 2).rstrip("-")
    second_dir.mkdir()
    # The first is killed below: no warm container of its may outlive its runner.
    first = Serve(first_dir, log_dir=tmp_path, KESTREL_WARM_SANDBOXES="0").start()
    second = Serve(second_dir, log_dir=tmp_path).start()
    try:
        for server in (first, second):
            server.wait_until_calls_can_run()
            server.owner_token()
        assert first.port != second.port
        run_dirs = [runtime_paths(d).run_dir for d in (first_dir, second_dir)]
        assert run_dirs[0] == first_dir / "run"
        assert run_dirs[1].parent != second_dir and run_dirs[1].stat().st_mode & 0o777 == 0o700
        for run_dir in run_dirs:
            assert (run_dir / "redis.sock").exists() and (run_dir / "gunicorn.ctl").exists()
        brokers = [redis_child(first), redis_child(second)]
        assert brokers[0] != brokers[1]

        threads = [agent_thread(server) for server in (first, second)]
        for server, actions in zip((first, second), threads, strict=True):
            ran = server.call(
                "POST",
                f"{actions}?wait=60",
                {"tool": "shell.exec", "args": {"argv": ["sh", "-c", "echo $((6 * 7))"]}},
                201,
            )
            assert ran["state"] == "succeeded" and ran["result"]["stdout"] == "42\n", ran
        # Each organization sees its own host's runner only.
        runners = [s.call("GET", "/orgs/local/runners")["results"] for s in (first, second)]
        assert {r["id"] for r in runners[0]}.isdisjoint({r["id"] for r in runners[1]})

        # The first one crashes: everything it started goes with it (PR_SET_PDEATHSIG).
        first_tree = process_tree(first.process.pid)
        first.process.kill()
        first.stop()
        for _ in range(300):
            if not any(alive(pid) for pid in first_tree):
                break
            time.sleep(0.1)
        assert not any(alive(pid) for pid in first_tree), [command_name(p) for p in first_tree]
        assert alive(brokers[1])
        assert (run_dirs[1] / "gunicorn.ctl").exists()  # the first's exit took nothing of it
        wrote = second.call(
            "POST",
            f"{threads[1]}?wait=60",
            {"tool": "fs.write", "args": {"path": "notes/after.txt", "content": "still here"}},
            201,
        )
        assert wrote["state"] == "succeeded", wrote
        assert second.health()["status"] == "ok"
    finally:
        first.stop()
        second.stop()
        shutil.rmtree(first_dir, ignore_errors=True)
    assert not alive(brokers[1])
