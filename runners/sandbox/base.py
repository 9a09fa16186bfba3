"""The one interface every sandbox backend implements, and what runs through it.

A backend takes an ``ExecSpec`` (argv, workspace, confined cwd, environment overlay,
limits, labels) and returns an ``ExecResult``. There is deliberately no code path that runs
a command outside a backend: a backend that is missing, fails its probe or cannot start a
command raises, and the call fails closed (RUN-5).
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import os
import re
import secrets
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from runners.contract.errors import RunnerError, WorkspaceError
from runners.contract.paths import split_relative_path
from runners.workspace import Workspace

# Where the workspace and the per-command temporary directory appear inside every backend.
SANDBOX_WORKSPACE = "/workspace"
SANDBOX_TMP = "/tmp"  # noqa: S108 - a fresh, private tmpfs inside the sandbox
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
# The adapter broker's directory and socket (runners.adapter_broker), when a call has one.
SANDBOX_ADAPTER_DIR = "/run/kestrel-adapter"
SANDBOX_ADAPTER_SOCKET = f"{SANDBOX_ADAPTER_DIR}/adapter.sock"
ADAPTER_SOCKET_VARIABLE = "KESTREL_ADAPTER_SOCKET"


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_LABEL_KEY = re.compile(r"^[a-z][a-z0-9_.-]{0,62}$")
_LABEL_VALUE_MAX = 256


class SandboxError(RunnerError):
    """A command could not be run in a sandbox."""

    code = "sandbox_error"


class SandboxUnavailable(SandboxError):
    """No backend can confine the command (none installed, or its probe failed)."""

    code = "sandbox_unavailable"


class SandboxStartFailed(SandboxError):
    """The backend passed its probe but could not start this command; it is not retried."""

    code = "sandbox_start_failed"


@dataclass(frozen=True)
class ExecLimits:
    """Resource ceilings for one command. Docker enforces all of them; see each backend."""

    timeout_s: float = 60.0
    memory_mb: int = 512
    cpus: float = 1.0
    pids: int = 128
    output_kb: int = 256
    tmp_mb: int = 64

    def __post_init__(self) -> None:
        for name in ("timeout_s", "memory_mb", "cpus", "pids", "output_kb", "tmp_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"limit {name} must be a positive number, got {value!r}")
        if self.memory_mb < 8 or self.pids < 4:
            raise ValueError("memory_mb must be at least 8 and pids at least 4")

    def with_timeout(self, timeout_s: float | None) -> ExecLimits:
        """These limits with the timeout lowered to ``timeout_s`` (never raised)."""
        if timeout_s is None or timeout_s >= self.timeout_s:
            return self
        return dataclasses.replace(self, timeout_s=timeout_s)


@dataclass(frozen=True)
class ExecSpec:
    """One command to run: what, where in the workspace, with which environment and limits.

    ``env`` overlays the sandbox's environment; HOME, PATH and TMPDIR always keep the
    sandbox's values. ``labels`` (call id, project, thread...) mark the run for operators.
    ``adapter_dir`` is the host directory of the call's adapter broker socket
    (``runners.adapter_broker``): mounted read-only at ``SANDBOX_ADAPTER_DIR`` and named in
    ``KESTREL_ADAPTER_SOCKET``; None, no broker (nothing is mounted).
    """

    argv: tuple[str, ...]
    workspace: Path
    cwd: str = "."
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    limits: ExecLimits = field(default_factory=ExecLimits)
    labels: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    adapter_dir: Path | None = None

    def __post_init__(self) -> None:
        if self.adapter_dir is not None and not Path(self.adapter_dir).is_absolute():
            raise ValueError("adapter_dir must be an absolute path")
        if not self.argv or not all(
            isinstance(arg, str) and "\x00" not in arg for arg in self.argv
        ):
            raise ValueError("argv must be a non-empty sequence of strings without NUL")
        if not self.argv[0]:
            raise ValueError("argv[0] must name a program")
        split_relative_path(self.cwd)
        for name, value in self.env.items():
            if not _ENV_NAME.fullmatch(name) or not isinstance(value, str) or "\x00" in value:
                raise ValueError(f"invalid environment entry {name!r}")
        for key, value in self.labels.items():
            if not _LABEL_KEY.fullmatch(key) or len(str(value)) > _LABEL_VALUE_MAX:
                raise ValueError(f"invalid label {key!r}")
        object.__setattr__(self, "argv", tuple(self.argv))
        object.__setattr__(self, "workspace", Path(self.workspace))
        object.__setattr__(self, "env", MappingProxyType(dict(self.env)))
        object.__setattr__(self, "labels", MappingProxyType(dict(self.labels)))

    @property
    def sandbox_cwd(self) -> str:
        """The working directory as the command sees it."""
        return SANDBOX_WORKSPACE if self.cwd == "." else f"{SANDBOX_WORKSPACE}/{self.cwd}"

    def environment(self) -> dict[str, str]:
        """The command's full environment: the overlay, then the sandbox's fixed names."""
        fixed = {"HOME": SANDBOX_WORKSPACE, "PATH": SANDBOX_PATH, "TMPDIR": SANDBOX_TMP}
        if self.adapter_dir is not None:
            fixed[ADAPTER_SOCKET_VARIABLE] = SANDBOX_ADAPTER_SOCKET
        return {"LANG": "C.UTF-8", **self.env, **fixed}


@dataclass(frozen=True)
class ExecResult:
    """How a command ended and what it printed (each stream capped at ``output_kb``)."""

    exit_code: int
    stdout: str
    stderr: str
    truncated: bool
    duration_ms: int
    timed_out: bool
    oom_killed: bool
    sandbox: str


@dataclass(frozen=True)
class ProbeResult:
    """What the probe saw: the workspace is writable and its surroundings are not."""

    sandbox: str
    workspace_writable: bool
    sibling_writable: bool
    detail: str

    @property
    def ok(self) -> bool:
        return self.workspace_writable and not self.sibling_writable


class OutputBuffer:
    """Keeps the first ``limit`` bytes of a stream and notes whether more was dropped.

    The rest is still read (and discarded) so a chatty command never blocks on a full pipe.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.truncated = False
        self._chunks: list[bytes] = []
        self._size = 0

    def feed(self, chunk: bytes) -> None:
        room = self.limit - self._size
        if len(chunk) > room:
            self.truncated = True
            chunk = chunk[: max(room, 0)]
        if chunk:
            self._chunks.append(chunk)
            self._size += len(chunk)

    def text(self) -> str:
        return b"".join(self._chunks).decode("utf-8", errors="replace")


