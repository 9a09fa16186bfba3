"""Errors of the policy engine.

A rejected policy document names every problem at once, each at the exact path inside the
document (``capabilities.net.http.allow[2]``), so an administrator can fix a document in one
round trip instead of discovering its problems one by one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class PolicyIssue:
    """One problem in a policy document: where it is and what is wrong with it."""

    # Dotted path into the document; capability names keep their dots, so
    # ``capabilities.fs.write.paths[1]`` is capability ``fs.write``, field ``paths``, item 1.
    # The empty string means the document itself.
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path or '(document)'}: {self.message}"


class PolicyError(ValueError):
    """A policy document was rejected; ``issues`` lists every problem found."""

    def __init__(self, issues: Iterable[PolicyIssue]) -> None:
        self.issues: tuple[PolicyIssue, ...] = tuple(issues)
        super().__init__("; ".join(str(issue) for issue in self.issues))


class PolicyTooLarge(PolicyError):
    """A document, or one list in it, is larger than its cap (``policies.caps``).

    Raised at the first cap exceeded, before the oversized part is read any further.
    ``limit`` names the ``DocumentLimits`` field, ``maximum`` its value, ``actual`` what the
    document holds (bytes or items).
    """

    def __init__(self, path: str, *, limit: str, maximum: int, actual: int) -> None:
        self.path = path
        self.limit = limit
        self.maximum = maximum
        self.actual = actual
        unit = "bytes" if limit == "bytes" else "items"
        super().__init__([PolicyIssue(path, f"has {actual} {unit}; at most {maximum} are allowed")])
