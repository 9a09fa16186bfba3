"""A real ``manage.py serve`` as ``make run`` starts it, and what its processes hold open."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from tests.support import free_port

ROOT = Path(__file__).resolve().parents[2]


def single_host_environment(data_dir: Path, **extra: str) -> dict[str, str]:
    """The environment ``make run`` gives serve: no broker, no test or Celery settings."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("KESTREL_", "DJANGO_", "DATABASE_URL", "REDIS_", "CELERY", "TEST_"))
    }
    env.update(
        KESTREL_MODE="single-host",
        KESTREL_DATA_DIR=str(data_dir),
        DJANGO_SETTINGS_MODULE="kestrel_one.settings",
    )
    env.update(extra)
    return env


def short_data_dir() -> Path:
    """A fresh data folder whose path is short enough for every socket under run/."""
    return Path(tempfile.mkdtemp(prefix="k1-", dir="/tmp"))


class Serve:
    """``manage.py serve`` on a free port; its output goes to a file in the data folder."""

    def __init__(self, data_dir: Path, *, log_dir: Path, **extra_env: str) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.env = single_host_environment(data_dir, **extra_env)
        self.base = f"http://127.0.0.1:{self.port}/api/v1"
        # In the test's own tmp_path (pytest keeps the last few), not beside the data folder.
        self.log_path = log_dir / f"serve-{self.port}.log"
        self.process: subprocess.Popen | None = None
        self.token: str | None = None

    def start(self) -> Serve:
        log = open(self.log_path, "w")  # the child's output, closed in stop()
        self._log = log
        self.process = subprocess.Popen(
            [sys.executable, "manage.py", "serve", "--port", str(self.port), "--workers", "1"],
            cwd=ROOT,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        return self

    @property
    def output(self) -> str:
        return self.log_path.read_text()

    def health(self) -> dict | None:
        try:
            return requests.get(f"{self.base}/health", timeout=10).json()
        except requests.RequestException:
            return None

    def wait_until_answering(self) -> dict:
        """Until the web server answers health at all (attempts, not a clock)."""
        for _ in range(600):
            assert self.process.poll() is None, f"serve exited:\n{self.output[-4000:]}"
            if (health := self.health()) is not None:
                return health
            time.sleep(0.2)
        raise AssertionError(f"serve never answered:\n{self.output[-4000:]}")

    def wait_until_calls_can_run(self) -> dict:
        """Until health says ok: the broker answers and the runner's heartbeat arrived.

        Bounded by attempts, not by a clock: a loaded machine may be slow, which is not a
        failure of what these tests check.
        """
        health = None
        for _ in range(600):
            assert self.process.poll() is None, f"serve exited:\n{self.output[-4000:]}"
            health = self.health()
            if health and health.get("status") == "ok":
                return health
            time.sleep(0.2)
        raise AssertionError(f"serve never became healthy: {health}\n{self.output[-4000:]}")

    def manage(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    def owner_token(self) -> str:
        """A person's token with every scope (``bootstrap`` against the same data folder)."""
        made = self.manage("bootstrap", "--org", "local", "--email", "owner@localhost")
        assert made.returncode == 0, made.stderr
        self.token = json.loads(made.stdout)["token"]
        return self.token

    def call(self, method: str, path: str, body=None, expect: int = 200) -> dict:
        response = requests.request(
            method,
            f"{self.base}{path}",
            json=body,
            timeout=90,
            headers={"Authorization": f"Bearer {self.token}"},
        )
        assert response.status_code == expect, (response.status_code, response.text)
        return response.json()

    def stop(self) -> str:
        if self.process.poll() is None:
            self.process.terminate()
        try:
            self.process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()
        return self.output


POLICY = {
    "capabilities": {
        "fs.read": {"paths": ["**"]},
        "fs.write": {"paths": ["notes/**"]},
        "shell.exec": {"approval": "never", "limits": {"timeout_s": 30}},
    }
}


def agent_thread(server: Serve) -> str:
    """An environment with POLICY, a project in it and an agent-mode thread: its actions URL."""
    env = server.call("POST", "/orgs/local/environments", {"name": "dev"}, 201)
    server.call("PUT", f"/orgs/local/environments/{env['id']}/policy", POLICY)
    project = server.call(
        "POST", "/orgs/local/projects", {"name": "site", "environment": env["id"]}, 201
    )
    threads = f"/orgs/local/projects/{project['id']}/threads"
    thread = server.call("POST", threads, {"title": "first", "mode": "agent"}, 201)
    return f"{threads}/{thread['id']}/actions"


# --- processes and their sockets ------------------------------------------------------


def _parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name is in parentheses and may hold spaces: fields resume after the last ")".
    return int(stat.rsplit(")", 1)[1].split()[1])


def process_tree(root: int) -> list[int]:
    """``root`` and every process descended from it, now."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (parent := _parent_of(int(entry.name))) is not None:
            parents[int(entry.name)] = parent
    tree, frontier = [root], [root]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier]
        tree += children
        frontier = children
    return tree


def command_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """Running, not merely a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def socket_inodes(pid: int) -> set[int]:
    """The inodes of every socket ``pid`` has open (from /proc/<pid>/fd)."""
    inodes = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:[") : -1]))
    return inodes


@dataclass(frozen=True)
class TcpSocket:
    local_port: int
    remote_port: int
    listening: bool
    inode: int


def tcp_sockets(pid: int) -> dict[int, TcpSocket]:
    """Every TCP socket (IPv4 and IPv6) in ``pid``'s network namespace, by inode."""
    found = {}
    for table in ("tcp", "tcp6"):
        lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        for line in lines:
            fields = line.split()
            local, remote, state, inode = fields[1], fields[2], fields[3], int(fields[9])
            found[inode] = TcpSocket(
                local_port=int(local.rsplit(":", 1)[1], 16),
                remote_port=int(remote.rsplit(":", 1)[1], 16),
                listening=state == "0A",
                inode=inode,
            )
    return found


def unix_listeners(pid: int) -> dict[int, str]:
    """Listening Unix sockets in ``pid``'s namespace: inode -> path."""
    found = {}
    for line in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        # Flags 00010000 is __SO_ACCEPTCON: a listening socket.
        if len(fields) >= 8 and fields[3] == "00010000":
            found[int(fields[6])] = fields[7]
    return found


def tcp_of_tree(root: int) -> dict[int, list[TcpSocket]]:
    """For every process of the tree, the TCP sockets it holds."""
    table = tcp_sockets(root)
    return {
        pid: [table[inode] for inode in socket_inodes(pid) if inode in table]
        for pid in process_tree(root)
    }
