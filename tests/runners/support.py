"""Shared pieces of the runner tests: their Redis database, a runner's configuration and a
worker process's environment."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from pathlib import Path

from runners.config import RunnerConfig

# The Redis database the runner tests use as broker and call state. It is flushed, so two
# suites on one machine need different ones (TEST_RUNNER_REDIS_URL).
RUNNER_REDIS_URL = os.environ.get("TEST_RUNNER_REDIS_URL", "redis://127.0.0.1:6379/14")


def fake_relay(sock: Path, *, say: bytes = b"", calls: int | None = 1) -> threading.Thread:
    """At ``sock``, a relay that reads each request, writes ``say`` and closes: for ``calls``
    connections, or for as many as come (None). The thread serving it, started."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock))
    listener.listen(8)
    listener.settimeout(60)

    def serve() -> None:
        with listener, contextlib.suppress(OSError):
            served = 0
            while calls is None or served < calls:
                connection, _ = listener.accept()
                with connection:
                    connection.makefile("rb").readline()
                    connection.sendall(say)
                served += 1

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def runner_config(
    folder: Path,
    *,
    runner_id: str,
    pool: str,
    runner_key: bytes,
    control_public_key: bytes,
    workspace_root: Path,
    max_call_seconds: int = 20,
) -> RunnerConfig:
    """A Docker runner's configuration on ``RUNNER_REDIS_URL``, its key files in ``folder``."""
    key_file = folder / "runner.pem"
    key_file.write_bytes(runner_key)
    key_file.chmod(0o600)
    control_file = folder / "control.pub"
    control_file.write_bytes(control_public_key)
    return RunnerConfig(
        runner_id=runner_id,
        pool=pool,
        key_file=key_file,
        control_public_key_file=control_file,
        broker_url=RUNNER_REDIS_URL,
        state_url=RUNNER_REDIS_URL,
        workspace_root=workspace_root,
        sandbox="docker",
        max_call_seconds=max_call_seconds,
    )


def worker_environment(config: RunnerConfig) -> dict[str, str]:
    """What ``python -m runners worker`` gets to run as ``config``: its ``KESTREL_*``
    variables, PATH, LANG and the engine's DOCKER_HOST, nothing else of the tests'."""
    env = {
        "PATH": os.environ["PATH"],
        "LANG": "C.UTF-8",
        "KESTREL_RUNNER_ID": config.runner_id,
        "KESTREL_RUNNER_POOL": config.pool,
        "KESTREL_RUNNER_KEY_FILE": str(config.key_file),
        "KESTREL_CONTROL_PUBLIC_KEY_FILE": str(config.control_public_key_file),
        "KESTREL_BROKER_URL": config.broker_url,
        "KESTREL_WORKSPACE_ROOT": str(config.workspace_root),
        "KESTREL_SANDBOX": config.sandbox,
        "KESTREL_MAX_CALL_SECONDS": str(config.max_call_seconds),
    }
    if "DOCKER_HOST" in os.environ:
        env["DOCKER_HOST"] = os.environ["DOCKER_HOST"]
    return env


_LIST = """\
        send({"jsonrpc": "2.0", "id": ident, "result": {"tools": [TOOL]}})"""


def plain_mcp_server(name: str, on_call: str, *, setup: str = "", on_list: str = _LIST) -> str:
    """The Python source of an MCP server written with no SDK (plain JSON-RPC on stdio), for
    the tests that need a server to misbehave in ways the SDK would not let it: one tool
    ``name``, the 2025-11-25 handshake, ``{}`` for any other request, and ``on_call`` (code
    run for ``tools/call``, with ``send``, ``message`` and ``ident`` at hand, indented by 8
    spaces) after ``setup`` (module-level lines, such as ``MARKER = sys.argv[1]``);
    ``on_list`` likewise for ``tools/list`` (by default the one tool, ``TOOL``)."""
    tool = {"name": name, "inputSchema": {"type": "object"}, "annotations": {"readOnlyHint": True}}
    info = {"name": name, "version": "1"}
    return f"""
import json, sys, time
{setup}
def send(message):
    sys.stdout.write(json.dumps(message) + "\\n"); sys.stdout.flush()
TOOL = {tool!r}
INFO = {info!r}
for line in sys.stdin:
    message = json.loads(line)
    method, ident = message.get("method"), message.get("id")
    if method == "initialize":
        version = message["params"]["protocolVersion"]
        send({{"jsonrpc": "2.0", "id": ident, "result": {{"protocolVersion": version,
              "capabilities": {{"tools": {{}}}}, "serverInfo": INFO}}}})
    elif method == "tools/list":
{on_list}
    elif method == "tools/call":
{on_call}
    elif ident is not None:
        send({{"jsonrpc": "2.0", "id": ident, "result": {{}}}})
"""
