"""Resource ceilings for shell.exec and code.exec.

A policy states a ceiling per limit; a request may ask for less, never more. A limit the
policy leaves out is the platform's default ceiling (``DEFAULT_LIMITS``), so every grant has
a complete, concrete set of ceilings and a meet can take the minimum of each. No document
may raise a ceiling above ``MAX_LIMITS``, the most any runner is built to enforce.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any

# The ceilings a grant gets for limits its document leaves out.
DEFAULT_LIMITS: Mapping[str, int] = MappingProxyType(
    {"timeout_s": 300, "memory_mb": 2048, "cpus": 2, "pids": 256, "output_kb": 1024}
)
# The highest ceiling a document may state for each limit.
MAX_LIMITS: Mapping[str, int] = MappingProxyType(
    {"timeout_s": 3600, "memory_mb": 65536, "cpus": 64, "pids": 4096, "output_kb": 65536}
)
# Limits that count whole things; the others (seconds, CPUs) may be fractional.
INTEGER_LIMITS = frozenset({"memory_mb", "pids", "output_kb"})
LIMIT_NAMES: tuple[str, ...] = tuple(DEFAULT_LIMITS)


def limit_value_problem(name: str, value: object) -> str | None:
    """Why ``value`` cannot be a ceiling (or a requested amount) for ``name``, or None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "must be a number"
    # An int is compared as an int: one with hundreds of digits has no float to become.
    if isinstance(value, float):
        if name in INTEGER_LIMITS and not value.is_integer():
            return "must be a whole number"
        if not math.isfinite(value):
            return "must be a positive number"
    if value <= 0:
        return "must be a positive number"
    if value > MAX_LIMITS[name]:
        return f"must be at most {MAX_LIMITS[name]}"
    return None


def canonical_number(value: float) -> int | float:
    """``60.0`` and ``60`` mean the same ceiling; give both the same document form."""
    if isinstance(value, int):
        return value
    return int(value) if value.is_integer() else value


@dataclass(frozen=True)
class Limits:
    """A complete set of ceilings, one per limit name."""

    timeout_s: float
    memory_mb: int
    cpus: float
    pids: int
    output_kb: int

    @classmethod
    def from_mapping(cls, values: Mapping[str, float]) -> Limits:
        """Ceilings from validated ``values``; names left out get ``DEFAULT_LIMITS``."""
        # Each value is already the number its field holds (validated, then canonical).
        ceilings: dict[str, Any] = {
            name: canonical_number(values.get(name, DEFAULT_LIMITS[name])) for name in LIMIT_NAMES
        }
        return cls(**ceilings)

    @classmethod
    def widest(cls) -> Limits:
        """The ceilings a full-width mask carries: a meet with them changes nothing."""
        return cls(**MAX_LIMITS)

    def as_dict(self) -> dict[str, int | float]:
        return {spec.name: canonical_number(getattr(self, spec.name)) for spec in fields(self)}

    def meet(self, other: Limits) -> Limits:
        return Limits(
            **{name: min(getattr(self, name), getattr(other, name)) for name in LIMIT_NAMES}
        )

    def exceeding(self, parent: Limits) -> list[str]:
        """Names of the limits whose ceiling here is above ``parent``'s."""
        return [name for name in LIMIT_NAMES if getattr(self, name) > getattr(parent, name)]
