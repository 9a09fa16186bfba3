"""Real worker processes for the end-to-end tests: a runner worker, and the control plane's
control and reports workers."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import redis
from django.conf import settings

from kestrel_one.accounts.principal import system_principal
from kestrel_one.execution.enrollment import runner_enroll
from kestrel_one.execution.keys import control_public_key_pem
from kestrel_one.execution.models import Runner
from kestrel_one.governance.services import policy_publish_environment
from kestrel_one.local.workers import (
    adapters_worker_argv,
    control_worker_argv,
    reports_worker_argv,
)
from kestrel_one.tenancy.services import environment_create, project_create
from kestrel_one.threads.models import Thread
from kestrel_one.threads.services import thread_create
from runners.contract.tokens import generate_private_key_pem, public_key_pem
from tests.support import stop, unmount_workspace_quotas

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def real_workers(
    base: Path, *, runner_id: str, database: dict, runner: bool = True
) -> Iterator[dict[str, Path]]:
    """A runner worker (pool ``default``, Docker sandbox), a control worker and a reports
    worker, all real Celery processes on the test broker, with their key files, workspaces
    and logs under ``base``. Yields ``key``, ``control``, ``workspaces`` and ``logs`` (the
    folder). With ``runner=False`` only the control plane's workers start: the test starts
    and stops its runners itself (``runner_worker``)."""
    files = {
        "key": base / "runner.key",
        "control": base / "control.pub",
        "workspaces": base / "workspaces",
        "logs": base,
    }
    files["key"].write_bytes(generate_private_key_pem())
    files["key"].chmod(0o600)
    files["control"].write_text(control_public_key_pem())
    files["workspaces"].mkdir()
    redis.Redis.from_url(settings.CELERY_BROKER_URL).delete("runner.default", "control", "reports")
    processes = [runner_worker(files, runner_id=runner_id)] if runner else []
    processes += [control_worker(base, database=database), reports_worker(base, database=database)]
    try:
        yield files
    finally:
        for process in processes:
            stop(process)
        unmount_workspace_quotas(files["workspaces"])  # a runner that had to be killed


def runner_worker(
    files: dict[str, Path], *, runner_id: str, log_name: str = "runner.log"
) -> subprocess.Popen:
    """A real runner worker (pool ``default``, Docker sandbox) with the key, control key and
    workspaces of ``files`` (as ``real_workers`` makes them), logging to ``log_name`` in
    ``files["logs"]``. Another one started on the same files is the same host restarted."""
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("KESTREL_", "DJANGO_"))}
    return subprocess.Popen(
        [sys.executable, "-m", "runners", "worker", "--concurrency", "2"],
        cwd=ROOT,
        env={
            **base_env,
            "KESTREL_RUNNER_ID": runner_id,
            "KESTREL_RUNNER_POOL": "default",
            "KESTREL_RUNNER_KEY_FILE": str(files["key"]),
            "KESTREL_CONTROL_PUBLIC_KEY_FILE": str(files["control"]),
            "KESTREL_BROKER_URL": settings.CELERY_BROKER_URL,
            "KESTREL_WORKSPACE_ROOT": str(files["workspaces"]),
            "KESTREL_SANDBOX": "docker",
            "KESTREL_MAX_CALL_SECONDS": "60",
        },
        stdout=(files["logs"] / log_name).open("w"),
        stderr=subprocess.STDOUT,
    )


def control_worker(
    base: Path,
    *,
    database: dict,
    argv: list[str] | None = None,
    log_name: str = "control.log",
    extra_env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """A real control worker (queue ``control``, or what ``argv`` says) on the test database,
    broker and data folder (the credentials key), logging to ``base / log_name``."""
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("KESTREL_", "DJANGO_"))}
    return subprocess.Popen(
        argv or control_worker_argv(concurrency=1),
        cwd=ROOT,
        env={
            **base_env,
            **(extra_env or {}),
            "DJANGO_SETTINGS_MODULE": "kestrel_one.settings_test",
            "TEST_DATABASE_URL": (
                f"postgres://{database['USER']}@{database['HOST']}:{database['PORT']}/"
                f"{database['NAME']}"
            ),
            "TEST_REDIS_URL": settings.CELERY_BROKER_URL,
            "KESTREL_DATA_DIR": str(settings.KESTREL_DATA_DIR),
        },
        stdout=(base / log_name).open("w"),
        stderr=subprocess.STDOUT,
    )


def reports_worker(base: Path, *, database: dict) -> subprocess.Popen:
    """The reports worker (queue ``reports``): what runners send, and nothing else; logs to
    ``base / "reports.log"``."""
    return control_worker(
        base, database=database, argv=reports_worker_argv(concurrency=1), log_name="reports.log"
    )


def adapters_worker(
    base: Path, *, database: dict, upstream_env: dict[str, str], concurrency: int = 1
) -> subprocess.Popen:
    """The control tier's adapter worker (queue ``adapters``), reaching the test upstream
    through the egress overrides in ``upstream_env``; logs to ``base / "adapters.log"``."""
    return control_worker(
        base,
        database=database,
        argv=adapters_worker_argv(concurrency=concurrency),
        log_name="adapters.log",
        extra_env=upstream_env,
    )


@contextlib.contextmanager
def real_workers_and_adapters(
    base: Path, *, runner_id: str, database: dict, upstream_env: dict[str, str]
) -> Iterator[dict[str, Path]]:
    """``real_workers`` plus the control tier's adapter worker reaching the test upstream."""
    with real_workers(base, runner_id=runner_id, database=database) as files:
        adapters = adapters_worker(base, database=database, upstream_env=upstream_env)
        try:
            yield files
        finally:
            stop(adapters)


def governed_thread(
    workers: dict[str, Path], organization, *, runner_id: str, policy: dict, name: str
) -> Thread:
    """A thread the real runner of ``workers`` serves: the runner enrolled (pool
    ``default``) under the id it runs as, and a new environment under ``policy`` with one
    project and one agent-mode thread, all named ``name``."""
    system = system_principal("tests")
    runner = runner_enroll(
        actor=system,
        pool="default",
        public_key_pem=public_key_pem(workers["key"].read_bytes()).decode(),
    )
    Runner.objects.filter(pk=runner.pk).update(public_id=runner_id)
    environment = environment_create(actor=system, organization=organization, name=name)
    policy_publish_environment(actor=system, environment=environment, document=policy)
    project = project_create(
        actor=system, organization=organization, environment=environment, name=name
    )
    return thread_create(actor=system, project=project, title=name, mode="agent")
