"""The runner process: a Celery worker that runs signed commands and reports signed results.

Start it with ``python -m runners worker`` (which runs ``celery -A runners.worker worker
-Q runner.<pool>``). Each message on the pool's queue is one command token; the task
``runner.execute`` hands it to ``Runner.handle``, which:

1. verifies the command (``runners.contract.tokens.verify_command``) before it touches anything;
   a refusal is logged as JSON and dropped, never run and never retried (RUN-1, RUN-2);
2. makes the call id single use through ``runners.callstate`` (RUN-9):
   a stored result is sent again; a live lease means another worker is running it, so
   this copy is a duplicate and is dropped; an expired lease means that worker died
   mid-call, so an idempotent tool runs again and any other tool ends ``runner_lost``;
   otherwise the call is claimed;
3. runs the tool through ``runners.dispatch.run_verified`` (process tools only inside a sandbox
   backend, never without), stores the signed "finished" report and sends it to the
   control plane's ``control.ingest_result`` task on queue ``control``. A "started" report
   goes first only when the call is still running after
   ``RunnerConfig.started_report_delay_s``: most calls take well under a second, and the
   finished report carries ``started_at``, so one report per quick call is enough.

Besides commands, every worker also consumes a broadcast queue bound to the fanout exchange
``runner.<pool>.control``: signed *control messages* (``runner.control``), today only
``thread.end``, which removes what the runner keeps warm for that thread. Each worker gets
its own copy; a message that does not verify is logged and dropped, and nothing else
happens (fail closed). Loss is acceptable there: the idle timeout and the cleanup at runner
start remove the containers anyway.

Celery is set for no loss: ``acks_late`` and ``reject_on_worker_lost`` keep a message
until its call ended, prefetch 1 keeps a dying worker from holding others' work, and the
broker's visibility timeout outlasts the longest call so a running call is not handed out
again while it runs. The runner has no result backend and no database (RUN-7).
"""

from __future__ import annotations

import enum
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

import docker
import docker.errors
import kombu.exceptions
import redis
import requests.exceptions
from celery import Celery
from celery.exceptions import Reject
from celery.signals import (
    celeryd_after_setup,
    worker_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
)
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from kombu.common import Broadcast

from runners import dispatch
from runners.callstate import HEARTBEAT_SECONDS, CallState, Lease, LeaseKeeper
from runners.config import RunnerConfig, env_seconds, env_whole_number
from runners.contract.errors import RunnerError
from runners.contract.names import (
    CONTROL_TASK,
    EXECUTE_TASK,
    HEARTBEAT_TASK,
    REPORT_QUEUE,
    REPORT_TASK,
)
from runners.contract.registry import get_tool
from runners.contract.tokens import (
    Command,
    CommandRefused,
    ControlMessage,
    ControlRefused,
    control_exchange,
    sign_result,
    token_digest,
    unverified_call_id,
    verify_command,
    verify_control_message,
)
from runners.heartbeat import HEARTBEAT_EXPIRES_SECONDS, start_heartbeats
from runners.sandbox import (
    DockerBackend,
    ExecLimits,
    SandboxBackend,
    WarmDockerBackend,
    select_backend,
)
from runners.sandbox.docker import LABEL_PREFIX
from runners.sandbox.warm import (
    containers_running_call,
    remove_idle_thread_containers,
    remove_idle_warm_containers,
)
from runners.workspace import workspace_for

__all__ = [
    "CONTROL_TASK",
    "EXECUTE_TASK",
    "REPORT_QUEUE",
    "REPORT_TASK",
    "Disposition",
    "Runner",
    "StartedReport",
    "WarmBackendChooser",
    "app",
    "celery_settings",
    "execute_command",
    "handle_control_message",
    "reap_orphan_containers",
]

# What a receipt names as the sandbox of a tool that starts no process: the workspace, whose
# openat walk is that tool's whole boundary (RUN-6). A process tool names its backend, or
# "none" when no backend could be had (it then failed closed without running).
WORKSPACE_SANDBOX = "workspace"
NO_SANDBOX = "none"

