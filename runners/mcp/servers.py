"""``DockerMcpServers``: the runner's ``McpServers`` (runners.contract.toolspec) on Docker.

A call of a thread goes to the thread's warm server for the same (project, thread, server,
profile digest) on this runner host, through its relay (``runners.mcp.relay``), started on
first use under a per-key lock so that two worker processes never start two. A call
without a thread, of a thread that ended, or with the cap reached and nothing idle to make
room, gets a throwaway server in this process: started, checked, called once, removed.
Warm servers share the warm sandboxes' settings (KESTREL_WARM_IDLE_SECONDS,
KESTREL_WARM_MAX_CONTAINERS, KESTREL_WARM_AGENT_DIR); the cap counts MCP servers on their
own. docs/runners.md ("MCP servers") has the design.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import docker
import docker.errors

import runners
from runners.config import DEFAULT_MAX_CALL_SECONDS
from runners.contract.mcp import MAX_OUTPUT_CHARS, profile_digest
from runners.mcp.errors import (
    ERRORS_BY_CODE,
    McpError,
    McpProtocolError,
    McpStartFailed,
    McpTimeout,
    McpToolChanged,
    McpUnavailable,
)
from runners.mcp.session import (
    ENGINE_ERRORS,
    MCP_LABEL,
    START_TIMEOUT_SECONDS,
    call_pinned,
    remove_container,
    server_session,
)
from runners.sandbox.base import SandboxUnavailable
from runners.sandbox.docker import LABEL_PREFIX
from runners.sandbox.warm_host import agent_root_directory

__all__ = [
    "MCP_OWNER_LABEL",
    "MCP_WARM_LABEL",
    "DockerMcpServers",
    "owner_labels",
    "reap_mcp_call",
    "refuse_ended_risk",
    "remove_orphaned_mcp_servers",
    "remove_stale_mcp_servers",
    "stop_mcp_servers",
]

MCP_WARM_LABEL = f"{LABEL_PREFIX}mcp-warm"
# Every MCP server container the runner makes (a relay's, a throwaway call's, a discovery's)
# names the process that owns it and removes it when done: boot id, pid and start time, so
# a pid reused after that process died (or the host rebooted) names no one.
MCP_OWNER_LABEL = f"{LABEL_PREFIX}mcp-owner"
RELAY_PREFIX = "mcp-"
# An answer, UTF-8 JSON (runners.mcp.relay): the bounded result (text up to MAX_OUTPUT_CHARS
# characters, each at most six bytes as JSON, a control character escaped; other blocks and
# the structured content within MAX_OUTPUT_CHARS bytes each), an error's details (64 KiB)
# and the frame.
MAX_ANSWER_BYTES = 8 * MAX_OUTPUT_CHARS + 256 * 1024
# What a relay writes just before it sends a call to its server (runners.mcp.relay): until
# then, a connection that ends sent nothing.
SENDING = b'{"sending": true}\n'
# A relay's protocol (its spec's "protocol"): 2 writes SENDING. A relay started by an older
# runner, still serving after an upgrade, does not; a call it drops may have run.
RELAY_PROTOCOL = 2
# Beyond the call's own timeout (which covers the list before it): the relay's own answer,
# which comes once it has removed a server that timed out. Within Celery's hard limit,
# 30 s past KESTREL_MAX_CALL_SECONDS (runners.worker), with room for the report.
ANSWER_GRACE_SECONDS = 10.0
# How long a worker that ends a relay (its call lost or unanswered) waits for the key's lock.
END_LOCK_SECONDS = 5.0


class _Retry(Exception):
    """The relay did not send the call (stopping, or its server died idle)."""


class _Budget:
    """What one call may still spend on the runner: on starting its servers (all of them
    together, ``start_timeout``), on listing and calling (its ``timeout_s``, over every
    server asked), and on both within ``max_call_seconds`` from now: the runner's ceiling,
    past which Celery ends the worker."""

    def __init__(self, start_timeout: float, timeout_s: float, max_call_seconds: float) -> None:
        self.start_timeout = self.start = start_timeout
        self.timeout_s = self.call = timeout_s
        self.max_call = max_call_seconds
        self.ends = time.monotonic() + max_call_seconds

    def start_left(self, tool: str) -> float:
        """What a start may still take; ``McpStartFailed`` if nothing."""
        left = min(self.start, self.ends - time.monotonic())
        if left <= 0:
            raise McpStartFailed(
                f"the server for the call of {tool} did not start within "
                f"{self.start_timeout:g} s, or the {self.max_call:g} s a call may take on "
                "this runner (KESTREL_MAX_CALL_SECONDS)"
            )
        return left

    def start_by(self) -> float:
        """When a start now must be done (the clock of ``time.monotonic``)."""
        now = time.monotonic()
        return now + max(min(self.start, self.ends - now), 0.0)

    def started(self, since: float) -> None:
        self.start -= time.monotonic() - since

    def call_left(self, tool: str) -> float:
        """What the call may still take; ``McpTimeout`` if nothing."""
        if self.call <= 0:
            raise McpTimeout(f"the call of {tool} did not end within its {self.timeout_s:g} s")
        left = min(self.call, self.ends - time.monotonic())
        if left <= 0:
            raise McpTimeout(
                f"the call of {tool} has no time left: starting its server took what was left "
                f"of the {self.max_call:g} s a call may take on this runner "
                "(KESTREL_MAX_CALL_SECONDS)"
            )
        return left

    def called(self, since: float) -> None:
        self.call -= time.monotonic() - since


@dataclass
class DockerMcpServers:
    runner_id: str
    idle_seconds: float
    max_servers: int
    # (project, thread) -> whether the thread ended (the runner's call state).
    thread_ended: Callable[[str, str], bool] | None = None
    # risk acceptance -> whether an ``mcp.risk.end`` about it reached the pool (call state).
    risk_ended: Callable[[str], bool] | None = None
    root: Path | None = None
    # The longest a call's servers may take to start, all of them together (waiting for
    # another process starting the same one, making room, the relay, ``initialize``).
    start_timeout: float = START_TIMEOUT_SECONDS
    # KESTREL_MAX_CALL_SECONDS: a call's whole time here, its servers' start included.
    max_call_seconds: float = DEFAULT_MAX_CALL_SECONDS

    def _root(self) -> Path:
        if self.root is None:
            try:
                self.root = agent_root_directory()
            except SandboxUnavailable as error:
                raise McpUnavailable(str(error)) from None
        return self.root

    # --- McpServers ------------------------------------------------------------------

    def call(
        self,
        pinned: Mapping[str, Any],
        tool: str,
        arguments: Mapping[str, Any],
        *,
        project: str,
        thread: str | None,
        call_id: str,
        workspace: Path,
        timeout_s: float,
    ) -> dict[str, Any]:
        profile = pinned["profile"]
        if profile_digest(profile) != pinned["profile_sha256"]:
            raise McpStartFailed("the pinned profile does not match its digest; not started")
        refuse_ended_risk(profile, self.risk_ended)
        # Two bounds, as a tool sandbox has: the start (``start_timeout``), then the listing
        # and the call (``timeout_s``); and all of it within the runner's ceiling, past
        # which Celery ends the worker: the call gets what the start left of it, if less.
        budget = _Budget(self.start_timeout, timeout_s, self.max_call_seconds)
        labels = {"project": project, "runner": self.runner_id}
        if thread is None or self.max_servers == 0 or self._ended(project, thread):
            return self._call_once(pinned, tool, arguments, labels, call_id, workspace, budget)
        request = {
            "op": "call",
            "pinned": dict(pinned),
            "tool": tool,
            "arguments": dict(arguments),
            "timeout_s": timeout_s,
            "call_id": call_id,
        }
        # The call's one timeout covers every server that is asked for it: an attempt that
        # came back unsent (a relay whose server refused its list) used part of it; and
        # one start bound covers every server started for it.
        for attempt in range(2):
            # The first attempt sends the call to a relay whose socket is there, unasked: a
            # relay that is gone or stopping sends nothing (_Retry), and the second attempt
            # asks it first, replacing it if it does not answer.
            began = time.monotonic()
            relay = self._relay(
                project,
                thread,
                pinned,
                workspace,
                {**labels, "thread": thread},
                ask=attempt > 0,
                start_by=budget.start_by(),
            )
            budget.started(began)
            if relay is None:
                break
            serving = _relay_container(relay.parent)
            announces = (_spec(relay.parent) or {}).get("protocol") == RELAY_PROTOCOL
            answer = None
            asked, left = time.monotonic(), budget.call_left(tool)
            try:
                answer = _ask(
                    relay,
                    {**request, "timeout_s": left},
                    left + ANSWER_GRACE_SECONDS,
                    announces=announces,
                )
                return _answer(answer)
            except _Retry:
                budget.called(asked)
                continue
            except McpError:
                if answer is None:
                    # Sent, and then the relay was lost or gave no answer in time: its server
                    # may still be running the tool. It ends before the call is reported
                    # failed, so a failed call has no effect after it. (An answer that is an
                    # error came from a relay that has seen to its server.)
                    self._end_relay(relay.parent, serving)
                raise
            finally:
                # The thread may have ended while the server started or the call ran (the
                # notice reached another process): its server goes now, not when idle.
                if self._ended(project, thread):
                    self.end_thread(project, thread)
        return self._call_once(pinned, tool, arguments, labels, call_id, workspace, budget)

    def _end_relay(self, directory: Path, serving: str) -> None:
        """End container ``serving``, which a call was sent to, then the relay of
        ``directory`` if it still serves it (another worker may have replaced it meanwhile).

        The container goes first and whatever holds the key's lock (a worker making room,
        or replacing this very relay): the call is about to be reported failed, and its
        tool must not run after that. The relay, its server gone, stops on its own at its
        next look at the container if the lock is not had in time."""
        if not serving:
            return
        client = _client()
        try:
            remove_container(client, serving)
        finally:
            client.close()
        with contextlib.suppress(McpStartFailed):
            with _flock(directory.parent / f"{directory.name}.lock", END_LOCK_SECONDS):
                if _relay_container(directory) == serving:
                    _kill_relay(directory)

    def _ended(self, project: str, thread: str) -> bool:
        if self.thread_ended is None:
            return False
        try:
            return bool(self.thread_ended(project, thread))
        except Exception:
            return True

    def _call_once(
        self,
        pinned: Mapping[str, Any],
        tool: str,
        arguments: Mapping[str, Any],
        labels: dict[str, str],
        call_id: str,
        workspace: Path,
        budget: _Budget,
    ) -> dict[str, Any]:
        """A throwaway server for one call, labelled with the call (reaped by recovery)."""
        client = _client()

        async def once() -> dict[str, Any]:
            began = time.monotonic()
            async with server_session(
                client,
                pinned["profile"],
                labels={**labels, "call": call_id, **owner_labels()},
                workspace=workspace,
                start_timeout=budget.start_left(tool),
            ) as (session, _init, _container):
                budget.started(began)
                # Ended while it started (``call`` checked before): no relay is there for
                # the end to stop, so it is refused here, before its call.
                refuse_ended_risk(pinned["profile"], self.risk_ended)
                return await call_pinned(
                    session, pinned, tool, arguments, timeout_s=budget.call_left(tool)
                )

        try:
            remove_orphaned_mcp_servers(self.runner_id, client)
            return anyio.run(once)
        finally:
            client.close()

    # --- warm relays -----------------------------------------------------------------

    def _relay(
        self,
        project: str,
        thread: str,
        pinned: Mapping[str, Any],
        workspace: Path,
        labels: dict[str, str],
        *,
        ask: bool,
        start_by: float,
    ) -> Path | None:
        """The socket of the key's relay, started if there is none (or, with ``ask``, if
        none answers) by ``start_by`` (``time.monotonic``); None: use a throwaway."""
        root = self._root()
        key = "\0".join(
            (self.runner_id, project, thread, pinned["profile"]["server"], pinned["profile_sha256"])
        )
        name = RELAY_PREFIX + hashlib.sha256(key.encode()).hexdigest()[:24]
        directory = root / name
        sock = directory / "relay.sock"
        if not ask and sock.exists():
            return sock
        # Another process may be starting it: that start is within this one's bound too.
        with _flock(root / f"{name}.lock", start_by - time.monotonic()):
            if sock.exists():
                wait = _step(start_by)
                try:
                    _ask(sock, {"op": "ping"}, wait)
                    return sock
                except (_Retry, McpError):
                    _kill_relay(directory)
            client = _client()
            try:
                remove_orphaned_mcp_servers(self.runner_id, client)
            finally:
                client.close()
            if not self._make_room(root, keep=name, start_by=start_by):
                return None
            _step(start_by)  # no relay is started that has no time left to start
            # The acceptance a bridged profile names may have ended since ``call`` checked it
            # (the ``mcp.risk.end`` came while this call waited for the lock or made room):
            # nothing starts under it now.
            refuse_ended_risk(pinned["profile"], self.risk_ended)
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir(mode=0o700)
            spec = {
                "profile": pinned["profile"],
                "labels": {**labels, "mcp-warm": "true", "mcp-relay": str(directory)},
                "workspace": str(workspace) if pinned["profile"]["workspace"] != "none" else None,
                "idle_seconds": self.idle_seconds,
                "project": project,
                "thread": thread,
                "runner": self.runner_id,
                "start_timeout": max(start_by - time.monotonic(), 0.0),
                "protocol": RELAY_PROTOCOL,
            }
            (directory / "spec.json").write_text(json.dumps(spec))
            self._spawn(directory, start_by)
            # And once it runs: an end recorded while it started found no relay to stop
            # (``end_risk_acceptance`` records the end first, then stops the relays it sees),
            # so one of the two always sees the other, and no bridged server outlives it.
            try:
                refuse_ended_risk(pinned["profile"], self.risk_ended)
            except McpStartFailed:
                _kill_relay(directory)
                raise
            return sock

    def _spawn(self, directory: Path, start_by: float) -> None:
        env = dict(os.environ)
        source = str(Path(runners.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [source, env.get("PYTHONPATH")]))
        log = open(directory / "relay.log", "wb")
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "runners.mcp.relay", str(directory)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,
                close_fds=True,
                env=env,
            )
        finally:
            log.close()
        assert process.stdout is not None
        try:
            process.wait(timeout=30)  # the launcher forks the relay and exits at once
            line = _read_line(process.stdout, start_by - time.monotonic())
        finally:
            process.stdout.close()
        if line is None:
            _kill_relay(directory)
            raise McpStartFailed(
                "the server's relay did not report its start in time (at most "
                f"{self.start_timeout:g} s for a call's servers to start)"
            )
        try:
            message = json.loads(line)
        except ValueError:
            message = {}
        if message.get("ready") is True:
            return
        error = message.get("error") or {}
        code, text = str(error.get("code", "")), str(error.get("message", "the relay failed"))
        raise ERRORS_BY_CODE.get(code, McpStartFailed)(text[:2000])

    def _make_room(self, root: Path, *, keep: str, start_by: float) -> bool:
        """At most ``max_servers`` warm servers on this host: stop the least recently used
        idle ones; False when every one is busy. Part of a start, so within ``start_by``:
        a relay that does not answer in time is ended, as one that does not answer at all."""
        relays = [d for d in _relay_dirs(root) if d.name != keep and (d / "relay.sock").exists()]
        excess = len(relays) - self.max_servers + 1
        for directory in sorted(relays, key=_last_used):
            if excess <= 0:
                break
            wait = _step(start_by)
            try:
                if _ask(directory / "relay.sock", {"op": "stop_if_idle"}, wait).get("ok"):
                    excess -= 1
            except (_Retry, McpError):
                _kill_relay(directory)
                excess -= 1
        return excess <= 0

    def end_thread(self, project: str, thread: str) -> int:
        """Stop the thread's warm servers on this host (busy ones after their call)."""
        return self._stop_where(
            lambda spec: (spec.get("project"), spec.get("thread")) == (project, thread)
        )

    def end_project(self, project: str) -> int:
        """Stop the warm servers of every thread of a deleted project on this host (busy ones
        after their call): they mount its workspace, and no call of it comes again."""
        return self._stop_where(lambda spec: spec.get("project") == project)

    def end_risk_acceptance(self, acceptance: str) -> int:
        """Stop the warm servers on this host whose profile is under risk acceptance
        ``acceptance`` (busy ones after their call): it ended, and their containers have the
        network it gave. The next call's profile has none, so a new container starts."""
        return self._stop_where(
            lambda spec: (spec.get("profile") or {}).get("risk_acceptance") == acceptance
        )

    def _stop_where(self, matches: Callable[[dict[str, Any]], bool]) -> int:
        stopped = 0
        try:
            root = self._root()
        except McpUnavailable:
            return 0
        for directory in _relay_dirs(root):
            spec = _spec(directory)
            if spec is None or spec.get("runner") != self.runner_id or not matches(spec):
                continue
            try:
                _ask(directory / "relay.sock", {"op": "stop"}, 10)
            except (_Retry, McpError):
                _kill_relay(directory)
            stopped += 1
        return stopped


