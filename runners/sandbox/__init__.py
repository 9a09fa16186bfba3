"""Sandbox backends and their selection: Docker, then bubblewrap, else fail closed."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from runners.sandbox.base import (
    ConfinedSandbox,
    ExecLimits,
    ExecResult,
    ExecSpec,
    ProbeResult,
    SandboxBackend,
    SandboxError,
    SandboxStartFailed,
    SandboxUnavailable,
    probe_with,
    run_confined,
)
from runners.sandbox.bubblewrap import BubblewrapBackend
from runners.sandbox.docker import DockerBackend
from runners.sandbox.warm import WarmDockerBackend

__all__ = [
    "BACKEND_FACTORIES",
    "BubblewrapBackend",
    "ConfinedSandbox",
    "DockerBackend",
    "ExecLimits",
    "ExecResult",
    "ExecSpec",
    "ProbeResult",
    "SandboxBackend",
    "SandboxError",
    "SandboxStartFailed",
    "SandboxUnavailable",
    "WarmDockerBackend",
    "probe_with",
    "run_confined",
    "select_backend",
]

# In order of preference. Each factory raises SandboxUnavailable saying why it can't serve.
BACKEND_FACTORIES: Mapping[str, Callable[[], SandboxBackend]] = {
    "docker": DockerBackend.from_environment,
    "bubblewrap": BubblewrapBackend.from_environment,
}


def select_backend(
    preference: str = "auto",
    *,
    factories: Mapping[str, Callable[[], SandboxBackend]] = BACKEND_FACTORIES,
) -> SandboxBackend:
    """The backend to run commands with.

    ``"auto"`` takes the first of ``factories`` that works; a named backend is that one or
    nothing (asking for Docker never quietly yields bubblewrap). With none working this
    raises ``SandboxUnavailable`` listing each backend's reason: there is no unsandboxed
    fallback.
    """
    if preference != "auto" and preference not in factories:
        raise SandboxUnavailable(
            f"unknown sandbox backend {preference!r}; choose one of: auto, {', '.join(factories)}"
        )
    names = list(factories) if preference == "auto" else [preference]
    reasons = []
    for name in names:
        try:
            return factories[name]()
        except SandboxUnavailable as error:
            reasons.append(str(error))
    raise SandboxUnavailable("no sandbox backend works, refusing to run: " + "; ".join(reasons))
