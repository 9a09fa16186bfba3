"""Measure ``policies.decide`` on a realistic effective policy against a dict-lookup baseline.

Run: ``.venv/bin/python bench/policy_decide.py``. Prints median and p95 nanoseconds per call
for decide and for a plain dict lookup measured in the same run, and their ratio, and writes
the figures to ``bench/results/policy_decide.json``. Target: decide median under 20 µs.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from policies import Mode, Policy, Request, apply_mode, decide, meet_all, parse_policy

ITERATIONS = 20_000
TARGET_MEDIAN_NS = 20_000
RESULTS = Path(__file__).resolve().parent / "results" / "policy_decide.json"

ENVIRONMENT = {
    "capabilities": {
        "fs.read": {"paths": ["**"]},
        "fs.write": {"paths": ["src/**", "tests/**", "docs/*", "out/**", "build/*/logs/**"]},
        "shell.exec": {
            "approval": "always",
            "commands": ["git", "make", "python", "pytest", "npm", "sh"],
            "limits": {
                "timeout_s": 120,
                "memory_mb": 1024,
                "cpus": 2,
                "pids": 256,
                "output_kb": 512,
            },
        },
        "code.exec": {"limits": {"timeout_s": 60}},
        "net.http": {
            "allow": [
                "https://api.github.com:443",
                "https://pypi.org:443",
                "https://files.pythonhosted.org:443",
                "https://registry.npmjs.org:443",
            ]
        },
        "model.invoke": {"models": ["claude-3", "gpt-4o"]},
        "mcp.call": {
            "servers": {
                "github": {
                    "tools": ["search_issues", "create_issue", "merge_pr"],
                    "dangerous": ["merge_pr"],
                },
                "jira": {"tools": ["search", "comment"]},
            }
        },
        "adapter.invoke": {"adapters": {"s3": {"operations": ["get", "list"]}}},
    }
}
PROJECT = {
    "capabilities": {
        **ENVIRONMENT["capabilities"],
        "fs.write": {"paths": ["src/**", "tests/**", "docs/*"]},
    }
}
# What a realistic turn asks for, allowed and denied mixed.
REQUESTS = [
    Request("fs.write", paths=("src/kestrel/app/models.py",)),
    Request("fs.write", paths=("etc/passwd",)),
    Request("fs.read", paths=("docs/index.md", "src/a.py")),
    Request("shell.exec", command="pytest", limits={"timeout_s": 60}),
    Request("net.http", url="https://api.github.com/repos/o/r/issues"),
    Request("net.http", url="https://evil.example/x"),
    Request("mcp.call", mcp_server="github", mcp_tool="merge_pr", mcp_dangerous=True),
    Request("model.invoke", model="claude-3"),
]


def effective_policy() -> Policy:
    """Environment ∩ Project ∩ surface ∩ mode ∩ token scope, as the control plane builds it."""
    environment, project = parse_policy(ENVIRONMENT), parse_policy(PROJECT)
    surface = Policy.allowing(environment.capabilities)
    token_scope = Policy.allowing(environment.capabilities - {"adapter.invoke"})
    return apply_mode(meet_all(environment, project, surface, token_scope), Mode.AGENT)


def measure(operation, iterations: int) -> list[int]:
    """Nanoseconds of each call, one sample per call (timer overhead included for both)."""
    samples = []
    clock = time.perf_counter_ns
    for index in range(iterations):
        started = clock()
        operation(index)
        samples.append(clock() - started)
    return samples


def summary(samples: list[int]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_ns": statistics.median(ordered),
        "p95_ns": ordered[int(len(ordered) * 0.95)],
        "mean_ns": statistics.fmean(ordered),
    }


def main() -> None:
    policy = effective_policy()
    table = {request.capability: request for request in REQUESTS}
    capabilities = [request.capability for request in REQUESTS]
    count = len(REQUESTS)

    def run_decide(index: int) -> None:
        decide(policy, REQUESTS[index % count], version="pol_bench")

    def run_lookup(index: int) -> None:
        table.get(capabilities[index % count])

    measure(run_decide, 2_000)  # warm caches and the interpreter's specialisation
    measure(run_lookup, 2_000)
    decide_stats = summary(measure(run_decide, ITERATIONS))
    lookup_stats = summary(measure(run_lookup, ITERATIONS))
    ratio = decide_stats["median_ns"] / lookup_stats["median_ns"]
    result = {
        "iterations": ITERATIONS,
        "requests": len(REQUESTS),
        "decide": decide_stats,
        "dict_lookup": lookup_stats,
        "median_ratio": ratio,
        "target_median_ns": TARGET_MEDIAN_NS,
        "meets_target": decide_stats["median_ns"] < TARGET_MEDIAN_NS,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    for label, stats in (("decide", decide_stats), ("dict lookup", lookup_stats)):
        median, p95 = stats["median_ns"] / 1000, stats["p95_ns"] / 1000
        print(f"{label:<12} median {median:8.2f} µs   p95 {p95:8.2f} µs")
    verdict = "met" if result["meets_target"] else "MISSED"
    print(f"ratio (median decide / median lookup): {ratio:.1f}x; target median < 20 µs: {verdict}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
