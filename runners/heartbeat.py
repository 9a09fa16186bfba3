"""A runner's heartbeat: a signed notice to the control plane that it is up, and with which
sandbox backend.

The worker's main process sends one when the worker is ready and then every
``HEARTBEAT_INTERVAL_SECONDS``, by the same route as its reports (task
``control.runner_heartbeat`` on queue ``reports``), signed with the runner's own key. The
control plane verifies it against the enrolled key and records the backend and the time on
the runner's row, which is what ``GET /api/v1/health`` and the runner list show. It works the
same on one host and on many: only the broker carries it.

The backend is what ``select_backend`` would choose for a process tool, confirmed once by the
real probe (RUN-5: the command can write in a workspace and not beside it) whenever the
choice changes; a backend whose probe fails is reported as ``"none"``. Calls still probe for
themselves: the heartbeat is what people and the health check see, never a permission.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path

from runners.config import RunnerConfig
from runners.contract.tokens import (
    HEARTBEAT_INTERVAL_SECONDS,
    HEARTBEAT_LIFETIME_SECONDS,
    sign_heartbeat,
)
from runners.sandbox import SandboxBackend, SandboxUnavailable, select_backend
from runners.workspace import workspace_for

__all__ = ["HEARTBEAT_INTERVAL_SECONDS", "SandboxWatch", "start_heartbeats"]

# The probe's own workspace; not a project id (those start with prj_), so no project has it.
PROBE_WORKSPACE = "kestrel-heartbeat-probe"

log = logging.getLogger("kestrel.runner")


class SandboxWatch:
    """Which backend process tools would get now: chosen every time, probed on a change.

    ``detail`` says why after each ``current()``: the probe passed, or why there is none.
    """

    def __init__(
        self,
        preference: str,
        workspace_root: Path,
        *,
        choose: Callable[[str], SandboxBackend] = select_backend,
    ) -> None:
        self.preference = preference
        self.workspace_root = workspace_root
        self.choose = choose
        self.detail = ""
        self.backend: SandboxBackend | None = None
        self._probed: str | None = None

    def current(self) -> str:
        try:
            backend = self.choose(self.preference)
        except SandboxUnavailable as error:
            return self._none(str(error))
        if backend.name != self._probed:
            try:
                probe = backend.probe(workspace_for(self.workspace_root, PROBE_WORKSPACE))
            except Exception as error:  # a probe that cannot even run is a failed probe
                return self._none(f"{backend.name}: the probe could not run: {error}")
            if not probe.ok:
                return self._none(f"{backend.name} sandbox failed its probe: {probe.detail}")
            self._probed = backend.name
            self.detail = "probe passed"
            log.info(json.dumps({"event": "sandbox_ready", "sandbox": backend.name}))
        self.backend = backend
        return backend.name

    def _none(self, detail: str) -> str:
        if self._probed is not None or detail != self.detail:
            log.warning(json.dumps({"event": "sandbox_unavailable", "detail": detail[:500]}))
        self._probed = None
        self.backend = None
        self.detail = detail
        return "none"


def heartbeat_token(config: RunnerConfig, sandbox: str) -> str:
    return sign_heartbeat(
        pool=config.pool,
        sandbox=sandbox,
        private_key_pem=config.private_key(),
        runner_id=config.runner_id,
    )


def start_heartbeats(
    config: RunnerConfig,
    send: Callable[[str], None],
    *,
    interval: float = HEARTBEAT_INTERVAL_SECONDS,
) -> threading.Event:
    """Beat from a daemon thread until the returned event is set."""
    stop = threading.Event()
    watch = SandboxWatch(config.sandbox, config.workspace_root)

    def beat() -> None:
        while True:
            try:
                send(heartbeat_token(config, watch.current()))
            except Exception as error:  # a missed beat is retried at the next one
                log.warning(json.dumps({"event": "heartbeat_not_sent", "error": str(error)[:300]}))
            if stop.wait(interval):
                return

    threading.Thread(target=beat, name="runner-heartbeat", daemon=True).start()
    return stop


# How long a heartbeat message may wait in the queue before it is worth nothing.
HEARTBEAT_EXPIRES_SECONDS = HEARTBEAT_LIFETIME_SECONDS
