"""Warm Docker sandboxes: one long-lived container per thread, its commands run by an agent.

Agents make many small calls in a row, and starting a container costs more than the command.
So the first process-tool call of a thread starts a container that stays up, and the thread's
later calls run in it. PID 1 of that container is a small agent (``runners.sandbox.agent``)
that runs each command on the runner's request, over a Unix socket in a per-container bind
mount. ``docker exec`` did this before; it cost the engine about 60 ms of CPU per call, more
than all the rest of a warm call (docs/performance.md). What makes a warm call as safe as a
fresh container:

- **Same confinement.** The container is created with ``DockerBackend.container_options``
  (no network, read-only root, all capabilities dropped, no-new-privileges, non-root user,
  pids/memory/CPU limits, private IPC, bounded ``noexec`` tmpfs at /tmp, only the workspace
  mounted), so ``docker inspect`` shows the same hardening. The one addition is the agent's
  socket directory at ``/run/kestrel-agent``; once the socket is up, a runner running as
  root hands that directory to root (mode 0700), so commands cannot even look into it.
  Limits belong to a container, so the container takes the command's limits and a call
  asking for different limits gets a new container (the old one is removed). Every command
  is a child of PID 1 and inherits all of it, as an exec did.
- **Only the runner is obeyed.** The agent answers a peer outside the container only (pid 0
  seen from inside) that presents the container's key, a random secret the runner puts in
  PID 1's environment. The agent is non-dumpable, so a command (same uid, no capabilities)
  can neither trace it nor read its environment. The runner, in turn, talks only to the
  container's own PID 1: it checks the socket's peer pid against the engine's ``State.Pid``,
  so a socket swapped by anything else is never used.
- **One thread, one container.** Containers are keyed by (project, thread) and never handed
  to another thread, nor to two calls at once: a call of a thread whose container is busy
  runs in a fresh container instead. Calls without a thread always run fresh. The container
  is the thread's on the whole runner host: a worker process that has none for the thread
  adopts the one another process started (``_adopt``, from the ``sandbox.json`` the starting
  process writes in the host-side directory once the probe passed), so a thread's calls
  stay warm whichever process they land in. Every use and every removal takes the
  container's lock without waiting; a process never removes a container another is using.
- **Probed when started.** A new container is probed (RUN-5) through the agent before its
  first command; a failed probe removes it and fails the call (``SandboxUnavailable``). Its
  mounts and privileges are fixed at creation and a command inside cannot change them, so a
  container that passed stays as it was probed. A container found dead, or whose agent does
  not answer as itself, is removed and the call fails or gets a new, probed container;
  nothing ever runs outside a sandbox.
- **Per-call TMPDIR.** The agent makes a fresh, empty directory ``/tmp/kestrel-<call>-<random>``
  (mode 0700) in the tmpfs for each command, exports it as TMPDIR, and empties /tmp and
  /dev/shm after it. A command gets exactly the environment of its call: neither the
  agent's nor an earlier call's.
- **Nothing outlives its call.** When the command exits, the agent SIGKILLs every other
  process in the container (``kill(-1)`` from PID 1) and reaps them, so background children
  die with the call as they would with a fresh container. The same happens when the runner's
  connection drops (a worker that dies mid-call leaves nothing running). On timeout the
  agent kills the tree, and the runner removes the whole container and drops it from the
  pool (``timed_out``, exit 137); if the agent itself stops answering, the runner's own
  deadline removes the container.
- **Bounded.** Idle containers are removed after ``idle_seconds``; at most ``max_containers``
  warm containers exist on the engine for this runner (counted on the engine, so every worker
  process of the host shares the cap); past it the least recently used idle one goes,
  whichever process started it, or, if none can, the call runs in a fresh container. At
  runner start
  ``remove_idle_warm_containers`` clears what a previous runner process left.
- **Busy is a lock on the host.** Each container has a host-side directory (its
  ``agent-dir`` label) holding the socket directory, a ``lock`` file and a ``call`` file. A
  process holds an exclusive ``flock`` on ``lock`` for as long as it uses the container and
  writes the call id in ``call``; the kernel drops the lock if the process dies. Other
  processes remove a container only while holding its lock themselves.
- **Ended threads.** ``end_thread`` drops a thread's container from this process (removed now
  if idle, at check-in if busy). Each worker process keeps its own view of the pool, so a
  runner told that a thread ended also removes the thread's idle containers on the engine
  (``remove_idle_thread_containers``), and the optional ``thread_ended`` predicate (shared
  state) tells every process: a call of an ended thread never goes warm, and a busy container
  of an ended thread is removed when its call checks in. A process checks the predicate after
  taking the container's lock and before sending the command; the remover marks the thread
  ended before it looks, and takes the lock to remove. So either the call sees the mark, or
  the remover sees the container busy and leaves it to the call.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import logging
import os
import re
import secrets
import shutil
import socket
import stat
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker.errors
import docker.types
import requests.exceptions

from runners.sandbox import agent
from runners.sandbox.base import (
    SANDBOX_PATH,
    SANDBOX_TMP,
    ExecLimits,
    ExecResult,
    ExecSpec,
    OutputBuffer,
    SandboxBackend,
    SandboxError,
    SandboxStartFailed,
    SandboxUnavailable,
    probe_with,
)
from runners.sandbox.docker import _KILL_GRACE_S, LABEL_PREFIX, DockerBackend
from runners.workspace import workspace_owner

__all__ = [
    "AGENT_DIR_LABEL",
    "WARM_LABEL",
    "WarmDockerBackend",
    "WarmSandbox",
    "containers_running_call",
    "remove_idle_thread_containers",
    "remove_idle_warm_containers",
    "warm_container_busy",
]

WARM_LABEL = f"{LABEL_PREFIX}warm"
AGENT_DIR_LABEL = f"{LABEL_PREFIX}agent-dir"
DEFAULT_IDLE_SECONDS = 300.0
DEFAULT_MAX_CONTAINERS = 16
# Where each warm container's host-side directory is made (docs/runners.md).
AGENT_ROOT_VARIABLE = "KESTREL_WARM_AGENT_DIR"

# Inside the container: where the agent's socket directory is mounted, and PID 1's argv.
AGENT_MOUNT = "/run/kestrel-agent"
AGENT_SOCKET = f"{AGENT_MOUNT}/agent.sock"
AGENT_ARGV = ("python3", "-I", "-S", "-c", Path(agent.__file__).read_text(), AGENT_SOCKET)
# How long a new container's agent may take to come up (Python's start, a loaded host).
AGENT_START_SECONDS = 20.0

# Container-level limits: a warm container serves a call only if these are equal.
_CONTAINER_LIMITS = ("memory_mb", "cpus", "pids", "tmp_mb")
_ENGINE_ERRORS = (docker.errors.DockerException, requests.exceptions.RequestException)
_HEADER = struct.Struct(">I")
_AGENT_DIR_NAME = re.compile(r"warm-[0-9a-f]{24}")
# Host-side directories younger than this may belong to a container being created.
_ORPHAN_AGE_SECONDS = 600
_UCRED = struct.Struct("3i")

log = logging.getLogger("kestrel.runner")


def _limits_key(limits: ExecLimits) -> tuple[Any, ...]:
    return tuple(getattr(limits, name) for name in _CONTAINER_LIMITS)


@dataclass
class WarmSandbox:
    """One warm container of one (project, thread), as this process knows it."""

    container_id: str
    project: str
    thread: str
    workspace: str
    limits_key: tuple[Any, ...]
    last_used: float
    agent_dir: Path
    key: str
    agent_pid: int = 0  # PID 1 of the container, as the host sees it
    busy: bool = False
    calls: int = 0
    # The container's lock, while this process uses the container (see _call).
    lock_fd: int | None = None

    def fits(self, spec: ExecSpec) -> bool:
        return (
            str(spec.workspace.resolve()) == self.workspace
            and _limits_key(spec.limits) == self.limits_key
        )

    def shared(self) -> dict[str, Any]:
        """What another worker process needs to use this container (``_adopt``)."""
        return {
            "container_id": self.container_id,
            "workspace": self.workspace,
            "limits_key": list(self.limits_key),
            "agent_pid": self.agent_pid,
            "key": self.key,
        }


@dataclass
class WarmDockerBackend(SandboxBackend):
    """A ``DockerBackend`` that keeps one container per thread warm; see the module docstring.

    ``run`` (used by the probe of fresh containers and by callers that want a throwaway
    container) is the plain backend's. ``run_probed``, what ``run_confined`` calls, is where a
    call with ``project`` and ``thread`` labels goes warm.
    """

    docker: DockerBackend
    idle_seconds: float = DEFAULT_IDLE_SECONDS
    max_containers: int = DEFAULT_MAX_CONTAINERS
    clock: Callable[[], float] = time.monotonic
    # (project, thread) -> whether that thread ended; None: threads never end here. Asked
    # when a call of a thread starts and when it checks its container back in.
    thread_ended: Callable[[str, str], bool] | None = None
    # Where each container's host-side directory goes; see ``agent_root_directory``.
    agent_root: Path | None = None
    name: str = "docker"
    _sandboxes: dict[tuple[str, str], WarmSandbox] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.idle_seconds <= 0 or self.max_containers < 0:
            raise ValueError("idle_seconds must be positive and max_containers not negative")
        if self.agent_root is None:
            self.agent_root = agent_root_directory()

    @property
    def client(self) -> Any:
        return self.docker.client

    # --- the SandboxBackend interface ------------------------------------------------

    def run(self, spec: ExecSpec) -> ExecResult:
        return self.docker.run(spec)

    def run_probed(self, spec: ExecSpec) -> ExecResult:
        key = _thread_key(spec)
        if key is None or self.max_containers == 0:
            return super().run_probed(spec)
        self.remove_idle()
        try:
            try:
                return self._run_warm(key, spec)
            except _Gone:
                # Another worker process removed the idle container to make room for its
                # own; the command never started there. Once more, in a new one.
                return self._run_warm(key, spec)
        except _ThreadEnded:
            # A call of the thread that was queued before it ended: it runs (the control
            # plane decided it), but in a fresh container, since nothing of the thread may
            # stay warm. Its command never started in the warm one (see _call).
            self.end_thread(*key)
            return super().run_probed(spec)

    def _run_warm(self, key: tuple[str, str], spec: ExecSpec) -> ExecResult:
        sandbox = self._checkout(key, spec)
        if sandbox is None:
            return super().run_probed(spec)
        keep = False
        try:
            result = self._call(sandbox, spec)
            # A timed-out or OOM-killed call leaves a container in an unknown state.
            keep = not (result.timed_out or result.oom_killed)
            return result
        except _Busy:
            keep = True  # another process's call of this thread; this one runs fresh
            return super().run_probed(spec)
        finally:
            # The thread may have ended while this call ran (another process got the
            # notice): its container goes now instead of idling.
            if keep and self._ended(key):
                keep = False
            self._checkin(key, sandbox, keep=keep)

    def _ended(self, key: tuple[str, str]) -> bool:
        """Whether the thread ended; when that cannot be told, treated as ended (the call
        then runs in a fresh container, which costs time and nothing else)."""
        if self.thread_ended is None:
            return False
        try:
            return bool(self.thread_ended(*key))
        except Exception as error:
            log.warning("cannot tell whether thread %s ended: %s", key[1], type(error).__name__)
            return True

    # --- pool -------------------------------------------------------------------------

    def _checkout(self, key: tuple[str, str], spec: ExecSpec) -> WarmSandbox | None:
        """This thread's idle container for ``spec``, started and probed if needed.

        None means "run this call in a fresh container": the thread's container is busy
        with another call, or the host is at its cap and nothing of ours can make room.
        """
        stale: WarmSandbox | None = None
        with self._lock:
            current = self._sandboxes.get(key)
        if current is None:
            # Another worker process of this host may keep one: a thread has one container
            # per runner host, whichever process its calls land in.
            adopted = self._adopt(key, spec)
            with self._lock:
                current = self._sandboxes.setdefault(key, adopted) if adopted else None
        with self._lock:
            if current is not None and self._sandboxes.get(key) is current:
                if current.busy:
                    return None
                if current.fits(spec):
                    current.busy = True
                    return current
                stale = self._sandboxes.pop(key)
        if stale is not None:
            self._remove(stale)
        if not self._make_room(spec.labels.get("runner")):
            return None
        sandbox = self._start(key, spec)
        with self._lock:
            if key in self._sandboxes:
                # Another call of this thread started one meanwhile; this one serves only
                # the current call and is removed after it.
                sandbox.busy = True
                sandbox.calls = -1
                return sandbox
            sandbox.busy = True
            self._sandboxes[key] = sandbox
        return sandbox

    def _checkin(self, key: tuple[str, str], sandbox: WarmSandbox, *, keep: bool) -> None:
        with self._lock:
            sandbox.busy = False
            sandbox.last_used = self.clock()
            owned = self._sandboxes.get(key) is sandbox
            if owned and not keep:
                del self._sandboxes[key]
        if not keep or not owned:
            self._remove(sandbox)

    def _make_room(self, runner: str | None) -> bool:
        """Keep the runner under ``max_containers`` warm containers; False if it can't.

        Counted on the engine (by the runner's label when the call has one), so all worker
        processes of a runner host share the cap. The least recently used idle container
        goes, whichever process keeps it (its lock is taken to remove it): containers of
        threads that moved on go before live ones.
        """
        labels = [f"{WARM_LABEL}=true"]
        if runner:
            labels.append(f"{LABEL_PREFIX}runner={runner}")
        try:
            running = self.client.containers.list(
                all=True, filters={"label": labels}, sparse=True, ignore_removed=True
            )
        except _ENGINE_ERRORS as error:
            raise SandboxStartFailed(f"docker: cannot list warm containers: {error}") from None
        excess = len(running) - self.max_containers + 1
        while excess > 0:
            with self._lock:
                busy = {s.container_id for s in self._sandboxes.values() if s.busy}
            removed = _remove_least_recently_used(self.client, running, keep=busy)
            if removed is None:
                return False
            running = [container for container in running if container.id != removed]
            with self._lock:
                for key, sandbox in list(self._sandboxes.items()):
                    if sandbox.container_id == removed:
                        del self._sandboxes[key]
            excess -= 1
        return True

    def remove_idle(self) -> int:
        """Remove this process's containers idle for ``idle_seconds`` or more; how many."""
        deadline = self.clock() - self.idle_seconds
        with self._lock:
            expired = [
                key
                for key, sandbox in self._sandboxes.items()
                if not sandbox.busy and sandbox.last_used <= deadline
            ]
            gone = [self._sandboxes.pop(key) for key in expired]
        for sandbox in gone:
            self._remove(sandbox)
        return len(gone)

    def end_thread(self, project: str, thread: str) -> bool:
        """Remove the thread's container now (the thread ended); True if there was one.

        A container busy with a call is left to finish it and removed at check-in.
        """
        with self._lock:
            sandbox = self._sandboxes.pop((project, thread), None)
        if sandbox is None:
            return False
        if not sandbox.busy:
            self._remove(sandbox)
        return True

    def close(self) -> None:
        """Remove every idle container of this process (the worker is shutting down)."""
        with self._lock:
            idle = [key for key, sandbox in self._sandboxes.items() if not sandbox.busy]
            gone = [self._sandboxes.pop(key) for key in idle]
        for sandbox in gone:
            self._remove(sandbox)

    def warm_containers(self) -> dict[tuple[str, str], str]:
        """(project, thread) -> container id, for tests and operators."""
        with self._lock:
            return {key: sandbox.container_id for key, sandbox in self._sandboxes.items()}

    # --- containers -------------------------------------------------------------------

    def _start(self, key: tuple[str, str], spec: ExecSpec) -> WarmSandbox:
        """Create and start a container whose PID 1 is the agent, then probe it."""
        project, thread = key
        labels = {"project": project, "thread": thread}
        if "runner" in spec.labels:
            labels["runner"] = spec.labels["runner"]
        keeper = ExecSpec(
            argv=AGENT_ARGV, workspace=spec.workspace, limits=spec.limits, labels=labels
        )
        sandbox = WarmSandbox(
            container_id="",
            project=project,
            thread=thread,
            workspace=str(spec.workspace.resolve()),
            limits_key=_limits_key(spec.limits),
            last_used=self.clock(),
            agent_dir=_make_agent_dir(self.agent_root),
            key=secrets.token_urlsafe(32),
        )
        options = self.docker.container_options(keeper)
        options["labels"][WARM_LABEL] = "true"
        options["labels"][AGENT_DIR_LABEL] = str(sandbox.agent_dir)
        options["init"] = False  # the agent is PID 1: it reaps, and it kills after each call
        options["working_dir"] = "/"
        # No call's environment: the agent gives each command exactly its own.
        options["environment"] = {
            "PATH": SANDBOX_PATH,
            "LANG": "C.UTF-8",
            agent.KEY_VARIABLE: sandbox.key,
        }
        options["mounts"].append(
            docker.types.Mount(
                target=AGENT_MOUNT, source=str(sandbox.agent_dir / "socket"), type="bind"
            )
        )
        try:
            container = self.client.containers.create(self.docker.image_id, **options)
        except _ENGINE_ERRORS as error:
            shutil.rmtree(sandbox.agent_dir, ignore_errors=True)
            raise SandboxStartFailed(f"docker: cannot create the container: {error}") from None
        sandbox.container_id = container.id
        try:
            try:
                container.start()
            except _ENGINE_ERRORS as error:
                if self._ended(key):
                    raise _ThreadEnded from None  # removed by a thread end before it started
                raise SandboxStartFailed(f"docker: cannot start the container: {error}") from None
            sandbox.agent_pid = self._await_agent(sandbox)
            probe = probe_with(
                self.name, lambda probe_spec: self._call(sandbox, probe_spec), spec.workspace
            )
            if not probe.ok:
                raise SandboxUnavailable(f"{self.name} sandbox failed its probe: {probe.detail}")
            _write_atomically(sandbox.agent_dir / "sandbox.json", json.dumps(sandbox.shared()))
        except BaseException:
            # Never published, so nobody else uses it: removed whoever holds its lock.
            _remove_container(self.client, sandbox.container_id, sandbox.agent_dir)
            raise
        return sandbox

    def _adopt(self, key: tuple[str, str], spec: ExecSpec) -> WarmSandbox | None:
        """The thread's probed container another process of this runner keeps, if one fits."""
        labels = [
            f"{WARM_LABEL}=true",
            f"{LABEL_PREFIX}project={key[0]}",
            f"{LABEL_PREFIX}thread={key[1]}",
        ]
        if "runner" in spec.labels:
            labels.append(f"{LABEL_PREFIX}runner={spec.labels['runner']}")
        try:
            listed = self.client.containers.list(
                filters={"label": labels, "status": "running"}, sparse=True, ignore_removed=True
            )
        except _ENGINE_ERRORS:
            return None  # a new container will do
        for container in listed:
            agent_dir = _agent_dir_of(container)
            try:
                shared = json.loads((agent_dir / "sandbox.json").read_text()) if agent_dir else None
                if shared is None or shared["container_id"] != container.id:
                    continue
                sandbox = WarmSandbox(
                    container_id=container.id,
                    project=key[0],
                    thread=key[1],
                    workspace=str(shared["workspace"]),
                    limits_key=tuple(shared["limits_key"]),
                    last_used=self.clock(),
                    agent_dir=agent_dir,
                    key=str(shared["key"]),
                    agent_pid=int(shared["agent_pid"]),
                )
            except (OSError, ValueError, KeyError, TypeError):
                continue  # not probed yet, or being removed
            if sandbox.fits(spec):
                return sandbox
        return None

    def _await_agent(self, sandbox: WarmSandbox) -> int:
        """The host pid of the container's PID 1, once the agent's socket is up."""
        socket_dir = sandbox.agent_dir / "socket"
        deadline = time.monotonic() + AGENT_START_SECONDS
        next_look = time.monotonic() + 0.5
        while not (socket_dir / "agent.sock").exists():
            now = time.monotonic()
            if now > deadline:
                raise SandboxStartFailed("docker: the warm container's agent did not start")
            if now > next_look:  # a container that already died will not bring it up
                next_look = now + 0.5
                if not self._state(sandbox).get("Running"):
                    raise SandboxStartFailed(
                        "docker: the warm container's agent exited at start (the tool image "
                        "needs python3)"
                    )
            time.sleep(0.002)
        state = self._state(sandbox)
        if not state.get("Running") or not state.get("Pid"):
            raise SandboxStartFailed("docker: the warm container stopped as it started")
        if os.geteuid() == 0:
            # The agent holds its listening socket; commands need not even see the directory.
            os.chown(socket_dir, 0, 0)
            os.chmod(socket_dir, 0o700)
        return int(state["Pid"])

    def _state(self, sandbox: WarmSandbox) -> dict[str, Any]:
        try:
            return self.client.api.inspect_container(sandbox.container_id)["State"]
        except _ENGINE_ERRORS as error:
            raise SandboxStartFailed(
                f"docker: cannot inspect the warm container: {error}"
            ) from None

    def _call(self, sandbox: WarmSandbox, spec: ExecSpec) -> ExecResult:
        """Run ``spec`` through the container's agent, holding the container's lock.

        ``_Busy`` when another process holds the lock: it is using the container (or
        removing it), and this call must not wait for that.
        """
        key = (sandbox.project, sandbox.thread)
        call = spec.labels.get("call", "call")
        sandbox.lock_fd = _lock_container(sandbox.agent_dir)
        if sandbox.lock_fd is None:
            raise _Busy
        try:
            # Asked under the lock: a thread end marks the thread ended *before* it looks
            # for idle containers and removes only those whose lock it holds. So either this
            # sees the mark (and the command never starts here), or the remover sees this
            # container busy and leaves it to this call.
            if self._ended(key):
                self._discard(sandbox)
                raise _ThreadEnded
            call_file = sandbox.agent_dir / "call"
            with contextlib.suppress(OSError):
                call_file.write_text(call)
            try:
                answer = self._ask(sandbox, spec, call)
            finally:
                with contextlib.suppress(OSError):
                    call_file.write_text("")
        finally:
            if sandbox.lock_fd >= 0:
                os.close(sandbox.lock_fd)  # and with it the lock
            sandbox.lock_fd = None
        if answer is None:
            # Not even the agent answered in time: the container and its tree go.
            return ExecResult(
                exit_code=137,
                stdout="",
                stderr="",
                truncated=False,
                duration_ms=int(self._deadline(spec) * 1000),
                timed_out=True,
                oom_killed=False,
                sandbox=self.name,
            )
        if "error" in answer:
            self._discard(sandbox)
            raise SandboxStartFailed(
                f"docker: the warm container could not start the command: {answer['error']}"
            )
        limit = spec.limits.output_kb * 1024
        stdout, stderr = OutputBuffer(limit), OutputBuffer(limit)
        try:
            stdout.feed(base64.b64decode(answer["stdout"], validate=True))
            stderr.feed(base64.b64decode(answer["stderr"], validate=True))
            exit_code = int(answer["exit_code"])
            timed_out = answer["timed_out"] is True
            oom_killed = exit_code == 137 and int(answer["oom_kills"]) > 0
            duration_ms = int(answer["duration_ms"])
        except (KeyError, TypeError, ValueError):
            self._discard(sandbox)
            raise SandboxError(
                "docker: the warm container's agent gave a malformed answer"
            ) from None
        sandbox.calls += 1
        return ExecResult(
            exit_code=exit_code,
            stdout=stdout.text(),
            stderr=stderr.text(),
            truncated=bool(answer.get("truncated")) or stdout.truncated or stderr.truncated,
            duration_ms=duration_ms,
            timed_out=timed_out,
            oom_killed=oom_killed,
            sandbox=self.name,
        )

    @staticmethod
    def _deadline(spec: ExecSpec) -> float:
        return spec.limits.timeout_s + _KILL_GRACE_S

    def _ask(self, sandbox: WarmSandbox, spec: ExecSpec, call: str) -> dict[str, Any] | None:
        """Send one command to the agent and read its answer; None if it never came."""
        request = {
            "key": sandbox.key,
            "argv": list(spec.argv),
            "env": spec.environment(),
            "cwd": spec.sandbox_cwd,
            "tmpdir": f"{SANDBOX_TMP}/kestrel-{_safe(call)}-{secrets.token_hex(8)}",
            "timeout_s": spec.limits.timeout_s,
            "output_limit": spec.limits.output_kb * 1024,
        }
        # Both streams at their cap, base64-encoded, and the JSON around them.
        bound = 2 * (spec.limits.output_kb * 1024 * 4 // 3 + 4) + 4096
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with connection:
            try:
                connection.settimeout(_KILL_GRACE_S)
                connection.connect(str(sandbox.agent_dir / "socket" / "agent.sock"))
                peer = _UCRED.unpack(
                    connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
                )[0]
                if peer != sandbox.agent_pid:
                    raise ConnectionRefusedError(f"answered by pid {peer}, not the container's")
                body = json.dumps(request).encode()
                connection.sendall(_HEADER.pack(len(body)) + body)
            except OSError as error:
                gone = not sandbox.agent_dir.exists()  # before the discard removes it
                self._discard(sandbox)
                if self._ended((sandbox.project, sandbox.thread)):
                    raise _ThreadEnded from None  # removed by a thread end; nothing ran
                if gone:
                    raise _Gone from None  # removed to make room; nothing ran
                raise SandboxStartFailed(
                    f"docker: cannot reach the warm container's agent: {error}"
                ) from None
            connection.settimeout(self._deadline(spec))
            try:
                size = _HEADER.unpack(_read_exactly(connection, _HEADER.size))[0]
                if size > bound:
                    raise ValueError(f"an answer of {size} bytes")
                return json.loads(_read_exactly(connection, size))
            except TimeoutError:
                self._discard(sandbox)
                return None
            except (OSError, ValueError) as error:
                # The agent died mid-call (its container was killed, or ran out of memory).
                self._discard(sandbox)
                raise SandboxError(f"docker: lost the warm container mid-call: {error}") from None

    def _discard(self, sandbox: WarmSandbox) -> None:
        with self._lock:
            key = (sandbox.project, sandbox.thread)
            if self._sandboxes.get(key) is sandbox:
                del self._sandboxes[key]
        self._remove(sandbox)

    def _remove(self, sandbox: WarmSandbox) -> None:
        """Remove the container, unless another process is using it right now (that process
        decides about it when its call checks in)."""
        if sandbox.lock_fd is not None:  # this process holds the lock: mid-call
            _remove_container(self.client, sandbox.container_id, sandbox.agent_dir)
            return
        with _container_lock(sandbox.agent_dir) as idle:
            if idle:
                _remove_container(self.client, sandbox.container_id, sandbox.agent_dir)


class _Busy(Exception):
    """Another worker process is using (or removing) the container; nothing ran in it."""


class _Gone(SandboxStartFailed):
    """The container was removed by another worker process while idle; nothing ran in it."""

    def __init__(self) -> None:
        super().__init__("docker: the warm container was removed by another worker process")


class _ThreadEnded(Exception):
    """The thread ended before this call's command started in its warm container."""


def _thread_key(spec: ExecSpec) -> tuple[str, str] | None:
    project, thread = spec.labels.get("project"), spec.labels.get("thread")
    if not project or not thread:
        return None
    return project, thread


def _safe(value: str) -> str:
    return "".join(c for c in value if c.isalnum() or c in "_-")[:64] or "call"


def _read_exactly(connection: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = connection.recv(min(size - len(data), 1 << 20))
        if not chunk:
            raise ConnectionResetError("the agent closed the connection")
        data += chunk
    return data


# --- host-side directories and locks --------------------------------------------------


def agent_root_directory() -> Path:
    """Where warm containers' host-side directories go: ``KESTREL_WARM_AGENT_DIR``, else
    ``kestrel-warm-<uid>`` in the system's temporary directory. Made mode 0700; refused if
    it is not a directory of this user's that only this user can enter."""
    configured = os.environ.get(AGENT_ROOT_VARIABLE, "").strip()
    root = Path(configured or Path(tempfile.gettempdir()) / f"kestrel-warm-{os.geteuid()}")
    try:
        root.mkdir(mode=0o700, parents=bool(configured), exist_ok=True)
        info = os.lstat(root)
    except OSError as error:
        raise SandboxUnavailable(f"warm sandboxes: cannot make {root}: {error}") from None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise SandboxUnavailable(
            f"warm sandboxes: {root} must be a directory owned by this user with mode 0700 "
            f"(set {AGENT_ROOT_VARIABLE} to use another)"
        )
    return root


def _make_agent_dir(root: Path) -> Path:
    """A new container's host-side directory: ``lock``, ``call`` and the socket directory
    (handed to the sandbox's user, who runs the agent)."""
    path = root / f"warm-{secrets.token_hex(12)}"
    path.mkdir(mode=0o700)
    for name in ("lock", "call"):
        os.close(os.open(path / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    socket_dir = path / "socket"
    socket_dir.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(socket_dir, *workspace_owner())
    return path


def _agent_dir_of(container: Any) -> Path | None:
    """The host-side directory a warm container's label names, if it is one of ours."""
    attrs = container.attrs  # a listed (sparse) container has its labels at the top
    labels = attrs.get("Labels") or (attrs.get("Config") or {}).get("Labels") or {}
    label = labels.get(AGENT_DIR_LABEL, "")
    path = Path(label)
    if not path.is_absolute() or not _AGENT_DIR_NAME.fullmatch(path.name):
        return None
    return path


def _lock_container(agent_dir: Path) -> int | None:
    """Take a warm container's lock without waiting: the open descriptor that holds it, -1
    if the container has no directory (nothing to hold), or None if another holds it."""
    try:
        fd = os.open(agent_dir / "lock", os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return -1
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".new")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(partial, path)


@contextlib.contextmanager
def _container_lock(agent_dir: Path | None) -> Iterator[bool]:
    """Hold a warm container's lock while the block runs; yields False if another process
    holds it. A container without its directory has no user: its lock counts as held."""
    fd = _lock_container(agent_dir) if agent_dir else -1
    if fd is None:
        yield False
        return
    try:
        yield True
    finally:
        if fd >= 0:
            os.close(fd)  # and with it the lock


def _remove_least_recently_used(
    client: Any, containers: list[Any], *, keep: set[str]
) -> str | None:
    """Remove the least recently used idle container among ``containers`` (by when its last
    call ended), none of ``keep``; its id, or None if every one is busy."""

    def last_used(container: Any) -> float:
        agent_dir = _agent_dir_of(container)
        try:
            return (agent_dir / "call").stat().st_mtime if agent_dir else 0.0
        except OSError:
            return 0.0

    for container in sorted(containers, key=last_used):
        if container.id in keep:
            continue
        agent_dir = _agent_dir_of(container)
        with _container_lock(agent_dir) as idle:
            if idle:
                _remove_container(client, container.id, agent_dir)
                return container.id
    return None


def warm_container_busy(container: Any) -> bool:
    """Whether a worker process is using this warm container for a call right now."""
    with _container_lock(_agent_dir_of(container)) as held:
        return not held


def _remove_container(client: Any, container_id: str, agent_dir: Path | None) -> None:
    if container_id:
        try:
            client.api.remove_container(container_id, force=True)
        except docker.errors.NotFound:
            pass
        except _ENGINE_ERRORS as error:
            log.warning("could not remove warm container %s: %s", container_id[:12], error)
            return  # its directory stays while it may still run; runner start clears both
    if agent_dir is not None:
        shutil.rmtree(agent_dir, ignore_errors=True)


# --- across worker processes ------------------------------------------------------------


def remove_idle_warm_containers(client: Any, *, runner_id: str | None = None) -> int:
    """Remove warm containers not serving a call (a previous runner process left them), and
    host-side directories whose container is gone; how many containers went.

    A container whose lock a live process holds is serving a call and is left alone. A
    worker that died mid-call holds nothing any more, and its agent killed the command when
    the connection dropped, so its container goes too; recovery then finds nothing to reap.
    """
    filters = [f"{WARM_LABEL}=true"]
    if runner_id is not None:
        filters.append(f"{LABEL_PREFIX}runner={runner_id}")
    removed = _remove_idle(client, filters)
    _remove_orphan_directories(client)
    return removed


def remove_idle_thread_containers(
    client: Any, *, project: str, thread: str, runner_id: str | None = None
) -> int:
    """Remove the idle warm containers of one thread, whichever worker process keeps them.

    Found by label (project, thread and, when given, runner), so only that thread's
    containers of that runner are touched. A container whose lock another process holds is
    serving a call and is left alone: the process running it removes it when the call
    checks in (it learns that the thread ended through ``WarmDockerBackend.thread_ended``).
    Call this only after marking the thread ended: a process about to use a container this
    removes then finds the thread ended, under the container's lock, before its command
    starts, and runs the call in a fresh container instead.
    """
    filters = [
        f"{WARM_LABEL}=true",
        f"{LABEL_PREFIX}project={project}",
        f"{LABEL_PREFIX}thread={thread}",
    ]
    if runner_id is not None:
        filters.append(f"{LABEL_PREFIX}runner={runner_id}")
    return _remove_idle(client, filters)


def _remove_idle(client: Any, filters: list[str]) -> int:
    """Remove the containers with all these labels that no process is using; how many."""
    removed = 0
    for container in client.containers.list(
        all=True, filters={"label": filters}, ignore_removed=True
    ):
        agent_dir = _agent_dir_of(container)
        with _container_lock(agent_dir) as idle:
            if container.status == "running" and not idle:
                continue
            _remove_container(client, container.id, agent_dir)
            removed += 1
    return removed


def _remove_orphan_directories(client: Any) -> None:
    """Host-side directories of containers that no longer exist (an engine that lost them,
    a runner killed between the two removals). Young ones may belong to a container being
    created right now by another process, so they stay."""
    try:
        root = agent_root_directory()
    except SandboxUnavailable:
        return
    in_use = {
        str(path)
        for container in client.containers.list(
            all=True, filters={"label": [f"{WARM_LABEL}=true"]}, ignore_removed=True
        )
        if (path := _agent_dir_of(container)) is not None
    }
    young = time.time() - _ORPHAN_AGE_SECONDS
    for entry in root.iterdir():
        if not _AGENT_DIR_NAME.fullmatch(entry.name) or str(entry) in in_use:
            continue
        with contextlib.suppress(OSError):
            if entry.lstat().st_mtime < young:
                shutil.rmtree(entry, ignore_errors=True)


def containers_running_call(client: Any, call_id: str) -> list[Any]:
    """The warm containers serving ``call_id``, or left serving it by a worker that died
    (by the ``call`` file of their host-side directory)."""
    found = []
    for container in client.containers.list(
        filters={"label": [f"{WARM_LABEL}=true"]}, ignore_removed=True
    ):
        agent_dir = _agent_dir_of(container)
        if agent_dir is None:
            continue
        try:
            serving = (agent_dir / "call").read_text()
        except OSError:
            continue
        if serving == call_id:
            found.append(container)
    return found
