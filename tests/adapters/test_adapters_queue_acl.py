"""A runner cannot reach the control tier's queue: its broker user may neither read the
calls waiting there nor push a task onto it (CRED-2, RUN-7)."""

from __future__ import annotations

import pytest
import redis

from kestrel_one.local.workers import local_runner_environment
from runners.config import RunnerConfig
from runners.contract.names import ADAPTERS_QUEUE


@pytest.mark.spec("CRED-2", "RUN-7")
def test_a_runners_broker_user_cannot_touch_the_adapters_queue(db, settings, tmp_path):
    settings.KESTREL_DATA_DIR = tmp_path
    env = local_runner_environment()
    runner = redis.Redis.from_url(RunnerConfig.from_environment(env).state_url)
    assert runner.execute_command("ACL", "WHOAMI") == env["KESTREL_RUNNER_ID"].encode()
    for attempt in (
        lambda: runner.llen(ADAPTERS_QUEUE),
        lambda: runner.lrange(ADAPTERS_QUEUE, 0, -1),
        lambda: runner.brpop([ADAPTERS_QUEUE], timeout=1),
        lambda: runner.lpush(ADAPTERS_QUEUE, "x"),
        lambda: runner.sadd(f"_kombu.binding.{ADAPTERS_QUEUE}", "x"),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
    runner.close()
