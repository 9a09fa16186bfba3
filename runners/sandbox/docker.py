"""The Docker backend: each command in a fresh, hardened, network-less container (RUN-3).

One container per command, created from the tool image by id (so the image is pinned),
removed afterwards whatever happens. The hardening is all in ``container_options``; the
tests read it back with ``docker inspect`` rather than trusting this file.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import docker
import docker.errors
import docker.types
import requests.exceptions
from docker.utils.socket import STDERR, STDOUT, frames_iter

from runners.sandbox.base import (
    SANDBOX_ADAPTER_DIR,
    SANDBOX_TMP,
    SANDBOX_WORKSPACE,
    ExecResult,
    ExecSpec,
    OutputBuffer,
    SandboxBackend,
    SandboxStartFailed,
    SandboxUnavailable,
)
from runners.workspace import workspace_owner

DEFAULT_TOOL_IMAGE = "kestrel/tool-runtime:latest"
MANAGED_LABEL = "io.kestrel.managed"
LABEL_PREFIX = "io.kestrel."

_IMAGE_ID = re.compile(r"^sha256:[0-9a-f]{64}$")
# How long to wait for the engine to stop a killed container and for the output stream to
# end; generous, because a killed tree is torn down by the kernel, not by the command.
_KILL_GRACE_S = 30


class DockerBackend(SandboxBackend):
    """Runs commands with the Docker engine, through the Docker SDK."""

    name = "docker"

    def __init__(self, image_id: str, *, client: docker.DockerClient) -> None:
        if not _IMAGE_ID.fullmatch(image_id):
            raise ValueError(f"tool image must be pinned by id (sha256:...), got {image_id!r}")
        self.image_id = image_id
        self.client = client

    @classmethod
    def from_environment(cls, image: str = DEFAULT_TOOL_IMAGE) -> DockerBackend:
        """The backend for the local engine, pinned to the id ``image`` has right now."""
        try:
            client = docker.from_env()
            client.ping()
        except (docker.errors.DockerException, requests.exceptions.RequestException) as error:
            raise SandboxUnavailable(f"docker: no engine answers ({error})") from None
        try:
            image_id = client.images.get(image).id
        except docker.errors.ImageNotFound:
            raise SandboxUnavailable(
                f"docker: image {image} is missing; build it with "
                "deploy/images/tool-runtime/build.sh"
            ) from None
        return cls(image_id, client=client)

    def container_options(self, spec: ExecSpec) -> dict[str, Any]:
        """The ``containers.create`` arguments that confine ``spec``."""
        uid, gid = workspace_owner()
        limits = spec.limits
        labels = {f"{LABEL_PREFIX}{key}": str(value) for key, value in spec.labels.items()}
        labels[MANAGED_LABEL] = "true"
        mounts = [
            docker.types.Mount(
                target=SANDBOX_WORKSPACE,
                source=str(spec.workspace.resolve(strict=True)),
                type="bind",
                read_only=False,
            )
        ]
        if spec.adapter_dir is not None:
            # The call's adapter broker (runners.adapter_broker): a socket, read-only, so the
            # command can connect to it but neither replace it nor leave anything there. The
            # network stays "none": this socket is the command's only way out.
            mounts.append(
                docker.types.Mount(
                    target=SANDBOX_ADAPTER_DIR,
                    source=str(spec.adapter_dir),
                    type="bind",
                    read_only=True,
                )
            )
        return {
            "command": list(spec.argv),
            "user": f"{uid}:{gid}",
            "working_dir": spec.sandbox_cwd,
            "environment": spec.environment(),
            "labels": labels,
            "network_mode": "none",
            "read_only": True,
            "cap_drop": ["ALL"],
            "security_opt": ["no-new-privileges"],
            "privileged": False,
            "ipc_mode": "private",
            # docker-init as PID 1: it reaps orphans, and when the command ends or is killed
            # the whole PID namespace, background children included, goes with it.
            "init": True,
            "pids_limit": limits.pids,
            "mem_limit": f"{limits.memory_mb}m",
            "memswap_limit": f"{limits.memory_mb}m",
            "nano_cpus": int(limits.cpus * 1e9),
            "ulimits": [docker.types.Ulimit(name="core", soft=0, hard=0)],
            "tmpfs": {
                SANDBOX_TMP: f"rw,nosuid,nodev,noexec,size={limits.tmp_mb}m,mode=1777",
            },
            "mounts": mounts,
            # Output is streamed from an attach and capped here; the engine keeps no log.
            "log_config": docker.types.LogConfig(type="none"),
            "stdin_open": False,
            "tty": False,
        }

    def run(self, spec: ExecSpec) -> ExecResult:
        try:
            container = self.client.containers.create(self.image_id, **self.container_options(spec))
        except (docker.errors.DockerException, requests.exceptions.RequestException) as error:
            raise SandboxStartFailed(f"docker: cannot create the container: {error}") from None
        try:
            return self._run_container(container, spec)
        finally:
            try:
                container.remove(force=True)
            except docker.errors.NotFound:
                pass

    def _run_container(self, container: Any, spec: ExecSpec) -> ExecResult:
        limit = spec.limits.output_kb * 1024
        stdout, stderr = OutputBuffer(limit), OutputBuffer(limit)
        try:
            sock = self.client.api.attach_socket(
                container.id, params={"stdout": 1, "stderr": 1, "stream": 1}
            )
        except (docker.errors.DockerException, requests.exceptions.RequestException) as error:
            raise SandboxStartFailed(f"docker: cannot attach to the container: {error}") from None
        _without_timeout(sock)
        reader = threading.Thread(
            target=_demultiplex, args=(sock, stdout, stderr), name="docker-output", daemon=True
        )
        reader.start()
        try:
            started = time.monotonic()
            try:
                container.start()
            except (docker.errors.DockerException, requests.exceptions.RequestException) as error:
                raise SandboxStartFailed(f"docker: cannot start the container: {error}") from None
            timed_out = False
            try:
                status = container.wait(timeout=spec.limits.timeout_s)
            except (requests.exceptions.ReadTimeout, requests.exceptions.ConnectionError):
                timed_out = True
                # SIGKILL to PID 1 ends the PID namespace: every process of the command dies.
                container.kill()
                status = container.wait(timeout=_KILL_GRACE_S)
            duration_ms = int((time.monotonic() - started) * 1000)
            reader.join(_KILL_GRACE_S)
        finally:
            sock.close()
        container.reload()
        state = container.attrs["State"]
        return ExecResult(
            exit_code=int(status.get("StatusCode", state.get("ExitCode", -1))),
            stdout=stdout.text(),
            stderr=stderr.text(),
            truncated=stdout.truncated or stderr.truncated,
            duration_ms=duration_ms,
            timed_out=timed_out,
            oom_killed=bool(state.get("OOMKilled")),
            sandbox=self.name,
        )


def _without_timeout(sock: Any) -> None:
    """Let the attach stream wait as long as the command runs (the client's timeout is short).

    The SDK hands back the raw socket, sometimes wrapped (``_sock``); the wall clock is
    enforced by ``container.wait`` instead.
    """
    for candidate in (sock, getattr(sock, "_sock", None)):
        if candidate is not None and hasattr(candidate, "settimeout"):
            candidate.settimeout(None)


def _demultiplex(sock: Any, stdout: OutputBuffer, stderr: OutputBuffer) -> None:
    try:
        for stream, data in frames_iter(sock, tty=False):
            if stream == STDOUT:
                stdout.feed(data)
            elif stream == STDERR:
                stderr.feed(data)
    except OSError:
        # The socket is closed under us once the command is over; what was read stays.
        pass
