"""The single-host runner's environment: what it needs and its own tuning, nothing else."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import redis

from kestrel_one.local.workers import local_runner_environment
from runners.config import RunnerConfig

pytestmark = pytest.mark.spec("RUN-7")


def test_the_local_runner_gets_its_tuning_and_no_secret(db, settings, tmp_path, monkeypatch):
    settings.KESTREL_DATA_DIR = tmp_path
    monkeypatch.setenv("KESTREL_WARM_MAX_CONTAINERS", "4")
    monkeypatch.setenv("KESTREL_STARTED_REPORT_DELAY_SECONDS", "0")
    monkeypatch.setenv("KESTREL_WORKSPACE_INVENTORY_SECONDS", "120")
    monkeypatch.setenv("DATABASE_URL", "postgres://kestrel:hunter2@db/kestrel")
    monkeypatch.setenv("DJANGO_SECRET_KEY", "not-for-the-runner")
    monkeypatch.delenv("KESTREL_WARM_IDLE_SECONDS", raising=False)

    env = local_runner_environment()

    assert env["KESTREL_WARM_MAX_CONTAINERS"] == "4"
    assert env["KESTREL_STARTED_REPORT_DELAY_SECONDS"] == "0"
    assert RunnerConfig.from_environment(env).workspace_inventory_s == 120
    assert "KESTREL_WARM_IDLE_SECONDS" not in env  # unset stays unset: the runner's default
    assert "DATABASE_URL" not in env and "DJANGO_SECRET_KEY" not in env
    assert "hunter2" not in str(env)
    assert env["KESTREL_RUNNER_ID"].startswith("run_")


@pytest.mark.spec("RUN-1")
def test_the_local_runner_logs_in_to_the_broker_as_its_own_user(db, settings, tmp_path):
    settings.KESTREL_DATA_DIR = tmp_path
    env = local_runner_environment()
    password_file = Path(env["KESTREL_BROKER_PASSWORD_FILE"])
    assert stat.S_IMODE(password_file.stat().st_mode) == 0o600
    assert "@" not in env["KESTREL_BROKER_URL"]  # never the control plane's credentials
    config = RunnerConfig.from_environment(env)
    own = redis.Redis.from_url(config.state_url)
    assert own.execute_command("ACL", "WHOAMI") == env["KESTREL_RUNNER_ID"].encode()
    with pytest.raises(redis.exceptions.NoPermissionError):
        own.llen("runner.some-other-pool")
    own.close()

    # A restarted broker has lost its users; the next start makes it again, same password.
    admin = redis.Redis.from_url(settings.REDIS_URL)
    admin.execute_command("ACL", "DELUSER", env["KESTREL_RUNNER_ID"])
    again = local_runner_environment()
    assert again["KESTREL_RUNNER_ID"] == env["KESTREL_RUNNER_ID"]
    assert redis.Redis.from_url(RunnerConfig.from_environment(again).state_url).ping()
