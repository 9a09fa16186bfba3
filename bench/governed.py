"""Governed calls through the whole stack against bare Docker, on this machine.

A real ``python manage.py serve`` (single-host: web, control worker with its scheduler, and
an enrolled local runner with KESTREL_SANDBOX=docker) against PostgreSQL (a database made
for the run and dropped after), Redis DB 9 as the broker, and a temporary data folder. Calls
go through HTTP with ``?wait=``, exactly as an agent makes them; the baselines are the
``docker`` CLI on the same image and command, measured in the same run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cpu
import psycopg
import redis
import requests

ROOT = Path(__file__).resolve().parents[1]
BROKER = "redis://127.0.0.1:6379/9"
IMAGE = "kestrel/tool-runtime:latest"
COMMAND = ["echo", "hi"]
OWNER = "owner@localhost"  # the owner serve makes on its first start
POLICY = {
    "capabilities": {
        "shell.exec": {"approval": "never", "limits": {"timeout_s": 30}},
    }
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def image_id() -> str:
    return subprocess.run(
        ["docker", "image", "inspect", "--format", "{{.Id}}", IMAGE],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def docker_run_once(image: str) -> float:
    """Seconds for one bare ``docker run --rm IMAGE echo hi``."""
    started = time.perf_counter()
    subprocess.run(["docker", "run", "--rm", image, *COMMAND], check=True, capture_output=True)
    return time.perf_counter() - started


@contextlib.contextmanager
def running_container(image: str) -> Iterator[str]:
    container = subprocess.run(
        ["docker", "run", "-d", "--rm", "--network", "none", image, "sleep", "3600"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    try:
        yield container
    finally:
        subprocess.run(["docker", "rm", "-f", container], capture_output=True)


def docker_exec_rate(image: str, seconds: float) -> tuple[float, list[float]]:
    """Calls per second of ``docker exec CONTAINER echo hi`` in a loop, and each latency."""
    latencies = []
    with running_container(image) as container:
        deadline = time.perf_counter() + seconds
        started = time.perf_counter()
        while time.perf_counter() < deadline:
            began = time.perf_counter()
            subprocess.run(["docker", "exec", container, *COMMAND], check=True, capture_output=True)
            latencies.append(time.perf_counter() - began)
        elapsed = time.perf_counter() - started
    return len(latencies) / elapsed, latencies


@contextlib.contextmanager
def scratch_database(admin_url: str, name: str) -> Iterator[str]:
    """A fresh PostgreSQL database for the run, dropped afterwards whatever happens."""
    with psycopg.connect(admin_url, autocommit=True) as connection:
        connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        connection.execute(f'CREATE DATABASE "{name}"')
    base = admin_url.rsplit("/", 1)[0]
    try:
        yield f"{base}/{name}"
    finally:
        with psycopg.connect(admin_url, autocommit=True) as connection:
            connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@dataclass
class Server:
    base: str
    # The agent token serve prints: what every measured call sends.
    token: str
    # A person's token (the owner's, from bootstrap): only the setup uses it.
    person_token: str
    log: Path
    process: subprocess.Popen

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        expect: int = 200,
        *,
        as_person: bool = False,
    ) -> dict:
        token = self.person_token if as_person else self.token
        response = self.session().request(
            method,
            f"{self.base}/api/v1{path}",
            json=body,
            timeout=120,
            headers={"Authorization": f"Bearer {token}"},
        )
        if response.status_code != expect:
            raise RuntimeError(f"{method} {path}: {response.status_code} {response.text[:500]}")
        return response.json()

    _local = threading.local()

    def session(self) -> requests.Session:
        """One keep-alive session per client thread, as an agent's HTTP client would hold."""
        if not hasattr(self._local, "session"):
            self._local.session = requests.Session()
        return self._local.session