def stop_mcp_servers(runner_id: str) -> int:
    """The runner is stopping: stop each of its warm servers on this host (a busy one after
    its call); how many."""
    try:
        root = agent_root_directory()
    except SandboxUnavailable:
        return 0
    stopped = 0
    for directory in _relay_dirs(root):
        spec = _spec(directory)
        if spec is None or spec.get("runner") != runner_id:
            continue
        try:
            _ask(directory / "relay.sock", {"op": "stop"}, 10)
        except (_Retry, McpError):
            _kill_relay(directory)
        stopped += 1
    return stopped


def _answer(answer: dict[str, Any]) -> dict[str, Any]:
    if answer.get("retry") is True:
        raise _Retry
    if "ok" in answer and isinstance(answer["ok"], dict):
        return answer["ok"]
    error = answer.get("error")
    if not isinstance(error, dict):
        raise McpProtocolError("the server's relay gave a malformed answer")
    code, message, details = str(error.get("code")), str(error.get("message")), error.get("details")
    if code == McpToolChanged.code and isinstance(details, dict):
        raise McpToolChanged.relayed(message, details)
    raise ERRORS_BY_CODE.get(code, McpProtocolError)(message)


def _ask(
    sock: Path, request: dict[str, Any], timeout: float, *, announces: bool = True
) -> dict[str, Any]:
    """One request to a relay and its answer. ``_Retry`` if nothing reached it, or, for a
    call, if the connection ended before the relay said it was sending the call to its
    server (``SENDING``): then nothing was, and another relay may take it. A relay that
    does not say so (``announces`` false: an older one) may have sent any call it got."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.settimeout(min(10, timeout))
        try:
            connection.connect(str(sock))
            connection.sendall(json.dumps(request).encode() + b"\n")
        except OSError:
            raise _Retry from None
        connection.settimeout(timeout)
        data = b""
        calling = request["op"] == "call"
        sent = calling and not announces
        try:
            while not data.endswith(b"\n"):
                chunk = connection.recv(1 << 20)
                if not chunk:
                    break
                data += chunk
                if calling and not sent and data.startswith(SENDING):
                    data, sent = data[len(SENDING) :], True
                if len(data) > MAX_ANSWER_BYTES:
                    raise McpProtocolError("the server's relay answered too much")
        except TimeoutError:
            raise McpTimeout("the server did not answer in time") from None
        except OSError as error:
            if not sent:
                raise _Retry from None
            raise McpProtocolError(f"lost the server mid-call: {error}") from None
        if not data.endswith(b"\n"):
            if not sent:
                raise _Retry
            raise McpProtocolError("the server ended mid-call")
        try:
            answer = json.loads(data)
        except ValueError:
            raise McpProtocolError("the server's relay gave a malformed answer") from None
        if not isinstance(answer, dict):
            raise McpProtocolError("the server's relay gave a malformed answer")
        return answer
    finally:
        connection.close()


def _step(start_by: float) -> float:
    """How long one step of a start may wait for a relay: 10 s at most, and never past the
    start's bound (``McpStartFailed`` once it has passed)."""
    left = min(10.0, start_by - time.monotonic())
    if left <= 0:
        raise McpStartFailed(
            "the server did not start within the call's bound for starting (waiting for "
            "the relays of this host to answer)"
        )
    return left


