"""The errors a runner reports for a call that could not run, each with a stable code.

The runner task turns these into a typed failure on the signed result, so every class
carries a machine-readable ``code`` beside its human message.
"""

from __future__ import annotations


class RunnerError(Exception):
    """A call that the runner refused or could not carry out."""

    code = "runner_error"


class UnknownTool(RunnerError, LookupError):
    """The tool name has no entry in the registry; unknown tools fail closed."""

    code = "unknown_tool"


class InvalidArguments(RunnerError, ValueError):
    """The arguments do not match the tool's schema; ``field`` names where (``args.path``)."""

    code = "invalid_arguments"

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class WorkspaceError(RunnerError):
    """A file operation in the workspace that could not be done; says which path and why."""

    code = "workspace_error"

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path!r}: {reason}")
        self.path = path
        self.reason = reason


class PathRefused(WorkspaceError):
    """The path is unsafe (absolute, ``..``, NUL, a symbolic link...) and was never opened."""

    code = "path_refused"