@contextlib.contextmanager
def serve(database_url: str, *, extra_env: dict[str, str] | None = None) -> Iterator[Server]:
    """``manage.py serve`` in single-host mode with a Docker runner; stopped afterwards.
    ``extra_env`` is added to serve's environment (the adapter bench's egress overrides)."""
    redis.Redis.from_url(BROKER).flushdb()
    data_dir = Path(tempfile.mkdtemp(prefix="kestrel-bench-"))
    port = free_port()
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("KESTREL_", "DJANGO_", "TEST_"))
    }
    env.update(
        KESTREL_MODE="single-host",
        KESTREL_DATA_DIR=str(data_dir / "var"),
        DATABASE_URL=database_url,
        REDIS_URL=BROKER,
        KESTREL_SANDBOX="docker",
        DJANGO_SETTINGS_MODULE="kestrel_one.settings",
    )
    env.update(extra_env or {})
    log_path = data_dir / "serve.log"
    log = open(log_path, "w+")  # closed below, after the process
    process = subprocess.Popen(
        [sys.executable, "manage.py", "serve", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if process.poll() is not None:
                raise RuntimeError("serve exited:\n" + log_path.read_text()[-3000:])
            try:
                requests.get(f"{base}/api/v1/health", timeout=5)
                break
            except requests.RequestException:
                time.sleep(0.2)
        found = re.search(r"Agent token: (kst_\S+)", log_path.read_text())
        if found is None:
            raise RuntimeError("serve printed no agent token:\n" + log_path.read_text()[-3000:])
        person = subprocess.run(
            [sys.executable, "manage.py", "bootstrap", "--org", "local", "--email", OWNER],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        yield Server(
            base=base,
            token=found.group(1),
            person_token=json.loads(person.stdout)["token"],
            log=log_path,
            process=process,
        )
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
        _remove_warm_containers()
        shutil.rmtree(data_dir, ignore_errors=True)


def _remove_warm_containers() -> None:
    """The local runner's idle warm containers outlive a terminated serve until its next start."""
    listed = subprocess.run(
        ["docker", "ps", "-aq", "--filter", "label=io.kestrel.warm=true"],
        capture_output=True,
        text=True,
    ).stdout.split()
    if listed:
        subprocess.run(["docker", "rm", "-f", *listed], capture_output=True)


@dataclass
class Workspace:
    server: Server
    threads_path: str

    def new_thread(self, title: str) -> str:
        return self.server.call("POST", self.threads_path, {"title": title, "mode": "agent"}, 201)[
            "id"
        ]

    def shell_call(self, thread: str) -> tuple[float, dict]:
        """One governed ``shell.exec echo hi`` through HTTP with ``?wait=``; seconds and body."""
        started = time.perf_counter()
        body = self.server.call(
            "POST",
            f"{self.threads_path}/{thread}/actions?wait=60",
            {"tool": "shell.exec", "args": {"argv": COMMAND}},
            201,
        )
        return time.perf_counter() - started, body


def prepare(server: Server, *, policy: dict | None = None) -> Workspace:
    """The environment, its policy and the project: a person's work, not the agent's."""
    env = server.call("POST", "/orgs/local/environments", {"name": "bench"}, 201, as_person=True)
    document = policy or POLICY
    server.call("PUT", f"/orgs/local/environments/{env['id']}/policy", document, as_person=True)
    project = server.call(
        "POST",
        "/orgs/local/projects",
        {"name": "bench", "environment": env["id"]},
        201,
        as_person=True,
    )
    return Workspace(server, f"/orgs/local/projects/{project['id']}/threads")


def succeeded(body: dict) -> bool:
    result = body.get("result") or {}
    return (
        body.get("state") == "succeeded"
        and result.get("exit_code") == 0
        and result.get("stdout") == "hi\n"
    )


def latency_runs(workspace: Workspace, image: str, threads: int) -> dict[str, list[float]]:
    """Cold (1st) and warm (10th) calls per new thread, a ``docker run --rm`` before each."""
    cold, warm, baseline, failures = [], [], [], []
    for index in range(threads):
        baseline.append(docker_run_once(image))
        thread = workspace.new_thread(f"latency {index}")
        for call in range(1, 11):
            seconds, body = workspace.shell_call(thread)
            if not succeeded(body):
                failures.append(body)
            if call == 1:
                cold.append(seconds)
            elif call == 10:
                warm.append(seconds)
    return {"cold": cold, "warm": warm, "docker_run": baseline, "failures": failures}


def throughput(workspace: Workspace, seconds: float, clients: int = 8) -> dict[str, Any]:
    """Governed calls per second with ``clients`` concurrent threads for ``seconds``."""
    threads = [workspace.new_thread(f"throughput {index}") for index in range(clients)]
    for thread in threads:  # each thread's first call starts its warm sandbox
        workspace.shell_call(thread)
    counts = {"ok": 0, "errors": 0}
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    deadline = time.perf_counter() + seconds

    def client(thread: str) -> None:
        while time.perf_counter() < deadline:
            try:
                took, body = workspace.shell_call(thread)
                ok = succeeded(body)
                problem = "" if ok else str(body)[:300]
            except Exception as error:  # counted, never hidden
                took, ok, problem = 0.0, False, repr(error)[:300]
            with lock:
                counts["ok" if ok else "errors"] += 1
                if ok:
                    latencies.append(took)
                elif len(errors) < 5:
                    errors.append(problem)

    cpu_before = cpu.snapshot()
    started = time.perf_counter()
    workers = [threading.Thread(target=client, args=(thread,)) for thread in threads]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - started
    cpu_used = cpu.per_call(cpu_before, cpu.snapshot(), counts["ok"] + counts["errors"])
    return {
        "cpu_ms_per_call": cpu_used,
        "calls_per_second": counts["ok"] / elapsed,
        "ok": counts["ok"],
        "errors": counts["errors"],
        "error_samples": errors,
        "elapsed_s": elapsed,
        "latencies": latencies,
        "clients": clients,
    }