# The broker redelivers an unacknowledged message this long after the longest call could
# have ended; it must exceed callstate.LEASE_SECONDS so a redelivered call finds a dead
# worker's lease expired.
VISIBILITY_MARGIN_SECONDS = 60
# Celery kills a task this long after the longest call (the sandbox's own timeout should
# have ended it first); the message is then requeued and recovered like any lost call.
TIME_LIMIT_MARGIN_SECONDS = 30
# How often the broker looks for messages whose worker died (kombu scans only every
# interval x throttle seconds; its default throttle of 10 would mean every 100 s).
RESTORE_INTERVAL_SECONDS = 10
# Pause before handing a message back when Redis or the broker is unreachable.
INFRASTRUCTURE_RETRY_PAUSE_SECONDS = 5

log = logging.getLogger("kestrel.runner")


class Cancellable(Protocol):
    def cancel(self) -> None: ...


# (delay in seconds, what to run then) -> a started timer that can be cancelled.
StartTimer = Callable[[float, Callable[[], None]], Cancellable]


def daemon_timer(delay_s: float, function: Callable[[], None]) -> threading.Timer:
    """A daemon ``threading.Timer``: a worker process that exits does not wait for it."""
    timer = threading.Timer(delay_s, function)
    timer.daemon = True
    timer.start()
    return timer


