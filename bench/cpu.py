"""Where the CPU goes during a run: CPU seconds per kind of process, read from /proc.

A process's user and system time, plus what its reaped children used, counted by kind
(web, control worker, runner, PostgreSQL, Redis, Docker engine, ...). Short-lived processes
(runc, the command in the sandbox) are counted through the parent that reaps them
(containerd-shim). Dividing by the number of calls gives CPU milliseconds per call, which is
what decides throughput once every core is busy; unlike wall time it barely moves with
other load on the machine.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK")

# (kind, test on (comm, cmdline)); the first match wins.
_KINDS = (
    ("web (gunicorn)", lambda comm, cmd: "manage.py serve" in cmd or "gunicorn" in cmd),
    ("runner", lambda comm, cmd: "runners" in cmd and ("worker" in cmd or "celery" in cmd)),
    ("control worker", lambda comm, cmd: "celery" in cmd or "celeryd" in cmd),
    ("postgres", lambda comm, cmd: comm.startswith("postgres")),
    ("redis", lambda comm, cmd: comm.startswith("redis")),
    (
        "docker engine",
        lambda comm, cmd: (
            comm in ("dockerd", "containerd", "runc", "docker-init")
            or comm.startswith("containerd-shim")
        ),
    ),
)


def _kind(pid: str) -> str | None:
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    cmd = raw.replace(b"\0", b" ").decode(errors="replace")
    for name, test in _KINDS:
        if test(comm, cmd):
            return name
    return f"other: {comm}"


def snapshot() -> Counter[str]:
    """CPU seconds used so far by every live process (and its reaped children), by kind."""
    used: Counter[str] = Counter()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        kind = _kind(pid)
        if kind is None:
            continue
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # utime, stime, cutime, cstime (fields 14-17 of stat; 11-14 after the name)
        used[kind] += sum(int(value) for value in fields[11:15]) / _TICKS
    return used


def per_call(before: Counter[str], after: Counter[str], calls: int) -> dict[str, float]:
    """CPU milliseconds per call by kind, largest first, with the total; processes of no
    known kind are named by their command, and the ones under 1 ms per call are summed."""
    spent = {kind: after[kind] - before.get(kind, 0.0) for kind in after}
    spent = {kind: seconds for kind, seconds in spent.items() if seconds > 0}
    small = [
        kind
        for kind, seconds in spent.items()
        if kind.startswith("other: ") and seconds / max(calls, 1) < 0.001
    ]
    if small:
        spent["other (each under 1 ms)"] = sum(spent.pop(kind) for kind in small)
    result = {
        kind: round(seconds / max(calls, 1) * 1000, 1)
        for kind, seconds in sorted(spent.items(), key=lambda item: -item[1])
    }
    result["total"] = round(sum(spent.values()) / max(calls, 1) * 1000, 1)
    return result
