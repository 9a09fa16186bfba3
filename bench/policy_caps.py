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
    """The largest environment the caps allow and a project narrowing each of its lists.

    Every list is at its cap; MCP servers with many tools are added until one more would
    pass the bytes cap, so the document is as large as a PUT may be.
    """
    names = lambda stem, count: [f"{stem}{index}" for index in range(count)]  # noqa: E731
    environment: dict[str, Any] = {
        "fs.read": {"paths": _paths("src", CAPS.paths, narrow=False)},
        "fs.write": {"paths": _paths("out", CAPS.paths, narrow=False)},
        "shell.exec": {
            "commands": names("tool", CAPS.commands),
            "env": names("APP_SETTING_", CAPS.env),
        },
        "code.exec": {"limits": {"timeout_s": 60}},
        "net.http": {
            "allow": [f"https://host{index}.example.com:443" for index in range(CAPS.origins)]
        },
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
        servers[f"server{len(servers)}"] = {"tools": names("tool_", 200)}
        if len(json.dumps({"capabilities": environment}).encode()) > CAPS.bytes:
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


def cpu_samples(run: Callable[[], object], repeat: int) -> list[float]:
    """CPU seconds of each run: on a shared machine, wall time mostly measures the others."""
    samples = []
    for _ in range(repeat):
        started = time.thread_time()
        run()
        samples.append(time.thread_time() - started)
    return samples


def decide_samples(policy: Policy, requests: list[Request], iterations: int) -> list[int]:
    """Nanoseconds of each ``decide`` call, cycling through ``requests``."""
    samples = []
    clock = time.perf_counter_ns
    for index in range(iterations):
        request = requests[index % len(requests)]
        started = clock()
        decide(policy, request, version="pol_bench")
        samples.append(clock() - started)
    return samples


def path_patterns(policy: Policy) -> int:
    return sum(
        len(grant.paths)  # type: ignore[attr-defined]
        for name, grant in policy.grants.items()
        if name.startswith("fs.")
    )


def list_items(value: object) -> int:
    """Every item of every list in a JSON value (paths, names, tools, ...)."""
    if isinstance(value, dict):
        return sum(list_items(item) for item in value.values())
    if isinstance(value, list):
        return len(value) + sum(list_items(item) for item in value)
    return 0


def measure(quick: bool = False) -> dict[str, Any]:
    """Samples (seconds; nanoseconds for decide) of every operation, and the sizes."""
    environment_json, project_json = documents()
    repeat = 5 if quick else 30
    environment = parse_policy_json(environment_json)
    project = parse_policy_json(project_json)
    masks = [Policy.allowing(CAPABILITY_NAMES), mode_mask(Mode.AGENT)]
    effective = meet_all(environment, project, *masks)
    assert widenings(project, environment) == [], "the bench project must narrow"
    decide_samples(effective, REQUESTS, 2_000)  # warm the interpreter's specialisation
    return {
        "document_bytes": len(environment_json),
        "path_patterns": path_patterns(environment),
        "list_items": list_items(json.loads(environment_json)),
        "parse_s": cpu_samples(lambda: parse_policy_json(environment_json), repeat),
        "parse_project_s": cpu_samples(lambda: parse_policy_json(project_json), repeat),
        "widenings_s": cpu_samples(lambda: widenings(project, environment), repeat),
        "meet_s": cpu_samples(lambda: meet_all(environment, project, *masks), repeat),
        "decide_ns": decide_samples(effective, REQUESTS, 5_000 if quick else 20_000),
    }


def main() -> int:
    found = measure()
    patterns = found["path_patterns"]
    print(
        f"document: {found['document_bytes']} bytes, {patterns} path patterns, "
        f"{found['list_items']} list items in all"
    )
    for name in ("parse_s", "parse_project_s", "widenings_s", "meet_s"):
        median_ms = statistics.median(found[name]) * 1000
        print(
            f"{name[:-2]:>14}: {median_ms:7.2f} ms CPU  ({median_ms * 1000 / patterns:.1f} µs "
            f"per path pattern, {median_ms * 1000 / found['list_items']:.1f} µs per list item)"
        )
    decide_us = statistics.median(found["decide_ns"]) / 1000
    print(f"{'decide':>14}: {decide_us:7.2f} µs median")
    parse_ms = statistics.median(found["parse_s"]) * 1000
    met = parse_ms < TARGET_PARSE_MS and decide_us < TARGET_DECIDE_US
    print("targets met" if met else "TARGET MISSED")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
