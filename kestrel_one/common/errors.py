"""Domain errors that services raise; the API renders each as a stable JSON error code."""

from __future__ import annotations

from typing import Any

# A caller's own value echoed in a message is cut here: enough to recognise it.
ECHO_MAX_CHARS = 64


def echo(value: Any) -> str:
    """``value`` as text for an error message, bounded (it came from the caller)."""
    text = str(value)
    return text if len(text) <= ECHO_MAX_CHARS else text[:ECHO_MAX_CHARS] + "..."


class KestrelError(Exception):
    code = "error"
    status = 400

    def __init__(self, message: str, *, details: Any = None):
        super().__init__(message)
        self.message = message
        self.details = details


class ValidationFailed(KestrelError):
    code = "invalid"
    status = 400


class PermissionDenied(KestrelError):
    code = "permission_denied"
    status = 403


class CheckNotBound(PermissionDenied):
    """A verification names a check the calling token is not bound to."""

    code = "check_not_bound"


class NotFound(KestrelError):
    code = "not_found"
    status = 404


class Conflict(KestrelError):
    code = "conflict"
    status = 409


class Unavailable(KestrelError):
    code = "unavailable"
    status = 503


class ThreadEnded(Conflict):
    """The thread has ended: it takes no new action, plan or approval."""

    code = "thread_ended"
