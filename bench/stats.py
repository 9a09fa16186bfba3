"""Figures as the bench reports them: median, p95 and the ratio to a baseline from the same run.

Every figure is compared with a baseline measured in the same run on the same machine,
because absolute numbers on a shared two-core box move with whatever else runs; the ratio
moves much less.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any


def percentile(samples: list[float], fraction: float) -> float:
    """The nearest-rank percentile (p95 of 20 samples is the 19th smallest)."""
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    rank = max(0, min(len(ordered) - 1, round(fraction * len(ordered) + 0.5) - 1))
    return ordered[rank]


@dataclass
class Figure:
    """One measured figure next to its baseline, with the target it is held to."""

    name: str
    unit: str
    median: float
    p95: float | None
    baseline_name: str
    baseline_median: float
    baseline_p95: float | None
    samples: int
    target: str
    # Ratio of the figure's median to the baseline's median (for rates: figure / baseline).
    ratio: float = field(init=False)
    met: bool | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.ratio = self.median / self.baseline_median if self.baseline_median else float("nan")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def timing_figure(
    name: str,
    samples_s: list[float],
    baseline_name: str,
    baseline_s: list[float],
    *,
    target: str,
    met: bool | None = None,
    **notes: Any,
) -> Figure:
    """A latency figure in milliseconds from samples in seconds."""
    return Figure(
        name=name,
        unit="ms",
        median=statistics.median(samples_s) * 1000,
        p95=percentile(samples_s, 0.95) * 1000,
        baseline_name=baseline_name,
        baseline_median=statistics.median(baseline_s) * 1000,
        baseline_p95=percentile(baseline_s, 0.95) * 1000,
        samples=len(samples_s),
        target=target,
        met=met,
        notes=notes,
    )


def format_table(figures: list[Figure]) -> str:
    """The stdout summary: one line per figure."""
    header = (
        f"{'figure':<34} {'median':>10} {'p95':>10} {'baseline':<26} {'b.median':>10} "
        f"{'ratio':>7}  target"
    )
    lines = [header, "-" * len(header)]
    for figure in figures:
        p95 = "" if figure.p95 is None else f"{figure.p95:.1f}"
        verdict = {True: "met", False: "MISSED", None: "(no target)"}[figure.met]
        lines.append(
            f"{figure.name:<34} {figure.median:>10.1f} {p95:>10} {figure.baseline_name:<26} "
            f"{figure.baseline_median:>10.1f} {figure.ratio:>6.2f}x  {figure.target} "
            f"[{verdict}] ({figure.unit})"
        )
    return "\n".join(lines)