class StartedReport:
    """A call's "started" report, sent only if the call outlives ``delay_s``.

    ``finish()`` is called when the tool returned, before the finished report is signed;
    from then on the started report is never sent, so it can never follow the finished one.
    A started report being sent holds the lock, so ``finish()`` waits for it to be handed
    to the broker: started is then sent first.
    """

    def __init__(self, send: Callable[[], None], *, delay_s: float, timer: StartTimer) -> None:
        self._send = send
        self._lock = threading.Lock()
        self._done = False
        self._timer: Cancellable | None = None
        if delay_s <= 0:
            self._fire()
        else:
            self._timer = timer(delay_s, self._fire_in_background)

    def _fire(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
            self._send()

    def _fire_in_background(self) -> None:
        try:
            self._fire()
        except Exception:
            # A timer thread's exception would otherwise only reach stderr; "started" is
            # informational, the finished report is what must arrive.
            log.exception("the started report failed")

    def finish(self) -> None:
        """The call ended: cancel the timer, and make sure a late one sends nothing."""
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            self._done = True


class Disposition(enum.StrEnum):
    """What the runner did with one delivery of a command."""

    REFUSED = "refused"  # verification failed; nothing happened
    RAN = "ran"  # claimed and ran the tool
    RESENT = "resent"  # the call had ended; its stored result was sent again
    REPLAYED = "replayed"  # another worker holds a live lease; this copy was dropped
    RERAN = "reran"  # a dead worker's idempotent call was run again
    LOST = "lost"  # a dead worker's non-idempotent call was ended runner_lost
    APPLIED = "applied"  # a control message verified and was acted on


@dataclass
class Runner:
    """One runner process: its identity and keys, the shared call state, how it reports."""

    config: RunnerConfig
    private_key: Ed25519PrivateKey
    control_public_key: Ed25519PublicKey
    state: CallState
    report: Callable[[str], None]
    choose_backend: Callable[[str], SandboxBackend] = select_backend
    reap_orphans: Callable[[str], int] = field(default=lambda call_id: 0)
    # (project, thread) -> how many warm containers of the thread were removed.
    end_thread: Callable[[str, str], int] = field(default=lambda project, thread: 0)
    # Starts the timer of a delayed "started" report (tests drive it by hand).
    start_timer: StartTimer = daemon_timer

    # --- entry point ---------------------------------------------------------------

    def handle(self, command_token: Any) -> Disposition:
        """Deal with one delivery of a command token; see the module docstring."""
        try:
            command = self._verify(command_token)
        except CommandRefused as refused:
            self._log(
                "command_refused",
                level=logging.WARNING,
                code=refused.code,
                call_id=unverified_call_id(command_token),
                call_id_verified=False,
                message=refused.message,
            )
            return Disposition.REFUSED
        return self._dispatch(command)

    def handle_control(self, token: Any) -> Disposition:
        """Deal with one control message; see the module docstring.

        Verified exactly like a command (signature, header, claims, audience, time window)
        and refused, logged and dropped otherwise, before anything is touched.
        """
        try:
            message = verify_control_message(
                token, control_public_key=self.control_public_key, pool=self.config.pool
            )
        except ControlRefused as refused:
            self._log(
                "control_refused",
                level=logging.WARNING,
                code=refused.code,
                message=refused.message,
            )
            return Disposition.REFUSED
        # verify_control_message knows no other type; this guard keeps a new one from being
        # half handled if it is added there first.
        if message.type != "thread.end":
            self._log("control_refused", level=logging.WARNING, code="unknown_type")
            return Disposition.REFUSED
        self._end_thread(message)
        return Disposition.APPLIED

    def _end_thread(self, message: ControlMessage) -> None:
        try:
            # First, so every other worker process stops keeping the thread warm (a busy
            # container is removed when its call checks in) before idle ones are removed.
            self.state.mark_thread_ended(message.prj, message.thr)
        except redis.RedisError as error:
            self._log("infrastructure_error", level=logging.ERROR, error=type(error).__name__)
        removed = self.end_thread(message.prj, message.thr)
        self._log(
            "thread_ended",
            project=message.prj,
            thread=message.thr,
            control_message=message.jti,
            removed_containers=removed,
        )

    def _verify(self, token: Any) -> Command:
        try:
            return verify_command(
                token, control_public_key=self.control_public_key, pool=self.config.pool
            )
        except CommandRefused as refused:
            if refused.code != "expired":
                raise
            # A command redelivered after a crash arrives long after its ~2 minute expiry.
            # If a runner of this pool accepted this very token in time (the lease records
            # its digest), judge it as of that moment; any other expired token is refused.
            call_id = unverified_call_id(token)
            lease = self.state.lease(call_id) if call_id else None
            if lease is None or lease.command_digest != token_digest(token):
                raise
            return verify_command(
                token,
                control_public_key=self.control_public_key,
                pool=self.config.pool,
                now=lease.accepted_at,
            )

    # --- single use of the call id ---------------------------------------------------

    def _dispatch(self, command: Command) -> Disposition:
        """Claim, recover, resend or drop, decided on the call's state in Redis.

        A live lease is watched for a little while before the copy is dropped: if its
        holder still beats, this is a duplicate; if the beats have stopped (a worker that
        died moments ago and whose message was requeued at once), the lease runs out and
        the call is recovered here instead of being lost.
        """
        watched: Lease | None = None
        deadline = time.monotonic() + self.state.lease_seconds + 2 * HEARTBEAT_SECONDS
        while True:
            stored = self.state.stored_result(command.jti)
            if stored is not None:
                self._log("result_resent", call_id=command.jti, attempt=command.attempt)
                self.report(stored)
                return Disposition.RESENT
            lease = self.state.claim(
                command.jti, attempt=command.attempt, command_digest=command.command_digest
            )
            if lease is not None:
                self._run(command, lease)
                return Disposition.RAN
            current = self.state.lease(command.jti)
            if current is not None and current.expired():
                taken = self.state.take_over(
                    current, attempt=command.attempt, command_digest=command.command_digest
                )
                if taken is not None:
                    return self._recover(command, taken)
                continue
            beating = (
                watched is not None
                and current is not None
                and (current.holder, current.lease_until) != (watched.holder, watched.lease_until)
            )
            if beating or time.monotonic() > deadline:
                self._log(
                    "command_refused",
                    level=logging.WARNING,
                    code="replayed",
                    call_id=command.jti,
                    call_id_verified=True,
                    message="another worker is running this call; this copy was dropped",
                )
                return Disposition.REPLAYED
            watched = watched or current
            time.sleep(0.25)

    def _recover(self, command: Command, lease: Lease) -> Disposition:
        """Finish a call whose previous worker died mid-run, without running it twice."""
        # A dead worker's container may still be running the command; it must not have an
        # effect after the call is reported, nor beside a second run.
        reaped = self.reap_orphans(command.jti)
        if get_tool(command.tool).idempotent:
            self._log("call_rerun", call_id=command.jti, reaped_containers=reaped)
            self._run(command, lease)
            return Disposition.RERAN
        self._log("call_lost", level=logging.WARNING, call_id=command.jti, reaped_containers=reaped)
        error = {
            "code": "runner_lost",
            "message": (
                "the runner stopped while running this call; the tool is not idempotent, "
                "so it was not run again"
            ),
        }
        token = self._finished(command, outcome="failed", result=None, error=error)
        self.report(self._store(command, token))
        return Disposition.LOST

    # --- running ----------------------------------------------------------------------

    def _run(self, command: Command, lease: Lease) -> None:
        with LeaseKeeper(self.state, lease) as keeper:
            started_at = _utc_now()
            started = StartedReport(
                lambda: self._report_started(command, started_at),
                delay_s=self.config.started_report_delay_s,
                timer=self.start_timer,
            )
            try:
                outcome, result, error, sandbox = self._execute(command)
            finally:
                started.finish()
            token = self._finished(
                command,
                outcome=outcome,
                result=result,
                error=error,
                sandbox=sandbox,
                started_at=started_at,
            )
            final = self._store(command, token)
        if keeper.lost:
            self._log("lease_lost", level=logging.WARNING, call_id=command.jti)
        self._log("call_finished", call_id=command.jti, outcome=outcome, tool=command.tool)
        self.report(final)

    def _execute(
        self, command: Command
    ) -> tuple[str, dict[str, Any] | None, dict[str, str] | None, str | None]:
        """Run the tool; every failure becomes a typed error, nothing escapes unsandboxed."""
        backend: SandboxBackend | None = None
        try:
            workspace = workspace_for(self.config.workspace_root, command.prj)
            if get_tool(command.tool).runs_process:
                backend = self.choose_backend(self.config.sandbox)
            result = dispatch.run_verified(
                command.tool,
                command.args,
                workspace=workspace,
                backend=backend,
                limits=self._limits(command),
                labels=self._labels(command),
            )
        except RunnerError as error:
            outcome = ("failed", None, {"code": error.code, "message": str(error)})
            return (*outcome, self._sandbox_name(command, backend))
        except Exception:
            log.exception("tool %s crashed in call %s", command.tool, command.jti)
            error_body = {"code": "internal_error", "message": "the runner failed unexpectedly"}
            return "failed", None, error_body, self._sandbox_name(command, backend)
        return "succeeded", result, None, self._sandbox_name(command, backend)

    @staticmethod
    def _sandbox_name(command: Command, backend: SandboxBackend | None) -> str:
        if not get_tool(command.tool).runs_process:
            return WORKSPACE_SANDBOX
        return backend.name if backend is not None else NO_SANDBOX

    def _limits(self, command: Command) -> ExecLimits:
        limits = dict(command.limits)
        # The runner's own ceiling: past it the broker would hand the message out again.
        limits["timeout_s"] = min(limits["timeout_s"], self.config.max_call_seconds)
        return ExecLimits(**limits)

    def _labels(self, command: Command) -> dict[str, str]:
        labels = {"call": command.jti, "project": command.prj, "runner": self.config.runner_id}
        if command.thr is not None:
            labels["thread"] = command.thr
        return labels

    # --- reports ----------------------------------------------------------------------

    def _report_started(self, command: Command, started_at: str) -> None:
        token = self._sign(
            command,
            event="started",
            outcome=None,
            result=None,
            error=None,
            sandbox=None,
            started_at=started_at,
            finished_at=None,
        )
        try:
            self.report(token)
        except kombu.exceptions.OperationalError:
            # "started" is informational; the finished report is what must arrive.
            log.warning("could not send the started report of call %s", command.jti)

    def _finished(
        self,
        command: Command,
        *,
        outcome: str,
        result: dict[str, Any] | None,
        error: dict[str, str] | None,
        sandbox: str | None = None,
        started_at: str | None = None,
    ) -> str:
        return self._sign(
            command,
            event="finished",
            outcome=outcome,
            result=result,
            error=error,
            sandbox=sandbox,
            started_at=started_at,
            finished_at=_utc_now(),
        )

    def _sign(self, command: Command, **claims: Any) -> str:
        return sign_result(
            {
                "call_id": command.jti,
                "command_digest": command.command_digest,
                "attempt": command.attempt,
                **claims,
            },
            self.private_key,
            self.config.runner_id,
        )

    def _store(self, command: Command, token: str) -> str:
        """Store the finished report; the first one stored for a call is the only one."""
        return self.state.store_result(command.jti, token)

    def _log(self, event: str, *, level: int = logging.INFO, **fields: Any) -> None:
        record = {"event": event, "runner": self.config.runner_id, **fields}
        log.log(level, json.dumps(record, sort_keys=True, default=str))


def _utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def reap_orphan_containers(call_id: str) -> int:
    """Remove every container running ``call_id``; how many there were.

    When a worker is killed a fresh container keeps running, unattended. Recovery removes it
    before it reports the call lost or runs it again, so a lost call has no late effect.
    A fresh container carries the call's label. A warm one is found by the call its host-side
    directory names; its agent already killed the call when the worker's connection dropped,
    and it is usually gone by now, removed as idle when the next worker started.
    """
    try:
        client = docker.from_env()
    except docker.errors.DockerException:
        return 0
    try:
        containers = {
            container.id: container
            for container in client.containers.list(
                all=True, filters={"label": f"{LABEL_PREFIX}call={call_id}"}
            )
        }
        for container in containers_running_call(client, call_id):
            containers.setdefault(container.id, container)
        for container in containers.values():
            try:
                container.remove(force=True)
            except docker.errors.NotFound:
                pass
        return len(containers)
    except (docker.errors.DockerException, requests.exceptions.RequestException) as error:
        log.warning("could not reap containers of call %s: %s", call_id, error)
        return 0
    finally:
        client.close()


# --- warm sandboxes --------------------------------------------------------------------

# Warm sandboxes (runners.sandbox.warm): on unless KESTREL_WARM_SANDBOXES=0. The idle time
# and the per-host cap are read here rather than in RunnerConfig because they tune a cache,
# not the runner's identity or authority.
WARM_ENABLED_VARIABLE = "KESTREL_WARM_SANDBOXES"
WARM_IDLE_VARIABLE = "KESTREL_WARM_IDLE_SECONDS"
WARM_MAX_VARIABLE = "KESTREL_WARM_MAX_CONTAINERS"
# How often a worker process removes its idle warm containers when no call comes.
WARM_SWEEP_SECONDS = 30


class WarmBackendChooser:
    """``Runner.choose_backend`` for a worker process: one Docker backend, kept warm.

    Choosing a backend costs a client, a ping and an image lookup; doing it per call was
    the largest avoidable cost on the runner. The Docker backend chosen first is kept for
    the life of the process (its image id pinned then, as documented) and wrapped in a
    ``WarmDockerBackend``. Any other outcome (bubblewrap under "auto", or no backend at
    all) is not cached, so a Docker engine that comes back is picked up by the next call.
    """

    def __init__(
        self,
        *,
        idle_seconds: float,
        max_containers: int,
        enabled: bool,
        thread_ended: Callable[[str, str], bool] | None = None,
    ) -> None:
        self.idle_seconds = idle_seconds
        self.max_containers = max_containers
        self.enabled = enabled
        self.thread_ended = thread_ended
        self.backend: WarmDockerBackend | None = None
        self._lock = threading.Lock()
        self._sweeper: threading.Thread | None = None

    @classmethod
    def from_environment(
        cls,
        environ: dict[str, str] | None = None,
        *,
        thread_ended: Callable[[str, str], bool] | None = None,
    ) -> WarmBackendChooser:
        environ = dict(os.environ if environ is None else environ)
        idle = env_seconds(environ, WARM_IDLE_VARIABLE, 300, above_zero=True)
        cap = env_whole_number(
            environ, WARM_MAX_VARIABLE, 16, hint=" (KESTREL_WARM_SANDBOXES=0 turns them off)"
        )
        enabled = environ.get(WARM_ENABLED_VARIABLE, "1") not in ("0", "false", "no", "off")
        return cls(
            idle_seconds=idle, max_containers=cap, enabled=enabled, thread_ended=thread_ended
        )

    def __call__(self, preference: str) -> SandboxBackend:
        with self._lock:
            if self.backend is not None:
                return self.backend
            backend = select_backend(preference)
            if not isinstance(backend, DockerBackend):
                return backend
            self.backend = WarmDockerBackend(
                backend,
                idle_seconds=self.idle_seconds,
                max_containers=self.max_containers if self.enabled else 0,
                thread_ended=self.thread_ended,
            )
            self._sweeper = threading.Thread(
                target=self._sweep, name="warm-sandbox-sweeper", daemon=True
            )
            self._sweeper.start()
            return self.backend

    def _sweep(self) -> None:
        while True:
            time.sleep(WARM_SWEEP_SECONDS)
            backend = self.backend
            if backend is not None:
                try:
                    backend.remove_idle()
                except Exception:
                    log.exception("warm sandbox sweep failed")

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()

    def end_thread(self, project: str, thread: str, *, runner_id: str) -> int:
        """The thread ended: remove its idle warm containers of every worker process of
        this runner on the engine, and drop it from this process's pool; how many went.

        A container busy with a call is left to finish it; the process running it removes
        it at check-in (``WarmDockerBackend.thread_ended``).
        """
        backend = self.backend
        try:
            client = backend.client if backend is not None else docker.from_env()
        except docker.errors.DockerException as error:
            log.warning("cannot reach the engine to end thread %s: %s", thread, error)
            return 0
        try:
            removed = remove_idle_thread_containers(
                client, project=project, thread=thread, runner_id=runner_id
            )
        except (docker.errors.DockerException, requests.exceptions.RequestException) as error:
            log.warning("could not remove the warm containers of thread %s: %s", thread, error)
            removed = 0
        finally:
            if backend is None:
                client.close()
        if backend is not None:
            # After the engine pass, so its count includes this process's idle container;
            # removing it again here is a no-op, a busy one goes at check-in.
            backend.end_thread(project, thread)
        return removed


def remove_stale_warm_containers(runner_id: str) -> int:
    """Remove idle warm containers a previous process of this runner left (runner start)."""
    try:
        client = docker.from_env()
    except docker.errors.DockerException:
        return 0
    try:
        return remove_idle_warm_containers(client, runner_id=runner_id)
    except (docker.errors.DockerException, requests.exceptions.RequestException) as error:
        log.warning("could not remove stale warm containers: %s", error)
        return 0
    finally:
        client.close()


# --- the Celery app ------------------------------------------------------------------


def celery_settings(config: RunnerConfig) -> dict[str, Any]:
    """The worker's Celery configuration: at-least-once delivery, JSON only, no backend."""
    return {
        "broker_url": config.broker_url,
        "broker_connection_retry_on_startup": True,
        "broker_transport_options": {
            "visibility_timeout": config.max_call_seconds + VISIBILITY_MARGIN_SECONDS,
            "unacked_restore_interval": RESTORE_INTERVAL_SECONDS,
            "unacked_restore_throttle": 1,
        },
        "result_backend": None,
        "task_ignore_result": True,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "task_default_queue": config.queue,
        "task_time_limit": config.max_call_seconds + TIME_LIMIT_MARGIN_SECONDS,
        "worker_send_task_events": False,
        "task_send_sent_event": False,
    }


app = Celery("kestrel-runner", set_as_current=False)
# Loaded when the worker first reads its configuration, not at import: tests and tools
# import this module without a runner environment.
app.add_defaults(lambda: celery_settings(RunnerConfig.from_environment()))

_process_runner: tuple[int, Runner] | None = None
_process_runner_lock = threading.Lock()


def current_runner() -> Runner:
    """This process's Runner, built from the environment once per process (after fork)."""
    global _process_runner
    with _process_runner_lock:
        if _process_runner is None or _process_runner[0] != os.getpid():
            config = RunnerConfig.from_environment()
            client = redis.Redis.from_url(
                config.state_url, socket_timeout=10, socket_connect_timeout=5
            )
            worker = f"{config.runner_id}/{socket.gethostname()}/{os.getpid()}"
            state = CallState(client, worker=worker)
            chooser = WarmBackendChooser.from_environment(thread_ended=state.thread_ended)
            docker_capable = config.sandbox in ("auto", "docker")
            runner = Runner(
                config=config,
                private_key=config.private_key(),
                control_public_key=config.control_public_key(),
                state=state,
                report=send_report,
                choose_backend=chooser,
                reap_orphans=reap_orphan_containers if docker_capable else (lambda call_id: 0),
                end_thread=(
                    (
                        lambda project, thread: chooser.end_thread(
                            project, thread, runner_id=config.runner_id
                        )
                    )
                    if docker_capable
                    else (lambda project, thread: 0)
                ),
            )
            _process_runner = (os.getpid(), runner)
        return _process_runner[1]


@worker_init.connect
def _on_worker_start(sender: Any = None, **_: Any) -> None:
    """Clear what a previous process of this runner left warm, before taking any call."""
    if getattr(sender, "app", None) is not app:
        return  # another Celery app's worker in this process (worker_init is global)
    config = RunnerConfig.from_environment()
    if config.sandbox in ("auto", "docker"):
        removed = remove_stale_warm_containers(config.runner_id)
        log.info(json.dumps({"event": "warm_containers_removed", "count": removed}))


@celeryd_after_setup.connect
def _consume_control_messages(sender: Any = None, instance: Any = None, **_: Any) -> None:
    """Also consume this pool's control messages, whatever ``-Q`` selected.

    A broadcast queue: each worker gets its own uniquely named queue bound to the fanout
    exchange ``runner.<pool>.control``, so every worker of the pool gets every message. On
    Redis that is PUBLISH/SUBSCRIBE: nothing is stored, a worker that is down or not yet
    subscribed misses the message (acceptable, see the module docstring). The routing key is
    set explicitly because the Redis transport subscribes to ``<exchange>/<routing key>``.
    """
    if getattr(instance, "app", None) is not app:
        return  # another Celery app's worker in this process (the signal is global)
    exchange = control_exchange(RunnerConfig.from_environment().pool)
    instance.app.amqp.queues.select_add(
        Broadcast(exchange, queue=exchange, unique=True, routing_key=exchange)
    )


_heartbeats: threading.Event | None = None


@worker_ready.connect
def _start_heartbeats(sender: Any = None, **_: Any) -> None:
    """The main process tells the control plane it is up, and with which sandbox, from now on
    every 30 s (runners.heartbeat)."""
    global _heartbeats
    if getattr(sender, "app", None) is not app:
        return  # another Celery app's worker in this process (the signal is global)
    _heartbeats = start_heartbeats(RunnerConfig.from_environment(), send_heartbeat)


@worker_shutdown.connect
def _stop_heartbeats(**_: Any) -> None:
    if _heartbeats is not None:
        _heartbeats.set()


@worker_process_shutdown.connect
def _on_process_shutdown(**_: Any) -> None:
    """A worker process that stops removes its idle warm containers."""
    if _process_runner is not None and _process_runner[0] == os.getpid():
        chooser = _process_runner[1].choose_backend
        if isinstance(chooser, WarmBackendChooser):
            chooser.close()


def send_report(result_token: str) -> None:
    """Send a signed report to the control plane, by task name (no shared code)."""
    app.send_task(REPORT_TASK, args=[result_token], queue=REPORT_QUEUE)


def send_heartbeat(heartbeat_token: str) -> None:
    """Send a signed heartbeat; one that waited past its lifetime is dropped unread.

    On a connection of its own, opened for this one message: the heartbeat thread then
    shares no connection or pool with the worker's own loop in the main process.
    """
    with app.connection_for_write() as connection:
        app.send_task(
            HEARTBEAT_TASK,
            args=[heartbeat_token],
            queue=REPORT_QUEUE,
            expires=HEARTBEAT_EXPIRES_SECONDS,
            retry=False,
            connection=connection,
        )


@app.task(
    name=EXECUTE_TASK,
    acks_late=True,
    reject_on_worker_lost=True,
    ignore_result=True,
)
def execute_command(command_token: str) -> str:
    """Run one signed command; refusals end here, infrastructure failures requeue it."""
    try:
        return current_runner().handle(command_token).value
    except (redis.RedisError, kombu.exceptions.OperationalError) as error:
        # Call state or the broker is unreachable: the call's fate is unknown here, so
        # hand the message back; its state decides what the next delivery does.
        log.error(
            json.dumps({"event": "infrastructure_error", "error": str(error)[:500]}, sort_keys=True)
        )
        time.sleep(INFRASTRUCTURE_RETRY_PAUSE_SECONDS)
        raise Reject(str(error), requeue=True) from None


@app.task(name=CONTROL_TASK, acks_late=False, ignore_result=True)
def handle_control_message(control_token: str) -> str:
    """Act on one signed control message; a refused one ends here, nothing is retried.

    Acknowledged on receipt: a broadcast copy is this worker's alone, so handing it back
    could only deliver it again here.
    """
    return current_runner().handle_control(control_token).value
