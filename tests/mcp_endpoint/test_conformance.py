"""The official MCP conformance suite (npm ``@modelcontextprotocol/conformance``, server
scenarios) against a real ``manage.py serve`` in single-host mode.

The suite connects from loopback without a token, so it is the local agent (API-3), on the
Project's MCP endpoint. ``conformance-baseline.yml`` lists the scenarios that do not apply
to Kestrel's endpoint, each with the reason; the suite's own exit code decides: every other
scenario must pass, and a listed scenario that starts passing fails the run too (the tests
below check that the suite really behaves so, in both directions).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import requests
import yaml

from tests.mcp_endpoint.serving import Stack, npm_tool, npx, stack_start

BASELINE = Path(__file__).with_name("conformance-baseline.yml")
SUITE_VERSION = "0.1.13"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    npm_tool("conformance")
    stack = stack_start(tmp_path_factory.mktemp("conformance-serve"), calls=False)
    try:
        yield stack
    finally:
        print(stack.serve.stop()[-6000:])


def conformance(stack: Stack, out: Path, *args: str):
    run = npx("conformance", "server", "--url", stack.endpoint(), "--output-dir", str(out), *args)
    print(run.stdout[-30000:], run.stderr[-5000:])
    return run


def baseline_entries() -> list[str]:
    return yaml.safe_load(BASELINE.read_text())["server"]


def test_the_installed_suite_is_the_pinned_version():
    version = npx("conformance", "--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == SUITE_VERSION
    lock = json.loads((Path(__file__).parents[2] / "package-lock.json").read_text())
    assert lock["packages"]["node_modules/@modelcontextprotocol/conformance"]["version"] == (
        SUITE_VERSION
    )


def test_the_baseline_names_only_scenarios_of_the_suite_each_with_its_reason():
    listed = npx("conformance", "list", "--server")
    assert listed.returncode == 0, listed.stderr
    scenarios = set(re.findall(r"^\s+- (\S+)$", listed.stdout, re.M))
    entries = baseline_entries()
    assert entries and len(entries) == len(set(entries)), entries
    assert set(entries) <= scenarios, set(entries) - scenarios
    # Every entry has its own comment: the line above it, or at the end of its line.
    lines = BASELINE.read_text().splitlines()
    for number, line in enumerate(lines):
        if re.match(r"^\s+- \S+", line):
            assert "#" in line or lines[number - 1].lstrip().startswith("#"), line


def test_the_endpoint_passes_every_scenario_of_the_active_suite_but_the_baseline(stack, tmp_path):
    run = conformance(stack, tmp_path, "--suite", "active", "--expected-failures", str(BASELINE))
    assert run.returncode == 0, run.stdout[-20000:] + run.stderr[-4000:]
    assert "Baseline check passed: all failures are expected." in run.stdout
    # Exit 0 with the baseline means: each listed scenario failed, every other one passed.
    expected = re.findall(r"^\s+~ (\S+)$", run.stdout, re.M)
    assert sorted(expected) == sorted(baseline_entries()), expected
    ran = int(re.search(r"Running active suite \((\d+) scenarios\)", run.stdout).group(1))
    passed = re.findall(r"^✓ (\S+): (\d+) passed, 0 failed$", run.stdout, re.M)
    assert len(passed) == ran - len(expected), run.stdout[-6000:]
    # The suite really talked to the endpoint: the tools it listed are the Project's.
    (listing,) = [
        json.loads(path.read_text()) for path in tmp_path.glob("server-tools-list-*/checks.json")
    ]
    (check,) = [c for c in listing if c["id"] == "tools-list"]
    assert check["status"] == "SUCCESS"
    listed = set(check["details"]["tools"])
    assert {"shell.exec", "fs.read", "fs.write", "kestrel.outcome"} <= listed, listed


def test_a_baseline_entry_that_passes_fails_the_run(stack, tmp_path):
    """The suite's baseline rule, checked rather than trusted: a listed scenario that
    passes is a stale entry, and the run exits 1."""
    alone = conformance(stack, tmp_path / "alone", "--scenario", "server-initialize")
    assert alone.returncode == 0, alone.stdout
    stale = tmp_path / "stale.yml"
    stale.write_text("server:\n  - server-initialize\n")
    listed = conformance(
        stack,
        tmp_path / "listed",
        "--scenario",
        "server-initialize",
        "--expected-failures",
        str(stale),
    )
    assert listed.returncode == 1, listed.stdout
    assert "Stale baseline entries (now passing - remove from baseline):" in listed.stdout
    assert re.search(r"^\s+✓ server-initialize$", listed.stdout, re.M), listed.stdout


def test_a_failure_missing_from_the_baseline_fails_the_run(stack, tmp_path):
    """And the other direction: a scenario of the baseline, run with an empty baseline,
    is an unexpected failure (exit 1), so the baseline is what lets the full run pass."""
    scenario = baseline_entries()[0]
    empty = tmp_path / "empty.yml"
    empty.write_text("server: []\n")
    run = conformance(
        stack, tmp_path / "run", "--scenario", scenario, "--expected-failures", str(empty)
    )
    assert run.returncode == 1, run.stdout
    assert "Unexpected failures (not in baseline):" in run.stdout
    assert re.search(rf"^\s+✗ {re.escape(scenario)}$", run.stdout, re.M), run.stdout


@pytest.mark.spec("API-3")
def test_the_suite_connects_from_loopback_without_a_token(stack):
    """The suite sends no token: in single-host mode a loopback caller without one is let
    in as the local agent (API-3), so the run above is against the endpoint as it is."""
    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-11-25",
            "capabilities": {},
            "clientInfo": {"name": "kestrel-tests", "version": "1"},
        },
    }
    headers = {"Accept": "application/json, text/event-stream"}
    answer = requests.post(stack.endpoint(), json=body, headers=headers, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["result"]["protocolVersion"] == "2025-11-25"
