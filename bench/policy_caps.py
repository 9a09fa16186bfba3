"""Measure the policy engine on documents at the caps: parse, widenings, meet and decide.

Run: ``.venv/bin/python bench/policy_caps.py``. Builds the largest environment document the
default caps allow (``policies.DEFAULT_DOCUMENT_LIMITS``: every list at its cap, MCP servers
added until the bytes cap), and a project that narrows every one of its patterns, then
prints the median time to parse each (and per pattern), to check the project against the
environment (a project publish), to meet them with the masks (every request), and to
``decide`` on the result. Targets: parse under 50 ms, decide median under 20 µs.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from policies import (
    CAPABILITY_NAMES,
    DEFAULT_DOCUMENT_LIMITS,
    Mode,
    Policy,
    Request,
    decide,
    meet_all,
    mode_mask,
    parse_policy_json,
    widenings,
)

TARGET_PARSE_MS = 50.0
TARGET_DECIDE_US = 20.0
CAPS = DEFAULT_DOCUMENT_LIMITS


def _paths(prefix: str, count: int, narrow: bool) -> list[str]:
    # A mix of what real grants hold: directories, one level of '*', exact files.
    paths = []
    for index in range(count):
        kind = index % 3
        if kind == 0:
            paths.append(f"{prefix}/pkg{index}/{'lib/' if narrow else ''}**")
        elif kind == 1:
            paths.append(f"{prefix}/*/mod{index}/{'src/' if narrow else ''}**")
        else:
            paths.append(f"{prefix}/files/f{index}.{'txt' if narrow else 'md'}")
    if narrow:
        paths = [path.replace(".txt", ".md") for path in paths]
    return paths


def documents() -> tuple[bytes, bytes]:
    """The environment at the caps and a project narrowing each of its lists."""
    names = lambda stem, count: [f"{stem}{index}" for index in range(count)]  # noqa: E731
    environment: dict[str, Any] = {
        "fs.read": {"paths": _paths("src", CAPS.paths, narrow=False)},
        "fs.write": {"paths": _paths("out", CAPS.paths, narrow=False)},
        "shell.exec": {
            "commands": names("tool", CAPS.commands),
            "env": names("APP_SETTING_", CAPS.env),
        },
        "code.exec": {"limits": {"timeout_s": 60}},
        "net.http": {"allow": [f"https://host{index}.example.com:443" for index in range(64)]},
        "model.invoke": {"models": names("model-", CAPS.models)},
        "adapter.invoke": {
            "adapters": {
                f"ad{index}": {"operations": names("op", 8)} for index in range(CAPS.adapters)
            }
        },
        "mcp.call": {"servers": {}},
    }
    servers = environment["mcp.call"]["servers"]
    while len(servers) < CAPS.servers:
        servers[f"server{len(servers)}"] = {"tools": names("tool_", 24)}
        if len(json.dumps({"capabilities": environment})) > CAPS.bytes:
            servers.popitem()
            break
    project = json.loads(json.dumps(environment))
    project["fs.read"]["paths"] = _paths("src", CAPS.paths, narrow=True)
    project["fs.write"]["paths"] = _paths("out", CAPS.paths, narrow=True)
    return (
        json.dumps({"capabilities": environment}).encode(),
        json.dumps({"capabilities": project}).encode(),
    )


REQUESTS = [
    Request("fs.read", paths=("src/pkg99/lib/a/b/c.py",)),
    Request("fs.read", paths=("src/x/mod250/src/deep/file.py",)),
    Request("fs.write", paths=("out/files/f8.md",)),
    Request("fs.write", paths=("etc/passwd",)),
    Request("shell.exec", command="tool7", env_names=("APP_SETTING_3", "LANG")),
    Request("shell.exec", command="tool7", env_names=("LD_PRELOAD",)),
    Request("net.http", url="https://host12.example.com/x"),
    Request("mcp.call", mcp_server="server3", mcp_tool="tool_5"),
]


def _median_ms(run: Callable[[], object], repeat: int) -> float:
    """Median CPU time of ``run``: on a shared machine, wall time mostly measures the others."""
    samples = []
    for _ in range(repeat):
        started = time.thread_time()
        run()
        samples.append(time.thread_time() - started)
    return statistics.median(samples) * 1000


def figures(quick: bool = False) -> dict[str, Any]:
    """The figures, as a dict (``bench/run.py`` turns them into table rows)."""
    environment_json, project_json = documents()
    repeat = 5 if quick else 20
    environment = parse_policy_json(environment_json)
    project = parse_policy_json(project_json)
    patterns = sum(
        len(grant.paths)  # type: ignore[attr-defined]
        for name, grant in environment.grants.items()
        if name.startswith("fs.")
    )
    masks = [Policy.allowing(CAPABILITY_NAMES), mode_mask(Mode.AGENT)]
    effective = meet_all(environment, project, *masks)
    parse_ms = _median_ms(lambda: parse_policy_json(environment_json), repeat)
    decide_ns = []
    iterations = 5_000 if quick else 20_000
    for index in range(iterations):
        request = REQUESTS[index % len(REQUESTS)]
        started = time.perf_counter_ns()
        decide(effective, request, version="pol_bench")
        decide_ns.append(time.perf_counter_ns() - started)
    result = {
        "document_bytes": len(environment_json),
        "path_patterns": patterns,
        "parse_ms": parse_ms,
        "parse_us_per_pattern": parse_ms * 1000 / patterns,
        "parse_project_ms": _median_ms(lambda: parse_policy_json(project_json), repeat),
        "widenings_ms": _median_ms(lambda: widenings(project, environment), repeat),
        "meet_ms": _median_ms(lambda: meet_all(environment, project, *masks), repeat),
        "decide_median_us": statistics.median(decide_ns) / 1000,
        "decide_p95_us": sorted(decide_ns)[int(len(decide_ns) * 0.95)] / 1000,
    }
    result["meet_us_per_pattern"] = result["meet_ms"] * 1000 / patterns
    assert widenings(project, environment) == [], "the bench project must narrow"
    return result


def main() -> int:
    found = figures()
    for name, value in found.items():
        print(f"{name:>24}: {value:,.2f}" if isinstance(value, float) else f"{name:>24}: {value}")
    met = found["parse_ms"] < TARGET_PARSE_MS and found["decide_median_us"] < TARGET_DECIDE_US
    print("targets met" if met else "TARGET MISSED")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
