"""A warm MCP server's relay (runners.mcp.relay): what its log, DIR/relay.log, can hold.

A server decides how often the MCP SDK logs in its client: every line of its stdout that is
not JSON-RPC is an error record. The relay's log keeps such records to one line each, a
kind of record to a few per minute, and the file to ``MAX_LOG_BYTES``; never what the
server wrote.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest

import runners
from runners.mcp.relay import MAX_LOG_BYTES, MAX_RECORD_CHARS
from runners.mcp.servers import DockerMcpServers
from runners.mcp.session import RECORDS_PER_KIND, PerKindLimit
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
