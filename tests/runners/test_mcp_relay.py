"""A warm MCP server's relay (runners.mcp.relay): what its log, DIR/relay.log, can hold.

A server decides how often the MCP SDK logs in its client: every line of its stdout that is
not JSON-RPC is an error record. The relay's log keeps such records to one line each, a
kind of record to a few per minute, and the file to ``MAX_LOG_BYTES``; never what the
server wrote.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import docker
import pytest

import runners
from runners.mcp.errors import McpProtocolError
from runners.mcp.relay import MAX_LOG_BYTES, MAX_RECORD_CHARS
from runners.mcp.servers import RELAY_PROTOCOL, SENDING, DockerMcpServers, _ask, _Retry
from runners.mcp.session import RECORDS_PER_KIND, PerKindLimit, server_session
from tests.runners.support import fake_relay, plain_mcp_server
from tests.runners.test_mcp_servers import (  # noqa: F401 - fixtures
    call,
    listed,
    make_profile,
    pin,
    project_workspace,
    servers,
    warm_root,
)

SOURCE = Path(runners.__file__).resolve().parent.parent
GARBAGE_SERVER = ["python3", "/opt/h1-test/server.py", "--garbage"]


@pytest.mark.docker
def test_a_server_writing_lines_that_are_not_json_rpc_leaves_the_relay_log_bounded(
    server_image: str,
    servers: DockerMcpServers,  # noqa: F811 - the imported fixture
    engine: Any,
    project: str,
    project_workspace: Path,  # noqa: F811
    warm_root: Path,  # noqa: F811
) -> None:
    profile = make_profile(server_image, command=GARBAGE_SERVER)
    pinned = pin(profile, listed(profile, project_workspace)["garbage"])
    # What the server writes may be anything of the thread's, a secret too: never logged.
    secret = f"kst_secret_{uuid.uuid4().hex}"
    for _ in range(3):
        # The answer comes after the garbage on the server's stdout: the relay's SDK has
        # read, and logged about, every line of it when the call returns.
        answer = call(
            servers,
            pinned,
            "garbage",
            {"lines": 4000, "text": f"not JSON-RPC {secret}"},
            project=project,
            thread="thr_garbage",
            workspace=project_workspace,
        )
        assert answer["content"][0]["text"] == "written"
    (directory,) = [path for path in warm_root.glob("mcp-*") if path.is_dir()]
    log = (directory / "relay.log").read_bytes()
    assert 0 < len(log) <= MAX_LOG_BYTES
    assert secret.encode() not in log
    assert b"Traceback" not in log
    records = log.decode().splitlines()
    parse_errors = [line for line in records if "Failed to parse JSONRPC message" in line]
    assert parse_errors, records[:5]
    # Each record is one line without the exception's text (it quotes the server's line).
    assert all(len(line) <= MAX_RECORD_CHARS for line in records)
    assert all(line.endswith("(ValidationError)") for line in parse_errors)
    assert len(parse_errors) < 12_000


def test_the_relay_log_stops_at_its_bound_whatever_writes_to_it(tmp_path: Path) -> None:
    """Records of ever new kinds, and text written to stderr directly: the file ends at the
    bound with a line saying so."""
    script = textwrap.dedent(
        """
        import logging, sys, warnings
        from runners.mcp.relay import log_boundedly
        log_boundedly()
        for n in range(20_000):
            logging.getLogger(f"kind{n}").error("record %d: %s", n, "x" * 200)
        warnings.warn("a warning")
        for _ in range(1000):
            print("y" * 1000, file=sys.stderr)
        """
    )
    path = tmp_path / "relay.log"
    with path.open("wb") as stderr:
        subprocess.run(
            [sys.executable, "-c", script], stderr=stderr, cwd=SOURCE, check=True, timeout=120
        )
    log = path.read_bytes()
    assert MAX_LOG_BYTES - 1024 < len(log) <= MAX_LOG_BYTES
    assert log.endswith(b"relay.log: full; nothing more is written\n")


def test_the_sdks_parse_errors_are_logged_without_the_servers_text_and_a_few_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Worker processes (a discovery, a throwaway call) read servers through the same SDK: its
    record of each line that is not JSON-RPC, a traceback quoting the line, went into the
    runner's own log as often as a server wrote one. Every process that imports the session
    module keeps those records to the exception's type, a few a minute."""
    logger = logging.getLogger("mcp.client.stdio")
    (limit,) = [each for each in logger.filters if isinstance(each, PerKindLimit)]
    limit.windows.clear()  # what earlier tests in this process logged
    secret = f"kst_secret_{uuid.uuid4().hex}"
    with caplog.at_level(logging.WARNING, logger="mcp.client.stdio"):
        for _ in range(100):
            try:
                json.loads(f"not JSON-RPC {secret}")
            except ValueError:
                logger.exception("Failed to parse JSONRPC message from server")
    records = [record for record in caplog.records if record.name == "mcp.client.stdio"]
    assert len(records) == RECORDS_PER_KIND
    assert all(
        record.getMessage() == "Failed to parse JSONRPC message from server (JSONDecodeError)"
        and record.exc_info is None
        for record in records
    )
    assert secret not in caplog.text and "Traceback" not in caplog.text


