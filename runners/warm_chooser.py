"""Which sandbox backend a worker process uses: one Docker backend, kept warm.

``WarmBackendChooser`` is ``Runner.choose_backend`` in a worker process; its warm settings
come from the environment, with the defaults of ``runners.sandbox.warm``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import docker
import docker.errors
import requests.exceptions

from runners.config import env_seconds, env_whole_number
from runners.sandbox import (
    DockerBackend,
    SandboxBackend,
    WarmDockerBackend,
    select_backend,
)
from runners.sandbox.warm import DEFAULT_IDLE_SECONDS, DEFAULT_MAX_CONTAINERS
from runners.sandbox.warm_host import (
    remove_idle_project_containers,
    remove_idle_thread_containers,
)

# Warm sandboxes (runners.sandbox.warm): on unless KESTREL_WARM_SANDBOXES=0. The idle time
# and the per-host cap are read here rather than in RunnerConfig because they tune a cache,
# not the runner's identity or authority.
WARM_ENABLED_VARIABLE = "KESTREL_WARM_SANDBOXES"
WARM_IDLE_VARIABLE = "KESTREL_WARM_IDLE_SECONDS"
WARM_MAX_VARIABLE = "KESTREL_WARM_MAX_CONTAINERS"
# How often a worker process removes its idle warm containers when no call comes.
WARM_SWEEP_SECONDS = 30

log = logging.getLogger("kestrel.runner")


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
        idle = env_seconds(environ, WARM_IDLE_VARIABLE, DEFAULT_IDLE_SECONDS, above_zero=True)
        cap = env_whole_number(
            environ,
            WARM_MAX_VARIABLE,
            DEFAULT_MAX_CONTAINERS,
            hint=" (KESTREL_WARM_SANDBOXES=0 turns them off)",
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
        return self._end(
            f"thread {thread}",
            lambda client: remove_idle_thread_containers(
                client, project=project, thread=thread, runner_id=runner_id
            ),
            lambda backend: backend.end_thread(project, thread),
        )

    def end_project(self, project: str, *, runner_id: str) -> int:
        """The project was deleted: remove the idle warm containers of all its threads of
        every worker process of this runner (they mount its workspace), and drop them from
        this process's pool; how many went on the engine."""
        return self._end(
            f"project {project}",
            lambda client: remove_idle_project_containers(
                client, project=project, runner_id=runner_id
            ),
            lambda backend: backend.end_project(project),
        )

    def _end(
        self,
        what: str,
        remove_idle: Callable[[Any], int],
        drop: Callable[[WarmDockerBackend], object],
    ) -> int:
        backend = self.backend
        try:
            client = backend.client if backend is not None else docker.from_env()
        except docker.errors.DockerException as error:
            log.warning("cannot reach the engine to end %s: %s", what, error)
            return 0
        try:
            removed = remove_idle(client)
        except (docker.errors.DockerException, requests.exceptions.RequestException) as error:
            log.warning("could not remove the warm containers of %s: %s", what, error)
            removed = 0
        finally:
            if backend is None:
                client.close()
        if backend is not None:
            # After the engine pass, so its count includes this process's idle container;
            # removing it again here is a no-op, a busy one goes at check-in.
            drop(backend)
        return removed