# Run by the backend itself: write the token into the workspace, then try to create a
# file beside the workspace (its parent, as the sandbox sees it). Exit 0 only when the
# first write worked and the second did not.
_PROBE_SCRIPT = """
printf '%s' "$1" > "$2" || exit 10
mkdir -p "$3" 2>/dev/null
if printf x > "$3/marker" 2>/dev/null; then exit 11; fi
exit 0
"""
_PROBE_LIMITS = ExecLimits(timeout_s=30, memory_mb=64, cpus=0.5, pids=16, output_kb=8, tmp_mb=1)


class SandboxBackend(abc.ABC):
    """A way to run one command confined to its workspace."""

    name: str

    @abc.abstractmethod
    def run(self, spec: ExecSpec) -> ExecResult:
        """Run ``spec`` to completion or timeout; raise ``SandboxStartFailed`` if it can't start."""

    def probe(self, workspace: Path) -> ProbeResult:
        """Check, through this backend, that a command can write in ``workspace`` only.

        Both sides are checked on the host, not taken from the command's word: the marker
        must appear in the workspace with the token, and nothing may appear in a sibling
        directory that the runner makes world-writable for the occasion, so that only the
        sandbox (not file permissions) can be what keeps the command out of it.
        """
        return probe_with(self.name, self.run, workspace)

    def run_probed(self, spec: ExecSpec) -> ExecResult:
        """Probe on the spec's workspace, then run it; see ``run_confined``.

        A backend that keeps sandboxes alive between commands overrides this to probe, right
        before each command, the very sandbox the command runs in (``runners.sandbox.warm``)
        rather than a throwaway one.
        """
        probe = self.probe(spec.workspace)
        if not probe.ok:
            raise SandboxUnavailable(f"{self.name} sandbox failed its probe: {probe.detail}")
        return self.run(spec)