def _read_line(stream: Any, timeout: float) -> bytes | None:
    deadline = time.monotonic() + timeout
    data = b""
    fd = stream.fileno()
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        readable, _, _ = select.select([fd], [], [], left)
        if not readable:
            return None
        chunk = os.read(fd, 65536)
        if not chunk:
            return data or None
        data += chunk
    return data


@contextlib.contextmanager
def _flock(path: Path, timeout: float) -> Any:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise McpStartFailed("another process is starting this server") from None
                time.sleep(0.02)
        yield
    finally:
        os.close(fd)


def _client() -> Any:
    try:
        return docker.from_env()
    except docker.errors.DockerException as error:
        raise McpUnavailable(f"docker: no engine answers ({error})") from None


def _relay_dirs(root: Path) -> list[Path]:
    try:
        return [d for d in root.iterdir() if d.name.startswith(RELAY_PREFIX) and d.is_dir()]
    except OSError:
        return []


def _spec(directory: Path) -> dict[str, Any] | None:
    try:
        spec = json.loads((directory / "spec.json").read_text())
    except (OSError, ValueError):
        return None
    return spec if isinstance(spec, dict) else None


def _last_used(directory: Path) -> float:
    try:
        return (directory / "spec.json").stat().st_mtime
    except OSError:
        return 0.0


