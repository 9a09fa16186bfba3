"""The single-host runner's environment: what it needs and its own tuning, nothing else."""

from __future__ import annotations

import pytest

from kestrel_one.local.workers import local_runner_environment

pytestmark = pytest.mark.spec("RUN-7")


def test_the_local_runner_gets_its_tuning_and_no_secret(db, settings, tmp_path, monkeypatch):
    settings.KESTREL_DATA_DIR = tmp_path
    monkeypatch.setenv("KESTREL_WARM_MAX_CONTAINERS", "4")
    monkeypatch.setenv("KESTREL_STARTED_REPORT_DELAY_SECONDS", "0")
    monkeypatch.setenv("DATABASE_URL", "postgres://kestrel:hunter2@db/kestrel")
    monkeypatch.setenv("DJANGO_SECRET_KEY", "not-for-the-runner")
    monkeypatch.delenv("KESTREL_WARM_IDLE_SECONDS", raising=False)

    env = local_runner_environment()

    assert env["KESTREL_WARM_MAX_CONTAINERS"] == "4"
    assert env["KESTREL_STARTED_REPORT_DELAY_SECONDS"] == "0"
    assert "KESTREL_WARM_IDLE_SECONDS" not in env  # unset stays unset: the runner's default
    assert "DATABASE_URL" not in env and "DJANGO_SECRET_KEY" not in env
    assert "hunter2" not in str(env)
    assert env["KESTREL_RUNNER_ID"].startswith("run_")
