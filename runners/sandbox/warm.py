"""Warm Docker sandboxes: one long-lived container per thread, its commands run by an agent.

``WarmDockerBackend`` keeps a thread's container up between calls and runs each command
through the container's PID 1 agent (``runners.sandbox.agent``) with the same confinement
and limits as a fresh container, probed (RUN-5) through the agent right before each
command. The host-side state shared by worker processes is in
``runners.sandbox.warm_host``; the design and its guarantees are in docs/runners.md
("Warm sandboxes").
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import logging
import os
import secrets
import shutil
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker.errors
import docker.types

from runners.sandbox import agent
from runners.sandbox.base import (
    SANDBOX_ADAPTER_DIR,
    SANDBOX_PATH,
    SANDBOX_TMP,
    SANDBOX_WORKSPACE,
    ExecLimits,
    ExecResult,
    ExecSpec,
    OutputBuffer,
    ProbeSite,
    SandboxBackend,
    SandboxError,
    SandboxStartFailed,
    SandboxUnavailable,
)
from runners.sandbox.docker import _KILL_GRACE_S, LABEL_PREFIX, DockerBackend
from runners.sandbox.warm_host import (
    AGENT_DIR_LABEL,
    ENGINE_ERRORS,
    WARM_LABEL,
    agent_dir_of,
    agent_root_directory,
    container_lock,
    lock_container,
    make_agent_dir,
    remove_container,
    remove_least_recently_used,
    write_atomically,
)

__all__ = ["DEFAULT_IDLE_SECONDS", "DEFAULT_MAX_CONTAINERS", "WarmDockerBackend", "WarmSandbox"]

DEFAULT_IDLE_SECONDS = 300.0
DEFAULT_MAX_CONTAINERS = 16

# Inside the container: where the agent's socket directory is mounted, and PID 1's argv.
AGENT_MOUNT = "/run/kestrel-agent"
AGENT_SOCKET = f"{AGENT_MOUNT}/agent.sock"


@functools.cache
def agent_argv() -> tuple[str, ...]:
    """PID 1's argv: the agent's source, read once, when the first warm container starts."""
    return ("python3", "-I", "-S", "-c", Path(agent.__file__).read_text(), AGENT_SOCKET)


# How long a new container's agent may take to come up (Python's start, a loaded host).
AGENT_START_SECONDS = 20.0

# Container-level limits: a warm container serves a call only if these are equal.
_CONTAINER_LIMITS = ("memory_mb", "cpus", "pids", "tmp_mb")
_HEADER = struct.Struct(">I")
_UCRED = struct.Struct("3i")
_PROBE_REPORT_BOUND = 16 * 1024  # a probe's answer, when it has no command's

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
    """A ``DockerBackend`` that keeps one container per thread warm (docs/runners.md).

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

    @property
    def adapter_root(self) -> Path:
        """Where this backend's calls' adapter broker sockets go: beside the containers'
        directories, on their filesystem, so each can be hard linked into its container
        (``_link_adapter``; runners.adapter_broker)."""
        assert self.agent_root is not None
        return self.agent_root / "adapter-calls"

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
            except _ProbeFailed as error:
                # A container that passed its probe before fails it now (its workspace was
                # replaced under it, its mounts were changed from the host...). It is gone,
                # its command never started; once more in a new container, probed afresh.
                # A second failure is the call's: SandboxUnavailable.
                log.warning("a warm container failed its probe and was removed: %s", error)
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
        except ENGINE_ERRORS as error:
            raise SandboxStartFailed(f"docker: cannot list warm containers: {error}") from None
        excess = len(running) - self.max_containers + 1
        while excess > 0:
            with self._lock:
                busy = {s.container_id for s in self._sandboxes.values() if s.busy}
            removed = remove_least_recently_used(self.client, running, keep=busy)
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

    def end_project(self, project: str) -> int:
        """Remove the project's containers of this process now (it was deleted); how many.

        A container busy with a call is left to finish it and removed at check-in.
        """
        with self._lock:
            keys = [key for key in self._sandboxes if key[0] == project]
            gone = [self._sandboxes.pop(key) for key in keys]
        for sandbox in gone:
            if not sandbox.busy:
                self._remove(sandbox)
        return len(gone)

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
            argv=agent_argv(), workspace=spec.workspace, limits=spec.limits, labels=labels
        )
        sandbox = WarmSandbox(
            container_id="",
            project=project,
            thread=thread,
            workspace=str(spec.workspace.resolve()),
            limits_key=_limits_key(spec.limits),
            last_used=self.clock(),
            agent_dir=make_agent_dir(self.agent_root),
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
        # Where a call's adapter broker socket appears while the call runs (see _call).
        options["mounts"].append(
            docker.types.Mount(
                target=SANDBOX_ADAPTER_DIR,
                source=str(sandbox.agent_dir / "adapter"),
                type="bind",
                read_only=True,
            )
        )
        try:
            container = self.client.containers.create(self.docker.image_id, **options)
        except ENGINE_ERRORS as error:
            shutil.rmtree(sandbox.agent_dir, ignore_errors=True)
            raise SandboxStartFailed(f"docker: cannot create the container: {error}") from None
        sandbox.container_id = container.id
        try:
            try:
                container.start()
            except ENGINE_ERRORS as error:
                if self._ended(key):
                    raise _ThreadEnded from None  # removed by a thread end before it started
                raise SandboxStartFailed(f"docker: cannot start the container: {error}") from None
            sandbox.agent_pid = self._await_agent(sandbox)
            # Probed before it is published, as before every command (see _exchange), and
            # with the world-writable directory beside the workspace, as a fresh container
            # is; under its lock like a call: another process making room leaves it alone.
            sandbox.lock_fd = lock_container(sandbox.agent_dir)
            try:
                if sandbox.lock_fd is None:
                    raise _Gone  # another process is removing it
                self._exchange(
                    sandbox,
                    spec.workspace,
                    {"key": sandbox.key},
                    _PROBE_REPORT_BOUND,
                    _KILL_GRACE_S,
                    open_sibling=True,
                )
            finally:
                if sandbox.lock_fd is not None and sandbox.lock_fd >= 0:
                    os.close(sandbox.lock_fd)
                sandbox.lock_fd = None
            write_atomically(sandbox.agent_dir / "sandbox.json", json.dumps(sandbox.shared()))
        except _ProbeFailed as error:
            remove_container(self.client, sandbox.container_id, sandbox.agent_dir)
            raise SandboxUnavailable(str(error)) from None  # a new container: not retried
        except BaseException:
            # Never published, so nobody else uses it: removed whoever holds its lock.
            remove_container(self.client, sandbox.container_id, sandbox.agent_dir)
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
        except ENGINE_ERRORS:
            return None  # a new container will do
        for container in listed:
            agent_dir = agent_dir_of(container)
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
        except ENGINE_ERRORS as error:
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
        sandbox.lock_fd = lock_container(sandbox.agent_dir)
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
            adapter_link = self._link_adapter(sandbox, spec)
            call_file = sandbox.agent_dir / "call"
            with contextlib.suppress(OSError):
                call_file.write_text(call)
            try:
                answer = self._ask(sandbox, spec, call)
            finally:
                with contextlib.suppress(OSError):
                    call_file.write_text("")
                if adapter_link is not None:
                    with contextlib.suppress(OSError):
                        os.unlink(adapter_link)
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
    def _link_adapter(sandbox: WarmSandbox, spec: ExecSpec) -> Path | None:
        """Put the call's adapter broker socket where the container sees it, for this call.

        The container's mounts were fixed when it started, so the per-call socket is hard
        linked into the container's adapter directory (mounted read-only at
        /run/kestrel-adapter) and unlinked when the call ends: a connection to it reaches
        this call's broker only. Where that cannot be done (another filesystem, a container
        started without the directory) the call runs in a fresh container (``_Busy``).
        """
        if spec.adapter_dir is None:
            return None
        link = sandbox.agent_dir / "adapter" / "adapter.sock"
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(link)  # a dead worker's; its broker is gone
            os.link(Path(spec.adapter_dir) / "adapter.sock", link)
        except OSError as error:
            log.info("adapter socket not linked into a warm container (%s)", error.strerror)
            raise _Busy from None
        return link

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
        return self._exchange(sandbox, spec.workspace, request, bound, self._deadline(spec))

    def _exchange(
        self,
        sandbox: WarmSandbox,
        workspace: Path,
        request: dict[str, Any],
        bound: int,
        deadline: float,
        *,
        open_sibling: bool = False,
    ) -> dict[str, Any] | None:
        """Send ``request`` with its probe (RUN-5) and read the agent's one answer; None if
        it never came. A container that fails the probe is removed and ``_ProbeFailed``
        raised; nothing ran in it.

        The runner plants a random token in the workspace as the host sees it now and sends
        the host's identity of the workspace's parent; before the command, the agent (with
        the commands' own uid, mounts and namespaces) must find the token in /workspace and
        remove it, must fail to write beside the workspace, must see a read-only root and a
        parent that is not the host's directory of workspaces (``runners.sandbox.agent``).
        That costs no exchange and no process: cheap enough for every command.
        ``open_sibling`` adds the world-writable directory beside the workspace that the
        host then finds empty (the start's probe, as a fresh container's).
        """
        with ProbeSite(workspace, open_sibling=open_sibling) as site:
            try:
                site.plant()
                parent = os.stat(site.workspace.parent)
            except OSError as error:
                raise SandboxUnavailable(
                    f"{self.name}: cannot probe the workspace: {error.strerror}"
                ) from None
            request = dict(
                request,
                probe={
                    "token": site.token,
                    "marker": site.marker,
                    "workspace": SANDBOX_WORKSPACE,
                    "parent": [parent.st_dev, parent.st_ino],
                },
            )
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
                connection.settimeout(_KILL_GRACE_S)
                self._send_request(sandbox, connection, request)
                connection.settimeout(deadline)
                try:
                    answer = _read_message(connection, bound)
                except TimeoutError:
                    self._discard(sandbox)
                    return None
                except (OSError, ValueError) as error:
                    # The agent died mid-call (its container was killed, or ran out of memory).
                    self._discard(sandbox)
                    raise SandboxError(
                        f"docker: lost the warm container mid-call: {error}"
                    ) from None
            if not isinstance(answer, dict):
                self._discard(sandbox)
                raise SandboxError("docker: the warm container's agent gave a malformed answer")
            if "probe_failed" in answer or "probe_passed" in answer:
                failed = answer.get("probe_failed")
                failed = failed if isinstance(failed, dict) else {}
                probe = site.planted_result(self.name, failed)
                if "probe_failed" in answer or not probe.ok:
                    self._discard(sandbox)
                    detail = probe.detail
                    if failed.get("left"):
                        detail += f"; an earlier call left {', '.join(map(str, failed['left']))}"
                    raise _ProbeFailed(f"{self.name} sandbox failed its probe: {detail[:400]}")
        return answer

    def _send_request(
        self, sandbox: WarmSandbox, connection: socket.socket, request: dict[str, Any]
    ) -> None:
        try:
            connection.connect(str(sandbox.agent_dir / "socket" / "agent.sock"))
            peer = _UCRED.unpack(
                connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
            )[0]
            if peer != sandbox.agent_pid:
                raise ConnectionRefusedError(f"answered by pid {peer}, not the container's")
            _send_message(connection, request)
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
            remove_container(self.client, sandbox.container_id, sandbox.agent_dir)
            return
        with container_lock(sandbox.agent_dir) as idle:
            if idle:
                remove_container(self.client, sandbox.container_id, sandbox.agent_dir)


class _Busy(Exception):
    """Another worker process is using (or removing) the container; nothing ran in it."""


class _Gone(SandboxStartFailed):
    """The container was removed by another worker process while idle; nothing ran in it."""

    def __init__(self) -> None:
        super().__init__("docker: the warm container was removed by another worker process")


class _ProbeFailed(SandboxUnavailable):
    """The container failed its probe before a command; it was removed, nothing ran."""


class _ThreadEnded(Exception):
    """The thread ended before this call's command started in its warm container."""


def _thread_key(spec: ExecSpec) -> tuple[str, str] | None:
    project, thread = spec.labels.get("project"), spec.labels.get("thread")
    if not project or not thread:
        return None
    return project, thread


def _safe(value: str) -> str:
    return "".join(c for c in value if c.isalnum() or c in "_-")[:64] or "call"


def _send_message(connection: socket.socket, message: dict[str, Any]) -> None:
    body = json.dumps(message).encode()
    connection.sendall(_HEADER.pack(len(body)) + body)


def _read_message(connection: socket.socket, bound: int) -> Any:
    size = _HEADER.unpack(_read_exactly(connection, _HEADER.size))[0]
    if size > bound:
        raise ValueError(f"an answer of {size} bytes")
    return json.loads(_read_exactly(connection, size))


def _read_exactly(connection: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = connection.recv(min(size - len(data), 1 << 20))
        if not chunk:
            raise ConnectionResetError("the agent closed the connection")
        data += chunk
    return data