def _relay_pid(directory: Path) -> int | None:
    try:
        return int((directory / "pid").read_text())
    except (OSError, ValueError):
        return None


def _relay_container(directory: Path) -> str:
    """The id of the container the relay of ``directory`` serves ('' for none yet)."""
    try:
        return (directory / "container").read_text().strip()
    except OSError:
        return ""


def _kill_relay(directory: Path, client: Any | None = None) -> None:
    """End a relay that does not answer, its container and its directory.

    Its container is the one its directory names, and any other that names the relay's
    directory and a dead owner: a relay killed while it started (its worker stopped
    waiting) has made its container without writing its id yet."""
    pid = _relay_pid(directory)
    if pid is not None:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 2
        while _start_ticks(pid) is not None and time.monotonic() < deadline:
            time.sleep(0.01)
    own = client is None
    engine = client if client is not None else _client()
    try:
        container_id = _relay_container(directory)
        if container_id:
            remove_container(engine, container_id)
        with contextlib.suppress(*ENGINE_ERRORS):
            for container in engine.containers.list(
                all=True,
                filters={"label": f"{LABEL_PREFIX}mcp-relay={directory}"},
                ignore_removed=True,
            ):
                owner = (container.labels or {}).get(MCP_OWNER_LABEL)
                if owner is None or not _owner_alive(owner):
                    remove_container(engine, container.id)
    finally:
        if own:
            engine.close()
    shutil.rmtree(directory, ignore_errors=True)


