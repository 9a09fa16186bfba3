"""Shared pieces of the runner tests: their Redis database and a runner's configuration."""

from __future__ import annotations

import os
from pathlib import Path

from runners.config import RunnerConfig

# The Redis database the runner tests use as broker and call state. It is flushed, so two
# suites on one machine need different ones (TEST_RUNNER_REDIS_URL).
RUNNER_REDIS_URL = os.environ.get("TEST_RUNNER_REDIS_URL", "redis://127.0.0.1:6379/14")


def runner_config(
    folder: Path,
    *,
    runner_id: str,
    pool: str,
    runner_key: bytes,
    control_public_key: bytes,
    workspace_root: Path,
) -> RunnerConfig:
    """A Docker runner's configuration on ``RUNNER_REDIS_URL``, its key files in ``folder``."""
    key_file = folder / "runner.pem"
    key_file.write_bytes(runner_key)
    key_file.chmod(0o600)
    control_file = folder / "control.pub"
    control_file.write_bytes(control_public_key)
    return RunnerConfig(
        runner_id=runner_id,
        pool=pool,
        key_file=key_file,
        control_public_key_file=control_file,
        broker_url=RUNNER_REDIS_URL,
        state_url=RUNNER_REDIS_URL,
        workspace_root=workspace_root,
        sandbox="docker",
        max_call_seconds=20,
    )
