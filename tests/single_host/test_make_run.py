"""`make run` alone runs governed calls (LOCAL-1): `manage.py serve` as `make run` starts it,
with no REDIS_URL and a fresh data folder, starts a broker of its own on a Unix socket in that
folder and a runner with a sandbox, and runs fs.write, fs.read and shell.exec end to end;
nothing of it speaks TCP but the web port, and the broker goes when serve goes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.single_host.support import (
    Serve,
    agent_thread,
    alive,
    command_name,
    process_tree,
    short_data_dir,
    socket_inodes,
    tcp_of_tree,
    tcp_sockets,
    unix_listeners,
)


@pytest.fixture
def data_dir():
    folder = short_data_dir()
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def redis_ports_on_this_machine(any_pid: int) -> set[int]:
    """Every TCP port a redis-server of this machine listens on (the suite's own included)."""
    table = tcp_sockets(any_pid)
    ports = {6379}
    for pid in process_tree(1):
        if command_name(pid) == "redis-server":
            ports |= {
                table[inode].local_port
                for inode in socket_inodes(pid)
                if inode in table and table[inode].listening
            }
    return ports


def run(server: Serve, actions: str, tool: str, args: dict) -> tuple[dict, dict]:
    action = server.call("POST", f"{actions}?wait=60", {"tool": tool, "args": args}, 201)
    assert action["state"] == "succeeded", action
    receipt = server.call("GET", f"{actions}/{action['id']}/receipt")
    return action, receipt


@pytest.mark.spec("LOCAL-1")
def test_make_run_alone_runs_governed_calls_on_a_private_broker(data_dir, tmp_path):
    server = Serve(data_dir, log_dir=tmp_path).start()
    try:
        health = server.wait_until_calls_can_run()
        assert health["broker"] == "ok" and health["runner"] == "ok"
        assert health["sandbox"] in {"docker", "bubblewrap"}
        assert "Broker:  embedded redis-server on " in server.output
        assert f"Sandbox: {health['sandbox']}" in server.output

        server.owner_token()
        actions = agent_thread(server)
        _, receipt = run(
            server, actions, "fs.write", {"path": "notes/hello.txt", "content": "hello\n"}
        )
        assert receipt["sandbox"] == "workspace"  # file tools: the workspace is the boundary
        read, _ = run(server, actions, "fs.read", {"path": "notes/hello.txt"})
        assert read["result"]["content"] == "hello\n"
        shell, receipt = run(server, actions, "shell.exec", {"argv": ["cat", "notes/hello.txt"]})
        assert shell["result"]["exit_code"] == 0 and shell["result"]["stdout"] == "hello\n"
        assert receipt["sandbox"] == health["sandbox"]

        # The runner that ran them is the organization's to see.
        (runner,) = server.call("GET", "/orgs/local/runners")["results"]
        assert runner["shared"] and runner["sandbox"] == health["sandbox"]
        assert receipt["runner"] == runner["id"]

        # Nothing of serve's speaks TCP but the web port, and nothing talks to any Redis port
        # (the machine's own Redis servers keep running all along).
        tree = process_tree(server.process.pid)
        redis_ports = redis_ports_on_this_machine(server.process.pid)
        held = tcp_of_tree(server.process.pid)
        for pid, sockets in held.items():
            for sock in sockets:
                assert sock.remote_port not in redis_ports, (pid, command_name(pid), sock)
                assert sock.local_port == server.port, (pid, command_name(pid), sock)
        # The broker is serve's own child, on a Unix socket in the data folder, and no TCP.
        (broker,) = [pid for pid in tree if command_name(pid) == "redis-server"]
        assert held[broker] == []
        socket_path = str(data_dir / "run" / "redis.sock")
        listening = unix_listeners(broker)
        assert socket_path in {listening[i] for i in socket_inodes(broker) if i in listening}
        assert (data_dir / "run").stat().st_mode & 0o777 == 0o700
        assert Path(socket_path).stat().st_mode & 0o077 == 0

        # The folder is this serve's: a second one on it refuses and says why.
        second = server.manage("serve", "--port", "1")
        assert second.returncode != 0
        assert "Another `serve`" in second.stderr and "KESTREL_DATA_DIR" in second.stderr
    finally:
        server.stop()

    assert not alive(broker), "the broker outlived serve"
    assert not Path(socket_path).exists()
    assert all(not alive(pid) for pid in tree), [command_name(pid) for pid in tree if alive(pid)]
