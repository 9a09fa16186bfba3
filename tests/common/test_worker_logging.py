"""A control worker's logs go through the same redaction as the web process's, through a
real Celery worker process: it is where credentials are decrypted (adapters, the model
gateway, webhook deliveries)."""

from __future__ import annotations

import json
import time

import pytest
from django.db import connection

from kestrel_one.celery import app
from kestrel_one.local.workers import control_worker_argv
from tests.common.test_redaction import GITHUB, PLANTED
from tests.execution.workers import control_worker
from tests.support import stop

QUEUE = "tests.worker-logging"


@pytest.mark.spec("AUD-2", "CRED-1")
def test_a_control_workers_log_lines_are_json_and_redacted(
    django_db_setup, django_db_blocker, tmp_path
):
    """Celery logs the whole body of a message whose task it does not know; a worker used to
    print it, and every other line, with Celery's own formatter, which skipped redaction.
    It now logs through ``settings.LOGGING``: JSON, the planted secrets masked, even in a
    field named ``token``."""
    with django_db_blocker.unblock():
        database = connection.settings_dict
    worker = control_worker(
        tmp_path, database=database, argv=control_worker_argv(concurrency=1, queues=(QUEUE,))
    )
    log = tmp_path / "control.log"
    try:
        app.send_task(
            "tests.no-such-task", args=[f"Bearer {PLANTED}"], kwargs={"token": GITHUB}, queue=QUEUE
        )
        for _ in range(300):  # bounded by attempts: 300 polls of 0.1 s
            if "unregistered task" in log.read_text():
                break
            time.sleep(0.1)
    finally:
        stop(worker)
    output = log.read_text()
    lines = [line for line in output.splitlines() if "unregistered task" in line]
    assert lines, f"the worker never logged the unknown message:\n{output[-3000:]}"
    assert PLANTED not in output and GITHUB not in output
    logged = json.loads(lines[0])
    assert logged["level"] == "error" and logged["logger"].startswith("celery")
    assert "tests.no-such-task" in logged["event"]
