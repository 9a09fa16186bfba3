"""A warm MCP server's relay: the one process that owns the server's stdio session.

Celery runs a runner's calls in prefork worker processes; a thread's calls land in any of
them, and any of them may be SIGKILLed. So a warm server's session belongs to none of them:
``runners.mcp.servers`` starts this relay (``python -m runners.mcp.relay DIR``), which
detaches (its own session, reparented away from the worker), starts the server container
(``runners.mcp.session``), initializes it, and serves the worker processes over a Unix
socket in DIR (mode 0700 under the warm sandboxes' 0700 root: only the runner's user
reaches it). One line of JSON per request, one per answer:

- ``{"op": "ping"}``; ``{"op": "stop"}`` (a thread end: now if idle, else after the call);
  ``{"op": "stop_if_idle"}`` (making room under the cap).
- ``{"op": "call", "pinned": {...}, "tool", "arguments", "timeout_s", "call_id"}``: the
  tool list is fetched and the tool's definition checked against ``pinned.tool_sha256``
  before the call, both within ``timeout_s``; ``{"ok": result}``, ``{"error": {"code",
  "message", "details"?}}``, or ``{"retry": true}`` when the call was not sent (the relay
  is stopping, or its server died idle): the worker then starts another relay, and gives
  it what is left of ``timeout_s``. Just before the call goes to the server, the relay
  writes ``{"sending": true}`` (a line before the answer): a connection that ends before
  that line (the relay stopped at its idle timeout as the call came, or was killed while
  it listed) sent nothing to the server, so the worker may ask another relay; one that ends
  after it may have run the tool, and fails the call. (Protocol 2, ``RELAY_PROTOCOL``,
  which the spec names: a worker trusts the silence of no relay older than that.)

Calls are served one at a time. A worker that disconnects before its answer (it was
killed) ends the server at once: its container is removed, so the call has no effect after
the runner's recovery reports it lost, and it is never run twice. The relay also ends, and
removes its container and DIR, after ``idle_seconds`` without a call, when its container
stops, on SIGTERM, SIGINT or SIGHUP (at once, a call in progress included), or when the
risk acceptance a bridged profile names lapses (``risk_expires_at``: now if idle, else
after the call), which it does on its own clock, so a runner that missed the
``mcp.risk.end`` broadcast keeps no network past the decision.

Its stderr is DIR/relay.log, which the server can make the MCP SDK write to (every line of
its stdout that is not JSON-RPC is an error record with a traceback): ``log_boundedly``
keeps each record to one line without traceback, drops a kind of record repeated too often,
and stops the file at ``MAX_LOG_BYTES``. Nothing a server writes, nor a request, is in it.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import docker
from anyio.streams.buffered import BufferedByteReceiveStream

from runners.mcp.errors import McpError, McpListTooLong, McpProtocolError, McpStdoutRefused
from runners.mcp.servers import SENDING, owner_labels
from runners.mcp.session import (
    ENGINE_ERRORS,
    START_TIMEOUT_SECONDS,
    PerKindLimit,
    call_pinned_checked,
    list_tools,
    record_message,
    remove_container,
    server_session,
)

# A request: the pinned profile and the arguments (the command's, so within its bounds).
MAX_REQUEST_BYTES = 8 * 1024 * 1024
CONTAINER_CHECK_SECONDS = 5.0
# relay.log: all the relay ever writes there, in bytes, its last line included.
MAX_LOG_BYTES = 256 * 1024
# One record: a line of at most this many characters.
MAX_RECORD_CHARS = 300
_LOG_FULL = b"relay.log: full; nothing more is written\n"


class BoundedLog(io.TextIOBase):
    """A text stream onto file descriptor ``fd`` that writes ``limit`` bytes in all: what
    would go past it is dropped, and one last line says so."""

    def __init__(self, fd: int, limit: int) -> None:
        self.fd = fd
        self.limit = limit
        self.written = 0
        with contextlib.suppress(OSError):
            self.written = os.fstat(fd).st_size
        self.full = self.written + len(_LOG_FULL) > limit
        self._lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        data = text.encode("utf-8", errors="replace")
        with self._lock:
            if self.full or not data:
                return len(text)
            if self.written + len(data) + len(_LOG_FULL) > self.limit:
                data, self.full = _LOG_FULL, True
            view = memoryview(data)
            with contextlib.suppress(OSError):
                while view:
                    view = view[os.write(self.fd, view) :]
            self.written += len(data)
        return len(text)


class _OneLine(logging.Formatter):
    """A record as one bounded line: never a traceback nor an exception's text (the SDK's
    parse errors quote the server's output), only the exception's type."""

    def format(self, record: logging.LogRecord) -> str:
        message = record_message(record)
        if record.exc_info and record.exc_info[0] is not None:
            message = f"{message} ({record.exc_info[0].__name__})"
        line = f"{self.formatTime(record)} {record.levelname} {record.name}: {message}"
        return line.replace("\n", " ").replace("\r", " ")[:MAX_RECORD_CHARS]


def log_boundedly(fd: int = 2) -> None:
    """Send everything the relay logs or prints to stderr (``fd``) through one
    ``BoundedLog``: records of warnings and worse, one line each, per kind bounded."""
    stream = BoundedLog(fd, MAX_LOG_BYTES)
    sys.stderr = stream
    handler = logging.StreamHandler(stream)
    handler.setFormatter(_OneLine())
    handler.addFilter(PerKindLimit())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    logging.captureWarnings(True)
    logging.raiseExceptions = False  # a failing record is dropped, not printed


class Relay:
    def __init__(self, directory: Path, spec: dict[str, Any], client: Any) -> None:
        self.directory = directory
        self.spec = spec
        self.client = client
        self.session: Any = None
        self.container_id = ""
        self.lock = anyio.Lock()
        self.busy = False
        self.closing = False
        self.last_used = time.monotonic()
        self.scope: anyio.CancelScope | None = None

    def stop(self) -> None:
        self.closing = True
        if self.scope is not None:
            self.scope.cancel()

    async def handle(self, stream: anyio.abc.ByteStream) -> None:
        async with stream:
            reader = BufferedByteReceiveStream(stream)
            try:
                line = await reader.receive_until(b"\n", MAX_REQUEST_BYTES)
                request = json.loads(line)
                op = request["op"]
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.DelimiterNotFound):
                return
            except (ValueError, KeyError, TypeError):
                return
            if op == "ping":
                answer: dict[str, Any] = {"ok": {"container": self.container_id}}
            elif op == "stop":
                self.closing = True
                if not self.busy:
                    self.stop()
                answer = {"ok": True}
            elif op == "stop_if_idle":
                idle = not self.busy and not self.lock.locked()
                if idle:
                    self.stop()
                answer = {"ok": idle}
            elif op == "call":
                answer = await self._call(request, stream, reader)
                if answer is None:
                    return  # the worker is gone; so is the server
                if self.closing and "retry" not in answer:
                    # A server in an unknown state (the call timed out, or it broke the
                    # protocol) ends before the worker hears of the call's end: a call
                    # reported failed has no effect after it.
                    await anyio.to_thread.run_sync(remove_container, self.client, self.container_id)
            else:
                answer = {"error": {"code": "mcp_protocol_error", "message": "unknown op"}}
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                # UTF-8, as the worker's bound counts it: as ASCII JSON a character outside
                # the BMP is twelve bytes, and a bounded result would not fit the answer.
                # (``json.loads`` reads bytes with surrogatepass, so a lone one travels.)
                data = json.dumps(answer, ensure_ascii=False).encode("utf-8", "surrogatepass")
                await stream.send(data + b"\n")
            if self.closing and not self.busy:
                self.stop()

    async def _call(
        self,
        request: dict[str, Any],
        stream: anyio.abc.ByteStream,
        reader: BufferedByteReceiveStream,
    ) -> dict[str, Any] | None:
        if self.closing:
            return {"retry": True}
        async with self.lock:
            if self.closing:
                return {"retry": True}
            self.busy = True
            call_file = self.directory / "call"
            with contextlib.suppress(OSError):
                call_file.write_text(str(request.get("call_id", "")))
            try:
                return await self._call_watched(request, stream, reader)
            finally:
                self.busy = False
                self.last_used = time.monotonic()
                with contextlib.suppress(OSError):
                    call_file.write_text("")
                    os.utime(self.directory / "spec.json")

    async def _call_watched(
        self,
        request: dict[str, Any],
        stream: anyio.abc.ByteStream,
        reader: BufferedByteReceiveStream,
    ) -> dict[str, Any] | None:
        outcome: dict[str, Any] = {}
        lost = False

        async def sending() -> None:
            # Until this line the worker knows nothing went to the server (module docs).
            await stream.send(SENDING)

        async def run(scope: anyio.CancelScope) -> None:
            try:
                # One timeout for the whole call: the listing takes its share of it.
                timeout = float(request["timeout_s"])
                deadline = anyio.current_time() + timeout
                try:
                    tools = await list_tools(self.session, timeout_s=timeout)
                except (McpListTooLong, McpStdoutRefused):
                    # The server answers, with a list past the bounds or what its session
                    # cannot take: another server of the same image would do the same, so
                    # the call fails here.
                    raise
                except McpProtocolError:
                    # The server no longer answers: nothing was sent to it. Another relay,
                    # with a new server, takes the call.
                    outcome["retry"] = True
                    self.closing = True
                    return
                outcome["ok"] = await call_pinned_checked(
                    self.session,
                    request["pinned"],
                    request["tool"],
                    request["arguments"],
                    tools=tools,
                    timeout_s=timeout,
                    deadline=deadline,
                    before_call=sending,
                )
            except McpError as error:
                body = {"code": error.code, "message": str(error)}
                if error.details is not None:
                    body["details"] = error.details
                outcome["error"] = body
                if error.code in ("mcp_timeout", "mcp_protocol_error"):
                    self.closing = True  # a server in an unknown state is not kept
            except Exception as error:
                outcome["error"] = {
                    "code": "mcp_protocol_error",
                    "message": f"{type(error).__name__}: {str(error)[:300]}",
                }
                self.closing = True
            finally:
                scope.cancel()

        async def watch(scope: anyio.CancelScope) -> None:
            nonlocal lost
            with contextlib.suppress(Exception):
                await reader.receive(1)
            lost = True
            scope.cancel()

        async with anyio.create_task_group() as group:
            group.start_soon(run, group.cancel_scope)
            group.start_soon(watch, group.cancel_scope)
        if lost and not outcome:
            # The worker died mid-call: end the server now, before recovery reports it.
            await anyio.to_thread.run_sync(remove_container, self.client, self.container_id)
            self.stop()
            return None
        return outcome

    async def watch_idle(self) -> None:
        idle = float(self.spec["idle_seconds"])
        # A bridged server's network lasts as long as its risk acceptance, not longer.
        lapses_at = self.spec["profile"].get("risk_expires_at")
        next_check = time.monotonic() + CONTAINER_CHECK_SECONDS
        while True:
            await anyio.sleep(min(1.0, idle))
            now = time.monotonic()
            if not self.busy and now - self.last_used >= idle:
                self.stop()
                return
            if lapses_at is not None and time.time() >= lapses_at:
                self.closing = True
                if not self.busy:
                    self.stop()
                    return
            if now >= next_check:
                next_check = now + CONTAINER_CHECK_SECONDS
                if not await anyio.to_thread.run_sync(self._container_running):
                    self.closing = True
                    if not self.busy:
                        self.stop()
                        return

    def _container_running(self) -> bool:
        try:
            state = self.client.api.inspect_container(self.container_id)["State"]
        except ENGINE_ERRORS:
            return False
        return bool(state.get("Running"))


# What ends a relay from outside without a word on its socket: a service manager's stop
# (SIGTERM to every process of the runner's), an operator, a hangup.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


async def serve(directory: Path, spec: dict[str, Any], ready: Any) -> None:
    """Serve until the relay stops, or until a ``STOP_SIGNALS`` comes: then at once, as when
    its container stops, so that the container and DIR go with the relay (the signal's
    default would end the relay alone, and leave a server that ignores the end of its stdin
    running, with the network a bridged profile gives it, until the runner next starts)."""
    async with anyio.create_task_group() as group:
        group.start_soon(_cancel_on_signal, group.cancel_scope)
        await _serve(directory, spec, ready)
        group.cancel_scope.cancel()


async def _cancel_on_signal(scope: anyio.CancelScope) -> None:
    with anyio.open_signal_receiver(*STOP_SIGNALS) as signals:
        async for _signum in signals:
            scope.cancel()
            return


async def _serve(directory: Path, spec: dict[str, Any], ready: Any) -> None:
    client = docker.from_env()
    relay = Relay(directory, spec, client)
    announced = False
    try:
        workspace = Path(spec["workspace"]) if spec.get("workspace") else None
        async with server_session(
            client,
            spec["profile"],
            labels={**spec["labels"], **owner_labels()},
            workspace=workspace,
            # What the call that started it leaves of its start bound (its worker waits no
            # longer for the relay's word).
            start_timeout=float(spec.get("start_timeout", START_TIMEOUT_SECONDS)),
        ) as (session, init, container_id):
            relay.session, relay.container_id = session, container_id
            (directory / "container").write_text(container_id)
            listener = await anyio.create_unix_listener(directory / "relay.sock")
            info = init.server_info
            _announce(ready, {"ready": True, "container": container_id, "server": info.name})
            announced = True
            with anyio.CancelScope() as scope:
                relay.scope = scope
                async with listener, anyio.create_task_group() as group:
                    group.start_soon(listener.serve, relay.handle)
                    group.start_soon(relay.watch_idle)
    except McpError as error:
        if not announced:
            _announce(ready, {"error": {"code": error.code, "message": str(error)}})
    except Exception as error:
        if not announced:
            message = f"the relay failed: {type(error).__name__}: {str(error)[:300]}"
            _announce(ready, {"error": {"code": "mcp_start_failed", "message": message}})
    finally:
        if relay.container_id:
            remove_container(client, relay.container_id)
        shutil.rmtree(directory, ignore_errors=True)
        client.close()


def _announce(ready: Any, message: dict[str, Any]) -> None:
    """Tell the starting worker (the pipe it reads) once, then never write there again."""
    with contextlib.suppress(OSError, ValueError):
        ready.write(json.dumps(message) + "\n")
        ready.flush()
        ready.close()


def main(argv: list[str]) -> int:
    directory = Path(argv[1])
    spec = json.loads((directory / "spec.json").read_text())
    # Detach: the starting worker reaps this parent at once, and the relay (the child) is
    # no worker's child, so neither a worker's death nor its exit touches it.
    if os.fork():
        os._exit(0)
    ready = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    log_boundedly()
    (directory / "pid").write_text(str(os.getpid()))
    anyio.run(serve, directory, spec, ready)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