class ProbeSite:
    """The host's side of one probe, whoever runs it in the sandbox (a command, or a warm
    container's agent): a random token that must pass through ``marker`` in the workspace
    (the sandbox writes it there, or finds it there and removes it: ``plant``), and an
    empty directory of that name beside the workspace, made world-writable for the
    occasion, in which nothing may appear. Use it as a context manager: both are removed
    afterwards.

    ``open_sibling=False`` leaves the directory out (making and removing one costs more
    than the rest of a warm call on some disks); the sandbox must then check beside the
    workspace itself, as a warm container's agent does (``plant``).
    """

    def __init__(self, workspace: Path, *, open_sibling: bool = True) -> None:
        self.workspace = Path(workspace)
        self.token = secrets.token_hex(16)
        self.marker = f".kestrel-probe-{self.token}"
        self.sibling = self.workspace.parent / self.marker
        self.open_sibling = open_sibling

    def __enter__(self) -> ProbeSite:
        if self.open_sibling:
            self.sibling.mkdir(mode=0o777)
            os.chmod(self.sibling, 0o777)  # noqa: S103 - deliberately open: see the docstring
        return self

    def __exit__(self, *exc_info: object) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.workspace / self.marker)
        if self.open_sibling:
            shutil.rmtree(self.sibling, ignore_errors=True)

    def result(self, sandbox: str, *, note: str) -> ProbeResult:
        """What the host sees after a probe that wrote the token into the marker."""
        try:
            written = Workspace(self.workspace).read(self.marker, max_bytes=64).data
        except WorkspaceError:
            written = b""
        return self._result(sandbox, written == self.token.encode(), False, note)

    def plant(self) -> None:
        """Write the token into the marker, for a sandbox that checks it there and removes
        it before its command (a warm container's agent): see ``planted_result``."""
        directory = os.open(self.workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
            fd = os.open(self.marker, flags, 0o644, dir_fd=directory)
            try:
                # Readable by the sandbox's user whatever the runner's umask (serve's is 077).
                os.fchmod(fd, 0o644)
                os.write(fd, self.token.encode())
            finally:
                os.close(fd)
        finally:
            os.close(directory)

    def planted_result(
        self, sandbox: str, failed: Mapping[str, Sequence[str]] | None = None
    ) -> ProbeResult:
        """After a sandbox checked the planted token: it must have found it and removed it,
        and nothing may be wrong beside the workspace, by its word (``failed``: what it
        found wrong in the workspace and beside it) and by the host's."""
        failed = failed or {}
        in_workspace = [str(reason) for reason in failed.get("workspace", ())]
        beside = [str(reason) for reason in failed.get("beside", ())]
        if os.path.lexists(self.workspace / self.marker):
            in_workspace.append("the token was not taken from it")
        note = "; ".join(
            f"{where}: {', '.join(reasons)}"
            for where, reasons in (("workspace", in_workspace), ("beside it", beside))
            if reasons
        )
        return self._result(sandbox, not in_workspace, bool(beside), note[:300] or "ok")

    def _result(
        self, sandbox: str, workspace_writable: bool, beside_writable: bool, note: str
    ) -> ProbeResult:
        sibling_writable = beside_writable or (self.open_sibling and any(self.sibling.iterdir()))
        detail = (
            f"workspace {'writable' if workspace_writable else 'NOT writable'}, "
            f"beside it {'WRITABLE' if sibling_writable else 'not writable'} ({note})"
        )
        return ProbeResult(sandbox, workspace_writable, sibling_writable, detail)


def probe_with(sandbox: str, run: Callable[[ExecSpec], ExecResult], workspace: Path) -> ProbeResult:
    """The probe of ``SandboxBackend.probe``, with ``run`` as the way to run the probe script.

    ``run`` is a backend's ``run`` for a fresh sandbox; the checks are on the host
    (``ProbeSite``). A warm container is probed by its agent instead
    (``runners.sandbox.warm``), with the same checks.
    """
    with ProbeSite(workspace) as site:
        spec = ExecSpec(
            argv=("sh", "-c", _PROBE_SCRIPT, "probe", site.token, site.marker, f"../{site.marker}"),
            workspace=site.workspace,
            limits=_PROBE_LIMITS,
            labels={"purpose": "probe"},
        )
        try:
            result = run(spec)
        except SandboxError as error:
            return ProbeResult(sandbox, False, False, f"probe command failed: {error}")
        return site.result(
            sandbox, note=f"probe exit {result.exit_code}: {result.stderr.strip()[:200]}"
        )


def run_confined(backend: SandboxBackend, spec: ExecSpec) -> ExecResult:
    """Probe ``backend`` on the spec's workspace, then run the spec in it.

    A failed probe raises ``SandboxUnavailable``. ``SandboxStartFailed`` from the run is
    passed on untouched: nothing here, or anywhere, runs the command another way.
    """
    return backend.run_probed(spec)


class ConfinedSandbox:
    """A call's sandbox as its tool sees it (``runners.contract.toolspec.Sandbox``).

    Binds the backend to the call's workspace, limits and labels; every ``run`` probes the
    backend first (``run_confined``). Without a backend it fails closed.
    """

    def __init__(
        self,
        backend: SandboxBackend | None,
        *,
        workspace: Path,
        limits: ExecLimits,
        labels: Mapping[str, str],
        adapter_dir: Path | None = None,
    ) -> None:
        self.backend = backend
        self.workspace = workspace
        self.limits = limits
        self.labels = labels
        self.adapter_dir = adapter_dir

    def run(
        self,
        argv: Sequence[str],
        *,
        cwd: str = ".",
        env: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> ExecResult:
        if self.backend is None:
            raise SandboxUnavailable("no sandbox backend was given; commands never run without one")
        spec = ExecSpec(
            argv=tuple(argv),
            workspace=self.workspace,
            cwd=cwd,
            env=dict(env or {}),
            limits=self.limits.with_timeout(timeout_s),
            labels=self.labels,
            adapter_dir=self.adapter_dir,
        )
        return run_confined(self.backend, spec)
