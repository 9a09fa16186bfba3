"""The runner's handling of one command delivery: verify, claim, run, report (``Runner``).

The steps and the guarantees behind them are in docs/runners.md ("One call on the runner").
``Runner`` holds no Celery: ``runners.worker`` builds one per process and hands it each
delivery; tests build it directly on real call state.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kombu.exceptions
import redis
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from runners import dispatch
from runners.adapter_broker import AdapterBroker, AdapterTransport
from runners.callstate import HEARTBEAT_SECONDS, CallState, Lease, LeaseKeeper, is_reported
from runners.config import RunnerConfig
from runners.contract.canonical import token_digest
from runners.contract.errors import RunnerError
from runners.contract.mcp_discovery import (
    DiscoveryRefused,
    DiscoveryRequest,
    sign_discovery_report,
    verify_discovery_request,
)
from runners.contract.registry import get_tool
from runners.contract.tokens import (
    Command,
    CommandRefused,
    ControlMessage,
    ControlRefused,
    sign_result,
    unverified_call_id,
    verify_command,
    verify_control_message,
)
from runners.contract.toolspec import McpServers
from runners.mcp.errors import McpStartFailed
from runners.mcp.servers import refuse_ended_risk
from runners.report_budget import REPORT_TOO_LARGE, fit_result
from runners.sandbox import (
    DockerBackend,
    ExecLimits,
    SandboxBackend,
    WarmDockerBackend,
    select_backend,
)
from runners.started import StartedReport, StartTimer, daemon_timer
from runners.workspace import workspace_for, workspace_remove

# What a receipt names as the sandbox of a tool that starts no process: the workspace, whose
# openat walk is that tool's whole boundary (RUN-6). A process tool names its backend, or
# "none" when no backend could be had (it then failed closed without running).
WORKSPACE_SANDBOX = "workspace"
NO_SANDBOX = "none"
# The backends whose engine can run MCP server containers.
DOCKER_BACKENDS = (DockerBackend, WarmDockerBackend)

log = logging.getLogger("kestrel.runner")


class Disposition(enum.StrEnum):
    """What the runner did with one delivery of a command."""

    REFUSED = "refused"  # verification failed; nothing happened
    RAN = "ran"  # claimed and ran the tool
    RESENT = "resent"  # the call had ended; its stored result was sent again
    REPORTED = "reported"  # the call had ended and its report already went out; dropped
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
    # A project was deleted: stop its warm containers and MCP servers; how many.
    end_project: Callable[[str], int] = field(default=lambda project: 0)
    # An MCP risk acceptance ended: stop the servers started under it; how many.
    end_risk_acceptance: Callable[[str], int] = field(default=lambda acceptance: 0)
    # Starts the timer of a delayed "started" report (tests drive it by hand).
    start_timer: StartTimer = daemon_timer
    # How a process call's adapter broker reaches the control plane (runners.adapter_broker);
    # None: process calls get no broker (no socket is mounted).
    adapter_transport: AdapterTransport | None = None
    # The MCP servers (runners.mcp.servers), given to a call only when its backend is Docker
    # (plain or warm): a server container needs the engine. None: mcp.call fails
    # mcp_unavailable.
    mcp_servers: McpServers | None = None
    # Answers a verified MCP discovery request with its report's claims (image,
    # server_info, tools, error: runners.mcp.discovery.discover); None where the backend
    # cannot run MCP servers (the report then says mcp_unavailable).
    discover_mcp: Callable[[DiscoveryRequest], dict[str, Any]] | None = None
    # Sends a signed discovery report to the control plane (control.mcp_discovered).
    report_discovery: Callable[[str], None] = field(default=lambda token: None)

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
        if self.config.organization is not None and command.org != self.config.organization:
            return self._refuse_foreign(command)
        return self._dispatch(command)

    def _refuse_foreign(self, command: Command) -> Disposition:
        """A dedicated runner never runs, claims or stores another organization's call; it
        says so in a signed report, which the control plane refuses and audits."""
        message = "this runner is dedicated to another organization; the call was not run"
        self._log(
            "command_refused",
            level=logging.WARNING,
            code="wrong_organization",
            call_id=command.jti,
            call_id_verified=True,
            message=message,
        )
        error = {"code": "wrong_organization", "message": message}
        try:
            self.report(self._finished(command, outcome="failed", result=None, error=error))
        except kombu.exceptions.OperationalError:
            log.warning("could not report the refusal of call %s", command.jti)
        return Disposition.REFUSED

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
        if message.type == "thread.end":
            self._end_thread(message)
        elif message.type == "project.delete":
            self._delete_project(message)
        elif message.type == "mcp.risk.end":
            self._end_risk_acceptance(message)
        else:
            self._log("control_refused", level=logging.WARNING, code="unknown_type")
            return Disposition.REFUSED
        return Disposition.APPLIED

    def handle_discovery(self, token: Any) -> Disposition:
        """Answer one MCP discovery request (runners.contract.mcp_discovery): verified like
        a command, then the server is started, its tools listed and a report signed with
        this runner's key sent back; a refused request is logged and dropped."""
        try:
            request = verify_discovery_request(
                token, control_public_key=self.control_public_key, pool=self.config.pool
            )
        except DiscoveryRefused as refused:
            self._log(
                "discovery_refused",
                level=logging.WARNING,
                code=refused.code,
                message=refused.message,
            )
            return Disposition.REFUSED
        claims: dict[str, Any]
        if self.config.organization is not None and request.org != self.config.organization:
            message = "this runner is dedicated to another organization; nothing was started"
            claims = {"code": "wrong_organization", "message": message}
            claims = {"image": None, "server_info": None, "tools": None, "error": claims}
        elif self.discover_mcp is None:
            message = "MCP servers run only on a runner with the Docker sandbox"
            claims = {"code": "mcp_unavailable", "message": message}
            claims = {"image": None, "server_info": None, "tools": None, "error": claims}
        else:
            try:
                refuse_ended_risk(request.profile, self.state.risk_ended)
            except McpStartFailed as ended:
                claims = {"code": ended.code, "message": str(ended)}
                claims = {"image": None, "server_info": None, "tools": None, "error": claims}
            else:
                claims = self.discover_mcp(request)
        report = sign_discovery_report(
            {
                "iss": self.config.runner_id,
                "discovery": request.jti,
                "request_digest": request.request_digest,
                **claims,
            },
            self.private_key,
        )
        self.report_discovery(report)
        error = claims.get("error")
        self._log(
            "mcp_discovered",
            discovery=request.jti,
            tools=None if claims.get("tools") is None else len(claims["tools"]),
            error=error.get("code") if isinstance(error, dict) else None,
        )
        return Disposition.APPLIED

    def _delete_project(self, message: ControlMessage) -> None:
        """Remove a deleted project's workspace on this host: files, quota image and all.

        First its warm containers and MCP servers go: they mount the workspace, and would
        keep its files reachable until their idle timeout. The shared mark comes first, as
        for a thread's end, so a container busy in any worker process goes when its call
        checks in. Failing all that, the workspace is removed all the same.
        """
        try:
            self.state.mark_project_deleted(message.prj)
        except redis.RedisError as error:
            self._log("infrastructure_error", level=logging.ERROR, error=type(error).__name__)
        try:
            stopped = self.end_project(message.prj)
        except Exception as error:
            self._log(
                "project_containers_remove_failed",
                level=logging.ERROR,
                project=message.prj,
                error=f"{type(error).__name__}: {error}"[:500],
            )
        else:
            if stopped:
                self._log("project_containers_removed", project=message.prj, removed=stopped)
        try:
            removed = workspace_remove(self.config.workspace_root, message.prj)
        except (OSError, RunnerError) as error:
            self._log(
                "workspace_remove_failed",
                level=logging.ERROR,
                project=message.prj,
                error=f"{type(error).__name__}: {error}"[:500],
            )
            return
        self._log(
            "workspace_removed",
            project=message.prj,
            control_message=message.jti,
            removed=removed,
        )

    def _end_risk_acceptance(self, message: ControlMessage) -> None:
        """Stop the MCP servers this host started under a risk acceptance that ended: their
        containers have the bridge network it gave, and none may keep it (a busy one goes
        after its call; the next call starts a network-less one). First it is recorded for
        the pool, so that no process starts one again under it (a command signed before the
        end, still queued or in flight)."""
        try:
            self.state.mark_risk_ended(message.rsk)
        except redis.RedisError as error:
            self._log("infrastructure_error", level=logging.ERROR, error=type(error).__name__)
        stopped = self.end_risk_acceptance(message.rsk)
        self._log(
            "mcp_risk_ended",
            risk_acceptance=message.rsk,
            control_message=message.jti,
            stopped_servers=stopped,
        )

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
            if stored is not None and is_reported(stored):
                self._log("result_already_reported", call_id=command.jti, attempt=command.attempt)
                return Disposition.REPORTED
            if stored is not None:
                # The holder of a live lease sends its stored report itself, before it lets
                # the lease go; a copy resends only the report of a worker that is gone.
                holder = self.state.lease(command.jti)
                if holder is None or holder.expired():
                    self._log("result_resent", call_id=command.jti, attempt=command.attempt)
                    self._send_finished(command, stored)
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
        self._send_finished(command, self._store(command, token))
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
                outcome, result, error, sandbox = self._execute(command, started)
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
            # Sent (and marked sent) while the lease is held, so that a copy of the command
            # arriving now finds the lease, not an unsent report to send a second time.
            self._send_finished(command, final)
        if keeper.lost:
            self._log("lease_lost", level=logging.WARNING, call_id=command.jti)
        self._log("call_finished", call_id=command.jti, outcome=outcome, tool=command.tool)

    def _execute(
        self, command: Command, started: StartedReport | None = None
    ) -> tuple[str, dict[str, Any] | None, dict[str, Any] | None, str | None]:
        """Run the tool; every failure becomes a typed error, nothing escapes unsandboxed."""
        backend: SandboxBackend | None = None
        try:
            workspace = workspace_for(
                self.config.workspace_root, command.prj, quota_mb=self.config.workspace_quota_mb
            )
            limits = self._limits(command)
            with contextlib.ExitStack() as stack:
                adapter_dir = None
                tool = get_tool(command.tool)
                if tool.runs_process:
                    backend = self.choose_backend(self.config.sandbox)
                    broker = None
                    if tool.adapter_broker:
                        broker = self._adapter_broker(command, limits, started, backend)
                    if broker is not None:
                        try:
                            adapter_dir = stack.enter_context(broker).directory
                        except OSError as error:
                            # The call runs; only its adapter requests have nowhere to go.
                            self._log(
                                "adapter_broker_unavailable",
                                level=logging.ERROR,
                                call_id=command.jti,
                                error=f"{type(error).__name__}: {error}"[:300],
                            )
                result = dispatch.run_verified(
                    command.tool,
                    command.args,
                    workspace=workspace,
                    backend=backend,
                    limits=limits,
                    labels=self._labels(command),
                    read_max_file_bytes=self.config.read_max_file_bytes,
                    write_budget_bytes=self.config.call_write_budget_bytes,
                    adapter_dir=adapter_dir,
                    mcp=self.mcp_servers if isinstance(backend, DOCKER_BACKENDS) else None,
                    project=command.prj,
                    thread=command.thr,
                    call_id=command.jti,
                )
        except RunnerError as error:
            body: dict[str, Any] = {"code": error.code, "message": str(error)}
            details = getattr(error, "details", None)
            if isinstance(details, dict):
                body["details"] = details  # bounded by its error (runners.mcp.errors)
            return "failed", None, body, self._sandbox_name(command, backend)
        except Exception:
            log.exception("tool %s crashed in call %s", command.tool, command.jti)
            error_body = {"code": "internal_error", "message": "the runner failed unexpectedly"}
            return "failed", None, error_body, self._sandbox_name(command, backend)
        return "succeeded", result, None, self._sandbox_name(command, backend)

    def _adapter_broker(
        self,
        command: Command,
        limits: ExecLimits,
        started: StartedReport | None,
        backend: SandboxBackend,
    ) -> AdapterBroker | None:
        """The call's adapter broker, open for as long as the call runs (CRED-3); its wait
        for an answer is bounded by the call's own timeout."""
        if self.adapter_transport is None:
            return None
        return AdapterBroker(
            call_id=command.jti,
            command_digest=command.command_digest,
            runner_id=self.config.runner_id,
            pool=self.config.pool,
            private_key=self.private_key,
            control_public_key=self.control_public_key,
            transport=self.adapter_transport,
            deadline=time.monotonic() + limits.timeout_s,
            # The control plane answers only for a call it sees running on this runner.
            before_request=started.send_now if started is not None else (lambda: None),
            # A backend may want the sockets somewhere of its own (warm containers: on the
            # filesystem of their directories); otherwise KESTREL_ADAPTER_BROKER_DIR.
            root=getattr(backend, "adapter_root", None),
        )

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
        error: dict[str, Any] | None,
        sandbox: str | None = None,
        started_at: str | None = None,
    ) -> str:
        """The signed finished report, within the report budget (``runners.report_budget``):
        a result too large is cut, saying so, and one that cannot be cut enough becomes a
        failure that says why, so the call still gets a report the control plane takes."""
        finished_at = _utc_now()

        def signed(result: dict[str, Any] | None, **overrides: Any) -> str:
            claims = {"outcome": outcome, "error": error, **overrides}
            return self._sign(
                command,
                event="finished",
                result=result,
                sandbox=sandbox,
                started_at=started_at,
                finished_at=finished_at,
                **claims,
            )

        token = signed(result)
        budget = self.config.max_report_bytes
        if result is None or len(token) <= budget:
            return token
        fitted = fit_result(result, lambda candidate: len(signed(candidate)), budget)
        if fitted is not None:
            self._log("report_cut", call_id=command.jti, report_bytes=len(token), budget=budget)
            return signed(fitted)
        self._log(
            "report_too_large",
            level=logging.WARNING,
            call_id=command.jti,
            report_bytes=len(token),
            budget=budget,
        )
        too_large = {
            "code": REPORT_TOO_LARGE,
            "message": (
                f"the call ran, but its result does not fit in a report of {budget} bytes "
                "(KESTREL_MAX_REPORT_BYTES) even when cut; nothing of it was kept"
            ),
        }
        return signed(None, outcome="failed", error=too_large)

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

    def _send_finished(self, command: Command, token: str) -> None:
        """Send the call's one finished report, then forget its content (callstate).

        A worker that stalled past its lease finds another's report already sent: it sends
        nothing. Should forgetting fail, the report expires with its own lifetime.
        """
        if is_reported(token):
            return
        self.report(token)
        try:
            self.state.mark_reported(command.jti, token)
        except redis.RedisError as error:
            self._log("infrastructure_error", level=logging.ERROR, error=type(error).__name__)

    def _log(self, event: str, *, level: int = logging.INFO, **fields: Any) -> None:
        record = {"event": event, "runner": self.config.runner_id, **fields}
        log.log(level, json.dumps(record, sort_keys=True, default=str))


def _utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
