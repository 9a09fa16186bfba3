"""A runner's finished report always fits its size budget (KESTREL_MAX_REPORT_BYTES), so a
call that ran always gets a report the control plane takes (runners.report_budget).

In process, on real call state and real workspaces, like ``test_worker_calls.py``; the
whole path through real workers and Docker is ``tests/execution/test_runner_bounds_e2e.py``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import pytest
import redis

from runners.contract.tokens import generate_private_key_pem, public_key_pem, verify_result
from runners.report_budget import fit_result
from runners.workspace import workspace_for
from tests.runners.support import runner_config
from tests.runners.test_protocol import CONTROL_PUBLIC, POOL
from tests.runners.test_worker_calls import PROJECT, RUNNER_ID, Recorder, command, make_runner

pytestmark = pytest.mark.spec("RUN-9", "AUD-3")

BUDGET = 64 * 1024


@pytest.fixture
def runner_key() -> bytes:
    return generate_private_key_pem()


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def config(tmp_path: Path, workspace_root: Path, runner_key: bytes):
    configured = runner_config(
        tmp_path,
        runner_id=RUNNER_ID,
        pool=POOL,
        runner_key=runner_key,
        control_public_key=CONTROL_PUBLIC,
        workspace_root=workspace_root,
    )
    return dataclasses.replace(configured, max_report_bytes=BUDGET)


@pytest.fixture
def budgeted(config, runner_redis: redis.Redis, recorder: Recorder):
    return make_runner(config, runner_redis, recorder)


def reports(recorder: Recorder, runner_key: bytes):
    public = public_key_pem(runner_key)
    return [
        verify_result(token, runner_public_key=public, runner_id=RUNNER_ID)
        for token in recorder.reports
    ]


def test_a_read_whose_report_would_be_too_large_is_cut_to_fit_and_says_so(
    budgeted, config, recorder, runner_key
):
    """1 MiB of NUL bytes is 6 MiB of JSON: the content is cut to fit, flagged, and the
    full content's size and SHA-256 are kept."""
    zeros = b"\0" * (1024 * 1024)
    (workspace_for(config.workspace_root, PROJECT) / "zeros.bin").write_bytes(zeros)
    budgeted.handle(command(tool="fs.read", args={"path": "zeros.bin"}))

    (token,) = recorder.reports
    assert len(token) <= BUDGET
    (finished,) = reports(recorder, runner_key)
    assert finished.outcome == "succeeded"
    result = finished.result
    assert result["truncated"] is True
    assert result["size"] == len(zeros)
    assert result["sha256"] == hashlib.sha256(zeros).hexdigest()
    cut = result["report_cut"]["content"]
    assert cut["bytes"] == len(zeros)
    assert cut["sha256"] == hashlib.sha256(zeros).hexdigest()
    assert 0 < cut["kept_bytes"] == len(result["content"].encode()) < len(zeros)
    assert set(result["content"]) == {"\0"}
    # As much as fits is kept: most of the budget, not a token amount.
    assert len(token) > BUDGET * 3 // 4


def test_a_result_that_cannot_be_cut_enough_is_reported_as_failed_saying_why(
    budgeted, config, recorder, runner_key
):
    """A checkpoint archive cannot be cut; the call still gets a report, failed with
    ``report_too_large``, within the budget."""
    workspace = workspace_for(config.workspace_root, PROJECT)
    (workspace / "noise.bin").write_bytes(os.urandom(200 * 1024))
    budgeted.handle(command(tool="workspace.checkpoint", args={}))

    (token,) = recorder.reports
    assert len(token) <= BUDGET
    (finished,) = reports(recorder, runner_key)
    assert (finished.outcome, finished.result) == ("failed", None)
    assert finished.error["code"] == "report_too_large"
    assert "KESTREL_MAX_REPORT_BYTES" in finished.error["message"]


def test_streams_are_cut_from_the_longest_so_a_short_one_survives():
    """Cutting takes from the longest text first: a short stderr beside a flood on stdout is
    kept whole."""
    result = {"stdout": "a" * 100_000, "stderr": "short error", "exit_code": 1}
    fitted = fit_result(result, lambda candidate: len(json.dumps(candidate)), 20_000)
    assert fitted is not None
    assert fitted["stderr"] == "short error"
    assert fitted["stdout"] == "a" * len(fitted["stdout"])
    assert 15_000 < len(fitted["stdout"]) < 20_000
    assert fitted["report_cut"]["stdout"]["bytes"] == 100_000
    assert "stderr" not in fitted["report_cut"]
    assert result["stdout"] == "a" * 100_000  # the caller's result is left as it was
