"""Warm Docker sandboxes: one long-lived container per thread, commands run in it by ``exec``.

Agents make many small calls in a row, and starting a container costs more than the command.
So the first process-tool call of a thread starts a container that stays up, and the thread's
later calls run in it with ``docker exec``. What makes that as safe as a fresh container:

- **Same confinement.** The container is created with ``DockerBackend.container_options``
  (no network, read-only root, all capabilities dropped, no-new-privileges, non-root user,
  pids/memory/CPU limits, private IPC, bounded ``noexec`` tmpfs at /tmp, only the workspace
  mounted), so ``docker inspect`` shows the same hardening. Limits belong to a container, not
  to an exec, so the container takes the command's limits and a call asking for different
  limits gets a new container (the old one is removed). Exec processes inherit all of it.
- **One thread, one container.** Containers are keyed by (project, thread) and never handed
  to another thread, nor to two calls at once: a call of a thread whose container is busy
  runs in a fresh container instead. Calls without a thread always run fresh.
- **Probed when started.** A new container is probed (RUN-5) through an exec before its
  first command; a failed probe removes it and fails the call (``SandboxUnavailable``). Its
  mounts and privileges are fixed at creation and a command inside cannot change them, so a
  container that passed stays as it was probed. A container found dead is removed and the
  call fails or gets a new, probed container; nothing ever runs outside a sandbox.
- **Per-call TMPDIR.** Each exec runs under a small wrapper that makes a fresh, empty
  directory ``/tmp/kestrel-<call>-<random>`` (mode 0700) in the tmpfs, exports it as
  TMPDIR, runs the command as a child, then removes it and empties /tmp and /dev/shm.
- **Nothing outlives its call.** PID 1 is a tiny ``sh`` loop that only reaps orphans and keeps
  the container up. When the command ends, the wrapper sends SIGKILL to every process it may
  signal (``kill -9 -1``: everything in the container except PID 1, which ignores signals from
  inside its namespace, and the wrapper itself), so background children die with the call as
  they would with a fresh container. On timeout the whole container is killed and dropped
  from the pool: the exec's tree dies with the PID namespace (``timed_out``, exit 137).
- **Bounded.** Idle containers are removed after ``idle_seconds``; at most ``max_containers``
  warm containers exist on the engine for this runner (counted on the engine, so every worker
  process of the host shares the cap); past it the least recently used idle one of this
  process goes, or, if none can, the call runs in a fresh container. At runner start
  ``remove_idle_warm_containers`` clears what a previous runner process left.
- **Ended threads.** ``end_thread`` drops a thread's container from this process (removed now
  if idle, at check-in if busy). Each worker process keeps its own pool, so a runner told that
  a thread ended also removes the thread's idle containers of every process on the engine
  (``remove_idle_thread_containers``), and the optional ``thread_ended`` predicate (shared
  state) tells every process: a call of an ended thread never goes warm, and a busy container
  of an ended thread is removed when its call checks in.

The container's PID 1 is the reaper loop rather than docker-init (``init=False``): docker-init
exits when its one child dies, and the end-of-call ``kill -9 -1`` must not end the container.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import docker.errors
import requests.exceptions

from runners.sandbox.base import (
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
from runners.sandbox.docker import (
    _KILL_GRACE_S,
    LABEL_PREFIX,
    DockerBackend,
    _demultiplex,
    _without_timeout,
)
from runners.workspace import workspace_owner

__all__ = [
    "WARM_LABEL",
    "WarmDockerBackend",
    "WarmSandbox",
    "remove_idle_thread_containers",
    "remove_idle_warm_containers",
]

WARM_LABEL = f"{LABEL_PREFIX}warm"
DEFAULT_IDLE_SECONDS = 300.0
DEFAULT_MAX_CONTAINERS = 16

# PID 1 of a warm container: keeps it up and reaps every orphan (dash's ``wait`` collects any
# child, known job or not). PID 1 ignores signals from inside its PID namespace, so commands
# cannot stop it; the runner removes the container from outside.
KEEPER_ARGV = ("sh", "-c", "while :; do sleep 3600 & wait; done")

# Wraps every exec: "$1" is the per-call TMPDIR, the rest the command's argv. The command
# runs as a child so the wrapper can clean up after it; its exit status is passed through.
EXEC_WRAPPER = """
d="$1"; shift
mkdir -m 700 -- "$d" || { echo "kestrel: cannot make TMPDIR" >&2; exit 125; }
TMPDIR="$d" "$@"
rc=$?
kill -9 -1 2>/dev/null
rm -rf /tmp/* /tmp/.[!.]* /tmp/..?* /dev/shm/* 2>/dev/null
exit $rc
"""

# Container-level limits: a warm container serves a call only if these are equal.
_CONTAINER_LIMITS = ("memory_mb", "cpus", "pids", "tmp_mb")
# Exit status of the wrapper when it could not even make the call's TMPDIR.
_WRAPPER_FAILED = 125
_WRAPPER_MESSAGE = "kestrel: cannot make TMPDIR"
_ENGINE_ERRORS = (docker.errors.DockerException, requests.exceptions.RequestException)

log = logging.getLogger("kestrel.runner")


def _limits_key(limits: ExecLimits) -> tuple[Any, ...]:
    return tuple(getattr(limits, name) for name in _CONTAINER_LIMITS)


@dataclass
class WarmSandbox:
    """One warm container, owned by one (project, thread) of this process."""

    container_id: str
    project: str
    thread: str
    workspace: str
    limits_key: tuple[Any, ...]
    last_used: float
    busy: bool = False
    calls: int = 0

    def fits(self, spec: ExecSpec) -> bool:
        return (
            str(spec.workspace.resolve()) == self.workspace
            and _limits_key(spec.limits) == self.limits_key
        )


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
    name: str = "docker"
    _sandboxes: dict[tuple[str, str], WarmSandbox] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.idle_seconds <= 0 or self.max_containers < 0:
            raise ValueError("idle_seconds must be positive and max_containers not negative")

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
            sandbox = self._checkout(key, spec)
            if sandbox is None:
                return super().run_probed(spec)
            keep = False
            try:
                result = self._exec(sandbox, spec)
                # A timed-out or OOM-killed call leaves a container in an unknown state.
                keep = not (result.timed_out or result.oom_killed)
                return result
            finally:
                # The thread may have ended while this call ran (another process got the
                # notice): its container goes now instead of idling.
                if keep and self._ended(key):
                    keep = False
                self._checkin(key, sandbox, keep=keep)
        except _ThreadEnded:
            # A call of the thread that was queued before it ended: it runs (the control
            # plane decided it), but in a fresh container, since nothing of the thread may
            # stay warm. Its command never started in the warm one (see _exec).
            self.end_thread(*key)
            return super().run_probed(spec)

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
            if current is not None:
                if current.busy:
                    return None
                if current.fits(spec):
                    current.busy = True
                    return current
                stale = self._sandboxes.pop(key)
        if stale is not None:
            self._remove(stale.container_id)
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
            self._remove(sandbox.container_id)

    def _make_room(self, runner: str | None) -> bool:
        """Keep the runner under ``max_containers`` warm containers; False if it can't.

        Counted on the engine (by the runner's label when the call has one), so all worker
        processes of a runner host share the cap.
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
                idle = [s for s in self._sandboxes.items() if not s[1].busy]
                if not idle:
                    return False
                key, oldest = min(idle, key=lambda item: item[1].last_used)
                del self._sandboxes[key]
            self._remove(oldest.container_id)
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
            self._remove(sandbox.container_id)
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
            self._remove(sandbox.container_id)
        return True

    def close(self) -> None:
        """Remove every idle container of this process (the worker is shutting down)."""
        with self._lock:
            idle = [key for key, sandbox in self._sandboxes.items() if not sandbox.busy]
            gone = [self._sandboxes.pop(key) for key in idle]
        for sandbox in gone:
            self._remove(sandbox.container_id)

    def warm_containers(self) -> dict[tuple[str, str], str]:
        """(project, thread) -> container id, for tests and operators."""
        with self._lock:
            return {key: sandbox.container_id for key, sandbox in self._sandboxes.items()}

    # --- containers -------------------------------------------------------------------

    def _start(self, key: tuple[str, str], spec: ExecSpec) -> WarmSandbox:
        """Create, start and probe a container for ``spec``'s thread and limits."""
        project, thread = key
        labels = {"project": project, "thread": thread}
        if "runner" in spec.labels:
            labels["runner"] = spec.labels["runner"]
        keeper = ExecSpec(
            argv=KEEPER_ARGV, workspace=spec.workspace, limits=spec.limits, labels=labels
        )
        options = self.docker.container_options(keeper)
        options["labels"][WARM_LABEL] = "true"
        options["init"] = False  # the keeper is PID 1; see the module docstring
        options["working_dir"] = "/"
        try:
            container = self.client.containers.create(self.docker.image_id, **options)
        except _ENGINE_ERRORS as error:
            raise SandboxStartFailed(f"docker: cannot create the container: {error}") from None
        sandbox = WarmSandbox(
            container_id=container.id,
            project=project,
            thread=thread,
            workspace=str(spec.workspace.resolve()),
            limits_key=_limits_key(spec.limits),
            last_used=self.clock(),
        )
        try:
            try:
                container.start()
            except _ENGINE_ERRORS as error:
                if self._ended(key):
                    raise _ThreadEnded from None  # removed by a thread end before it started
                raise SandboxStartFailed(f"docker: cannot start the container: {error}") from None
            probe = probe_with(
                self.name, lambda probe_spec: self._exec(sandbox, probe_spec), spec.workspace
            )
            if not probe.ok:
                raise SandboxUnavailable(f"{self.name} sandbox failed its probe: {probe.detail}")
        except BaseException:
            self._remove(container.id)
            raise
        return sandbox

    def _exec(self, sandbox: WarmSandbox, spec: ExecSpec) -> ExecResult:
        """Run ``spec`` in the container by exec, with a fresh TMPDIR; see the module docstring."""
        uid, gid = workspace_owner()
        call = spec.labels.get("call", "call")
        tmpdir = f"{SANDBOX_TMP}/kestrel-{_safe(call)}-{secrets.token_hex(8)}"
        api = self.client.api
        key = (sandbox.project, sandbox.thread)
        try:
            exec_id = api.exec_create(
                sandbox.container_id,
                ["sh", "-c", EXEC_WRAPPER, "kestrel-exec", tmpdir, *spec.argv],
                stdout=True,
                stderr=True,
                stdin=False,
                tty=False,
                privileged=False,
                user=f"{uid}:{gid}",
                environment=spec.environment(),
                workdir=spec.sandbox_cwd,
            )["Id"]
        except _ENGINE_ERRORS as error:
            self._discard(sandbox)
            if self._ended(key):
                # Removed by a thread end (remove_idle_thread_containers); nothing ran.
                raise _ThreadEnded from None
            raise SandboxStartFailed(
                f"docker: cannot exec in the warm container: {error}"
            ) from None
        # Asked between creating the exec and starting it. A thread end marks the thread
        # ended *before* it looks for idle containers, and counts a created, unstarted exec
        # as busy; so either this sees the mark (and the command never starts here), or the
        # remover sees this exec and leaves the container to this call.
        if self._ended(key):
            self._discard(sandbox)
            raise _ThreadEnded
        try:
            sock = api.exec_start(exec_id, socket=True)
        except _ENGINE_ERRORS as error:
            # Dead or gone container: it is not used again, and the call is not retried here.
            self._discard(sandbox)
            raise SandboxStartFailed(
                f"docker: cannot exec in the warm container: {error}"
            ) from None
        _without_timeout(sock)
        limit = spec.limits.output_kb * 1024
        stdout, stderr = OutputBuffer(limit), OutputBuffer(limit)
        reader = threading.Thread(
            target=_demultiplex, args=(sock, stdout, stderr), name="docker-exec-output", daemon=True
        )
        started = time.monotonic()
        reader.start()
        try:
            reader.join(spec.limits.timeout_s)
            timed_out = reader.is_alive()
            if timed_out:
                # Killing PID 1 ends the PID namespace: the exec's whole tree goes with it.
                self._discard(sandbox)
                reader.join(_KILL_GRACE_S)
            duration_ms = int((time.monotonic() - started) * 1000)
        finally:
            with contextlib.suppress(OSError):
                sock.close()
        if timed_out:
            exit_code, oom_killed = 137, False
        else:
            exit_code = self._exit_code(sandbox, exec_id)
            oom_killed = exit_code == 137 and self._oom_killed(sandbox)
        if exit_code == _WRAPPER_FAILED and _WRAPPER_MESSAGE in stderr.text():
            raise SandboxStartFailed(
                "docker: could not make the call's TMPDIR in the warm container"
            )
        sandbox.calls += 1
        return ExecResult(
            exit_code=exit_code,
            stdout=stdout.text(),
            stderr=stderr.text(),
            truncated=stdout.truncated or stderr.truncated,
            duration_ms=duration_ms,
            timed_out=timed_out,
            oom_killed=oom_killed,
            sandbox=self.name,
        )

    def _exit_code(self, sandbox: WarmSandbox, exec_id: str) -> int:
        """The exec's exit status; the engine may need a moment after the stream ends."""
        deadline = time.monotonic() + _KILL_GRACE_S
        while True:
            try:
                state = self.client.api.exec_inspect(exec_id)
            except _ENGINE_ERRORS as error:
                self._discard(sandbox)
                raise SandboxError(f"docker: lost the warm container mid-call: {error}") from None
            if not state.get("Running") and state.get("ExitCode") is not None:
                return int(state["ExitCode"])
            if time.monotonic() > deadline:
                self._discard(sandbox)
                raise SandboxError("docker: the exec never reported an exit status")
            time.sleep(0.005)

    def _oom_killed(self, sandbox: WarmSandbox) -> bool:
        """Whether the container's memory cgroup killed something (a SIGKILL'd exec)."""
        try:
            container = self.client.containers.get(sandbox.container_id)
        except _ENGINE_ERRORS:
            return False
        if container.attrs["State"].get("OOMKilled"):
            return True
        # cgroup v1 and v2 both count OOM kills where the container can read them.
        probe = self.client.api.exec_create(
            sandbox.container_id,
            [
                "sh",
                "-c",
                "cat /sys/fs/cgroup/memory.events /sys/fs/cgroup/memory/memory.oom_control "
                "2>/dev/null",
            ],
            user="{}:{}".format(*workspace_owner()),
        )
        output = self.client.api.exec_start(probe["Id"]).decode(errors="replace")
        for line in output.splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill" and value.strip().isdigit() and int(value) > 0:
                return True
        return False

    def _discard(self, sandbox: WarmSandbox) -> None:
        with self._lock:
            key = (sandbox.project, sandbox.thread)
            if self._sandboxes.get(key) is sandbox:
                del self._sandboxes[key]
        self._remove(sandbox.container_id)

    def _remove(self, container_id: str) -> None:
        try:
            self.client.api.remove_container(container_id, force=True)
        except docker.errors.NotFound:
            pass
        except _ENGINE_ERRORS as error:
            log.warning("could not remove warm container %s: %s", container_id[:12], error)


class _ThreadEnded(Exception):
    """The thread ended before this call's command started in its warm container."""


def _thread_key(spec: ExecSpec) -> tuple[str, str] | None:
    project, thread = spec.labels.get("project"), spec.labels.get("thread")
    if not project or not thread:
        return None
    return project, thread


def _safe(value: str) -> str:
    return "".join(c for c in value if c.isalnum() or c in "_-")[:64] or "call"


def remove_idle_warm_containers(client: Any, *, runner_id: str | None = None) -> int:
    """Remove warm containers not running a call (a previous runner process left them).

    A warm container with a running exec is serving a call of a worker that died; it is
    left to that call's recovery (``containers_running_call``), exactly like a fresh
    container of a dead worker, so the recovery can still say what it removed.
    """
    filters = [f"{WARM_LABEL}=true"]
    if runner_id is not None:
        filters.append(f"{LABEL_PREFIX}runner={runner_id}")
    return _remove_idle(client, filters)


def remove_idle_thread_containers(
    client: Any, *, project: str, thread: str, runner_id: str | None = None
) -> int:
    """Remove the idle warm containers of one thread, whichever worker process keeps them.

    Found by label (project, thread and, when given, runner), so only that thread's
    containers of that runner are touched. A container with a running exec, or one created
    and not yet started, is serving a call and is left alone: the process running it removes
    it when the call checks in (it learns that the thread ended through
    ``WarmDockerBackend.thread_ended``). Call this only after marking the thread ended: a
    process about to use a container this removes then finds it gone or the thread ended
    before its command starts, and runs the call in a fresh container instead.
    """
    filters = [
        f"{WARM_LABEL}=true",
        f"{LABEL_PREFIX}project={project}",
        f"{LABEL_PREFIX}thread={thread}",
    ]
    if runner_id is not None:
        filters.append(f"{LABEL_PREFIX}runner={runner_id}")
    return _remove_idle(client, filters, spare_pending=True)


def _remove_idle(client: Any, filters: list[str], *, spare_pending: bool = False) -> int:
    """Remove the containers with all these labels that run no exec; how many.

    With ``spare_pending``, an exec created but not started counts as running.
    """
    removed = 0
    for container in client.containers.list(
        all=True, filters={"label": filters}, ignore_removed=True
    ):
        if container.status == "running" and _running_execs(
            client, container, pending=spare_pending
        ):
            continue
        with contextlib.suppress(docker.errors.NotFound):
            container.remove(force=True)
            removed += 1
    return removed


def containers_running_call(client: Any, call_id: str) -> list[Any]:
    """The warm containers whose running exec belongs to ``call_id`` (by its TMPDIR name)."""
    marker = f"{SANDBOX_TMP}/kestrel-{_safe(call_id)}-"
    found = []
    for container in client.containers.list(
        filters={"label": [f"{WARM_LABEL}=true"]}, ignore_removed=True
    ):
        for process in _running_execs(client, container):
            if any(str(arg).startswith(marker) for arg in process):
                found.append(container)
                break
    return found


def _running_execs(client: Any, container: Any, *, pending: bool = False) -> list[list[str]]:
    """The argv of each exec still running in ``container`` (with ``pending``, also of
    each exec created and not started yet: it has no exit code)."""
    running = []
    for exec_id in container.attrs.get("ExecIDs") or []:
        try:
            state = client.api.exec_inspect(exec_id)
        except docker.errors.NotFound:
            continue
        if state.get("Running") or (pending and state.get("ExitCode") is None):
            config = state.get("ProcessConfig") or {}
            running.append([config.get("entrypoint", ""), *(config.get("arguments") or [])])
    return running