def reap_mcp_call(call_id: str) -> int:
    """A dead worker's call in a warm server: end that server (its relay, if still up,
    already ended it when the worker's connection dropped); how many went."""
    try:
        root = agent_root_directory()
    except SandboxUnavailable:
        return 0
    reaped = 0
    for directory in _relay_dirs(root):
        try:
            serving = (directory / "call").read_text()
        except OSError:
            continue
        if serving == call_id:
            _kill_relay(directory)
            reaped += 1
    return reaped


def refuse_ended_risk(profile: Mapping[str, Any], risk_ended: Callable[[str], bool] | None) -> None:
    """``McpStartFailed`` for a bridged profile whose risk acceptance ended: the command was
    signed before the end (queued, or in flight when the ``mcp.risk.end`` came), and nothing
    may get the network under it since. Without an answer (the call state unreachable), it
    counts as ended."""
    acceptance = profile.get("risk_acceptance")
    if profile.get("network") != "bridge" or not acceptance or risk_ended is None:
        return
    try:
        ended = bool(risk_ended(str(acceptance)))
    except Exception:
        ended = True
    if ended:
        raise McpStartFailed(
            f"the risk acceptance {acceptance} that let this server have a network has ended "
            "(withdrawn, expired or void): it is not started with one; request the call again"
        )