# A server (plain JSON-RPC) whose tool answers after notifications the client's SDK cannot
# validate, and responses to requests nobody sent: what it says in them is MARKER's.
_INVALID_MESSAGES = plain_mcp_server(
    "noisy",
    """\
        for n in range(300):
            send({"jsonrpc": "2.0", "method": "notifications/message",
                  "params": {"level": f"{MARKER}-{n}", "data": MARKER}})
            send({"jsonrpc": "2.0", "method": "notifications/progress",
                  "params": {"progressToken": [MARKER], "progress": MARKER}})
            send({"jsonrpc": "2.0", "id": 10_000 + n, "result": {"said": MARKER}})
        ok = {"content": [{"type": "text", "text": "ok"}]}
        send({"jsonrpc": "2.0", "id": ident, "result": ok})""",
    setup="MARKER = sys.argv[1]",
)


@pytest.mark.docker
def test_what_a_server_sends_the_sdk_cannot_use_reaches_no_log_but_a_few_records(
    server_image: str, engine: Any, project: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Worker processes read servers through the SDK (a discovery, a throwaway call), in the
    runner's own log. Its session logged every notification it could not validate as a
    warning with a traceback that quotes what the server sent, as often as the server sent
    one: 300 of them were 300 records, each a server's words. Every SDK logger a server's
    messages reach keeps its records to the exception's type, a few of a kind a minute."""
    for each in logging.Logger.manager.loggerDict.values():
        for limit in getattr(each, "filters", ()):
            if isinstance(limit, PerKindLimit):
                limit.windows.clear()  # what earlier tests in this process logged
    marker = f"kst_said_{uuid.uuid4().hex}"
    command = ["python3", "-c", _INVALID_MESSAGES, marker]
    profile = make_profile(server_image, workspace="none", command=command)
    client = docker.from_env()

    async def noisy_call() -> Any:
        async with server_session(client, profile, labels={"project": project}, workspace=None) as (
            session,
            _init,
            _container,
        ):
            result = await session.call_tool("noisy", {})
            await session.send_ping()  # every message before the result has been handled
            return result

    try:
        with caplog.at_level(logging.DEBUG):
            result = anyio.run(noisy_call)
    finally:
        client.close()
    assert result.content[0].text == "ok"
    sdk = [
        record
        for record in caplog.records
        if record.name == "client" or record.name.split(".")[0] == "mcp"
    ]
    kinds: dict[tuple[str, str], int] = {}
    for record in sdk:
        kind = (record.name, str(record.msg)[:100])
        kinds[kind] = kinds.get(kind, 0) + 1
        assert record.exc_info is None, record.getMessage()
    assert all(count <= RECORDS_PER_KIND for count in kinds.values()), kinds
    assert marker not in caplog.text
    assert "Traceback" not in caplog.text


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory whose socket paths fit AF_UNIX's bound (a test's tmp_path may not)."""
    path = Path(tempfile.mkdtemp(prefix="kst-relay-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _relay_that(directory: Path, say: bytes) -> tuple[Path, threading.Thread]:
    """A socket at which a relay reads one request, writes ``say`` and closes."""
    sock = directory / f"relay-{uuid.uuid4().hex[:8]}.sock"
    return sock, fake_relay(sock, say=say)


CALL = {"op": "call", "pinned": {}, "tool": "echo", "arguments": {}, "timeout_s": 5}


@pytest.mark.spec("MCP-5")
def test_a_call_a_relay_drops_before_it_says_it_is_sending_may_go_to_another_relay(
    short_dir: Path,
) -> None:
    """A relay that stops at its idle timeout just as a call comes closes the connection
    having sent nothing to its server; the worker reported that ``mcp_protocol_error``
    ("the server ended mid-call") and did not ask another relay. Until the relay writes
    ``SENDING``, a connection that ends is a call not sent (``_Retry``); after it, the tool
    may have run, and the call fails, never to run twice."""
    for said in (b"", b'{"sending": tr'):
        sock, thread = _relay_that(short_dir, said)
        with pytest.raises(_Retry):
            _ask(sock, CALL, 10)
        thread.join(10)
    for said in (SENDING, SENDING + b'{"ok": {"content": '):
        sock, thread = _relay_that(short_dir, said)
        with pytest.raises(McpProtocolError, match="the server ended mid-call"):
            _ask(sock, CALL, 10)
        thread.join(10)
    sock, thread = _relay_that(short_dir, SENDING + b'{"ok": {"content": []}}\n')
    assert _ask(sock, CALL, 10) == {"ok": {"content": []}}
    thread.join(10)


def _relay_dir(root: Path, say: bytes, spec: dict[str, Any]) -> Path:
    """A relay's directory (its spec and socket) whose relay reads one call, writes ``say``
    and closes."""
    directory = root / f"mcp-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    (directory / "spec.json").write_text(json.dumps(spec))
    sock, _thread = _relay_that(directory, say)
    sock.rename(directory / "relay.sock")
    return directory / "relay.sock"


@pytest.mark.spec("MCP-5")
def test_only_a_relay_that_says_when_it_sends_has_a_dropped_call_sent_again(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relay started by an older runner, still serving after an upgrade, never writes
    ``SENDING``: a call it drops may have run, so it fails, and no other relay is asked.
    One of this runner's (its spec's protocol) that drops a call before saying it sends it
    has its call taken by the next relay."""
    pinned = pin(make_profile("sha256:" + "0" * 64), {"name": "echo", "inputSchema": {}})
    answered = SENDING + b'{"ok": {"content": [{"type": "text", "text": "once"}]}}\n'
    manager = DockerMcpServers(runner_id="run_t", idle_seconds=60, max_servers=4, root=short_dir)

    def ask_in_turn(*relays: Path) -> list[Path]:
        asked: list[Path] = []
        waiting = list(relays)

        def relay(self: DockerMcpServers, *args: Any, **kwargs: Any) -> Path:
            asked.append(waiting[0])
            return waiting.pop(0)

        monkeypatch.setattr(DockerMcpServers, "_relay", relay)
        return asked

    def echo() -> dict[str, Any]:
        return manager.call(
            pinned,
            "echo",
            {},
            project="prj_t",
            thread="thr_t",
            call_id="call_t",
            workspace=short_dir,
            timeout_s=10,
        )

    current = {"protocol": RELAY_PROTOCOL}
    asked = ask_in_turn(
        _relay_dir(short_dir, b"", current), _relay_dir(short_dir, answered, current)
    )
    assert echo()["content"] == [{"type": "text", "text": "once"}]
    assert len(asked) == 2
    asked = ask_in_turn(_relay_dir(short_dir, b"", {}), _relay_dir(short_dir, answered, current))
    with pytest.raises(McpProtocolError, match="the server ended mid-call"):
        echo()
    assert len(asked) == 1
