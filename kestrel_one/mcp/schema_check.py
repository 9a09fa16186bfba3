"""Checking ``mcp.call`` arguments against a tool's recorded input schema, within a time
bound.

The schema is the MCP server's, and untrusted: JSON Schema has costs that no size bound
limits (a backtracking ``pattern`` such as ``^(a|a)+$`` on 40 characters, ``uniqueItems``
over many objects, applicators nested under references), and jsonschema runs them in plain
Python, which nothing in the same process can interrupt: a request's check held its worker
and its transaction for minutes. So each process checks through a helper process of its own
(``schema_worker.py``, started on first use: the standard library and jsonschema only), one
check at a time, and a check that takes longer than ``CHECK_TIMEOUT_SECONDS`` ends the helper
(the next check starts another) and refuses the call.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

__all__ = ["CHECK_TIMEOUT_SECONDS", "SchemaCheckFailed", "argument_errors"]

# How long one check may take. Ordinary arguments and schemas take milliseconds.
CHECK_TIMEOUT_SECONDS = 2.0
WORKER = Path(__file__).with_name("schema_worker.py")


class SchemaCheckFailed(Exception):
    """The check did not come to an answer: ``reason`` ``timeout`` (it took too long) or
    ``unusable`` (the schema cannot be used: a reference to elsewhere, say)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class _Helper:
    """This process's helper: started on first use, and again in a forked child (which must
    not share its parent's pipes) or after one was ended."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._pid = 0

    def _running(self) -> subprocess.Popen[bytes]:
        if self._process is None or self._pid != os.getpid() or self._process.poll() is not None:
            self._process = subprocess.Popen(
                [sys.executable, "-I", str(WORKER)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                close_fds=True,
            )
            self._pid = os.getpid()
        return self._process

    def _end(self) -> None:
        if self._process is not None and self._pid == os.getpid():
            self._process.kill()
            self._process.wait()
        self._process = None

    def ask(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        line = json.dumps(request, separators=(",", ":")).encode() + b"\n"
        with self._lock:
            process = self._running()
            assert process.stdin is not None and process.stdout is not None
            try:
                process.stdin.write(line)
                process.stdin.flush()
                ready, _, _ = select.select([process.stdout], [], [], timeout_s)
                if not ready:
                    self._end()
                    raise SchemaCheckFailed("timeout")
                answer = process.stdout.readline()
            except OSError as error:  # the helper died: start another next time
                self._end()
                raise SchemaCheckFailed("unusable", type(error).__name__) from None
            if not answer:
                self._end()
                raise SchemaCheckFailed("unusable", "the checker ended")
        return dict(json.loads(answer))


_HELPER = _Helper()


def argument_errors(
    schema: Any, arguments: Any, *, limit: int, timeout_s: float = CHECK_TIMEOUT_SECONDS
) -> list[tuple[str, str]]:
    """``(field, message)`` of each error of ``arguments`` under ``schema`` (JSON Schema
    2020-12), at most ``limit``, ordered by path; ``SchemaCheckFailed`` if the check takes
    longer than ``timeout_s`` or the schema cannot be used."""
    answer = _HELPER.ask({"schema": schema, "arguments": arguments, "limit": limit}, timeout_s)
    if "unusable" in answer:
        raise SchemaCheckFailed("unusable", str(answer["unusable"]))
    return [(str(field), str(message)) for field, message in answer["errors"]]