def owner_labels() -> dict[str, str]:
    """The label (unprefixed, as ``server_session`` takes labels) that names this process
    as the owner of the MCP server container it is about to create."""
    return {MCP_OWNER_LABEL.removeprefix(LABEL_PREFIX): _process_identity(os.getpid())}


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _start_ticks(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks after boot); None if there is no such
    process, or only its zombie (SIGKILLed, not yet reaped by its parent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or parentheses.
    fields = stat.rpartition(")")[2].split()
    if len(fields) < 20 or fields[0] in ("Z", "X", "x"):
        return None
    return fields[19]


def _process_identity(pid: int) -> str:
    return f"{_boot_id()}/{pid}/{_start_ticks(pid) or ''}"


def _owner_alive(identity: str) -> bool:
    """Whether the process an MCP container's owner label names still runs."""
    boot, _, rest = identity.partition("/")
    pid_text, _, started = rest.partition("/")
    try:
        pid = int(pid_text)
    except ValueError:
        return False
    if pid <= 0 or boot != _boot_id():
        return False
    if not started:
        # No /proc where the label was written: only whether the pid exists is known.
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return _start_ticks(pid) == started


def _mcp_containers(client: Any, runner_id: str) -> list[Any]:
    containers: list[Any] = client.containers.list(
        all=True,
        filters={"label": [MCP_LABEL, f"{LABEL_PREFIX}runner={runner_id}"]},
        ignore_removed=True,
    )
    return containers


def remove_orphaned_mcp_servers(runner_id: str, client: Any) -> int:
    """MCP server containers of this runner whose owning process is gone (a worker killed
    during a discovery or a throwaway call, a relay killed): removed; how many.

    Safe at any time, from any process of the runner: a container whose owner runs is kept,
    and one without an owner label is left to ``remove_stale_mcp_servers``. Called before
    the runner starts another server, so a discovery a killed worker left (redelivered, as
    ``reject_on_worker_lost`` has it) is gone when the discovery runs again.
    """
    removed = 0
    try:
        for container in _mcp_containers(client, runner_id):
            owner = (container.labels or {}).get(MCP_OWNER_LABEL)
            if owner is not None and not _owner_alive(owner):
                remove_container(client, container.id)
                removed += 1
    except ENGINE_ERRORS:
        pass
    return removed


def remove_stale_mcp_servers(runner_id: str) -> int:
    """Runner start: relays that died (their directories), and every MCP server container
    of this runner that is neither a live relay's nor a live process's (a throwaway call or
    a discovery still running); how many containers went.

    A container names its owner (``MCP_OWNER_LABEL``); one from before that label is kept
    only if it is a live relay's (its ``mcp-relay`` label names a relay whose pid runs).
    """
    try:
        root = agent_root_directory()
    except SandboxUnavailable:
        return 0
    live = set()
    for directory in _relay_dirs(root):
        pid = _relay_pid(directory)
        alive = False
        if pid is not None:
            try:
                os.kill(pid, 0)
                alive = True
            except OSError:
                alive = False
        if alive:
            live.add(str(directory))
        elif time.time() - _last_used(directory) > 60:
            _kill_relay(directory)
    try:
        client = docker.from_env()
    except docker.errors.DockerException:
        return 0
    removed = 0
    try:
        for container in _mcp_containers(client, runner_id):
            labels = container.labels or {}
            owner = labels.get(MCP_OWNER_LABEL)
            if owner is not None:
                keep = _owner_alive(owner)
            else:
                keep = labels.get(f"{LABEL_PREFIX}mcp-relay") in live
            if not keep:
                remove_container(client, container.id)
                removed += 1
    except ENGINE_ERRORS:
        pass
    finally:
        client.close()
    return removed
