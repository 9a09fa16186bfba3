"""Runner configuration, Celery settings and the ``python -m runners`` command (RUN-7)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from runners.config import SANDBOX_CHOICES, RunnerConfig, RunnerConfigError
from runners.contract.tokens import (
    HEARTBEAT_SANDBOXES,
    generate_private_key_pem,
    load_public_key,
    public_key_pem,
)
from runners.sandbox import BACKEND_FACTORIES
from runners.worker import celery_settings

pytestmark = pytest.mark.spec("RUN-1", "RUN-7")

REPO = Path(__file__).resolve().parents[2]
REQUIRED = (
    "KESTREL_RUNNER_ID",
    "KESTREL_RUNNER_POOL",
    "KESTREL_RUNNER_KEY_FILE",
    "KESTREL_CONTROL_PUBLIC_KEY_FILE",
    "KESTREL_BROKER_URL",
    "KESTREL_WORKSPACE_ROOT",
)


@pytest.fixture
def environ(tmp_path: Path) -> dict[str, str]:
    key = tmp_path / "runner.pem"
    key.write_bytes(generate_private_key_pem())
    key.chmod(0o600)
    control = tmp_path / "control.pub"
    control.write_bytes(public_key_pem(generate_private_key_pem()))
    workspaces = tmp_path / "workspaces"
    workspaces.mkdir()
    return {
        "KESTREL_RUNNER_ID": "run_01JCONFIG",
        "KESTREL_RUNNER_POOL": "platform",
        "KESTREL_RUNNER_KEY_FILE": str(key),
        "KESTREL_CONTROL_PUBLIC_KEY_FILE": str(control),
        "KESTREL_BROKER_URL": "redis://127.0.0.1:6379/14",
        "KESTREL_WORKSPACE_ROOT": str(workspaces),
    }


def test_complete_environment_configures_a_runner(environ):
    config = RunnerConfig.from_environment(environ)
    assert config.queue == "runner.platform"
    assert config.state_url == environ["KESTREL_BROKER_URL"]
    assert config.sandbox == "auto"
    assert config.max_call_seconds == 600
    assert config.started_report_delay_s == 1.0
    assert config.max_report_bytes == 4 * 1024 * 1024
    assert config.workspace_quota_mb == 1024
    assert config.call_write_budget_bytes == 256 * 1024 * 1024
    assert config.read_max_file_bytes == 64 * 1024 * 1024


def test_the_bounds_are_read_from_the_environment(environ):
    environ.update(
        KESTREL_MAX_REPORT_BYTES="65536",
        KESTREL_WORKSPACE_QUOTA_MB="0",
        KESTREL_READ_MAX_FILE_BYTES="1000",
    )
    config = RunnerConfig.from_environment(environ)
    assert (config.max_report_bytes, config.workspace_quota_mb) == (65536, 0)
    assert config.read_max_file_bytes == 1000
    # The budget lives on the quota filesystem: without one there is none.
    assert config.call_write_budget_bytes == 0


@pytest.mark.parametrize(("value", "megabytes"), [("0", 0), ("16", 16), ("", 256)])
def test_the_call_write_budget_is_read_from_the_environment(environ, value, megabytes):
    environ["KESTREL_CALL_WRITE_BUDGET_MB"] = value
    config = RunnerConfig.from_environment(environ)
    assert config.call_write_budget_bytes == megabytes * 1024 * 1024


@pytest.mark.parametrize(("value", "delay"), [("0", 0.0), ("2.5", 2.5), (" ", 1.0)])
def test_started_report_delay_is_read_from_the_environment(environ, value, delay):
    environ["KESTREL_STARTED_REPORT_DELAY_SECONDS"] = value
    assert RunnerConfig.from_environment(environ).started_report_delay_s == delay


@pytest.mark.parametrize("name", REQUIRED)
def test_each_missing_variable_is_named(environ, name):
    del environ[name]
    with pytest.raises(RunnerConfigError, match=name):
        RunnerConfig.from_environment(environ)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660])
def test_key_readable_by_group_or_others_is_refused(environ, mode):
    Path(environ["KESTREL_RUNNER_KEY_FILE"]).chmod(mode)
    with pytest.raises(RunnerConfigError, match=r"KESTREL_RUNNER_KEY_FILE.*chmod 600"):
        RunnerConfig.from_environment(environ)


def test_key_files_must_hold_the_right_keys(environ):
    environ["KESTREL_CONTROL_PUBLIC_KEY_FILE"] = environ["KESTREL_RUNNER_KEY_FILE"]
    with pytest.raises(RunnerConfigError, match="KESTREL_CONTROL_PUBLIC_KEY_FILE"):
        RunnerConfig.from_environment(environ)


def test_state_needs_redis_when_the_broker_is_not(environ):
    environ["KESTREL_BROKER_URL"] = "sqla+sqlite:///broker.sqlite3"
    with pytest.raises(RunnerConfigError, match="KESTREL_RUNNER_STATE_URL"):
        RunnerConfig.from_environment(environ)
    environ["KESTREL_RUNNER_STATE_URL"] = "redis://127.0.0.1:6379/14"
    assert RunnerConfig.from_environment(environ).state_url == "redis://127.0.0.1:6379/14"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("KESTREL_SANDBOX", "none"),
        ("KESTREL_MAX_CALL_SECONDS", "0"),
        ("KESTREL_MAX_CALL_SECONDS", "ten"),
        ("KESTREL_MAX_CALL_SECONDS", "\u00b2"),
        ("KESTREL_STARTED_REPORT_DELAY_SECONDS", "-1"),
        ("KESTREL_STARTED_REPORT_DELAY_SECONDS", "soon"),
        ("KESTREL_STARTED_REPORT_DELAY_SECONDS", "nan"),
        ("KESTREL_RUNNER_ID", "runner-1"),
        ("KESTREL_RUNNER_POOL", "a/b"),
        ("KESTREL_MAX_REPORT_BYTES", "1000"),
        ("KESTREL_MAX_REPORT_BYTES", "big"),
        ("KESTREL_WORKSPACE_QUOTA_MB", "-1"),
        ("KESTREL_CALL_WRITE_BUDGET_MB", "-1"),
        ("KESTREL_CALL_WRITE_BUDGET_MB", "lots"),
        ("KESTREL_READ_MAX_FILE_BYTES", "0"),
    ],
)
def test_bad_values_are_refused_with_the_variable_named(environ, name, value):
    environ[name] = value
    with pytest.raises(RunnerConfigError, match=name):
        RunnerConfig.from_environment(environ)


def test_celery_is_set_for_no_loss(environ):
    environ["KESTREL_MAX_CALL_SECONDS"] = "20"
    settings = celery_settings(RunnerConfig.from_environment(environ))
    assert settings["task_acks_late"] is True
    assert settings["task_reject_on_worker_lost"] is True
    assert settings["worker_prefetch_multiplier"] == 1
    assert settings["task_default_queue"] == "runner.platform"
    assert settings["accept_content"] == ["json"]
    assert settings["task_serializer"] == "json"
    assert settings["result_backend"] is None
    assert settings["broker_transport_options"]["visibility_timeout"] == 80
    assert settings["task_time_limit"] < settings["broker_transport_options"]["visibility_timeout"]
    # The runner's settings name no database and no secret: only the broker.
    assert not any("database" in key or "secret" in key for key in settings)


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "runners", *args],
        cwd=REPO,
        env=env if env is not None else dict(os.environ),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_help_lists_the_commands():
    completed = run_cli("--help")
    assert completed.returncode == 0
    for command in ("worker", "keygen", "public-key"):
        assert command in completed.stdout


def test_keygen_writes_a_private_key_only_its_owner_can_read(tmp_path):
    out = tmp_path / "runner.pem"
    completed = run_cli("keygen", "--out", str(out))
    assert completed.returncode == 0, completed.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert completed.stdout == public_key_pem(out.read_bytes()).decode()
    assert load_public_key(completed.stdout.encode())
    assert "PRIVATE" not in completed.stdout

    again = run_cli("keygen", "--out", str(out))
    assert again.returncode == 1
    assert "refusing to overwrite" in again.stderr

    shown = run_cli("public-key", "--key", str(out))
    assert shown.stdout == completed.stdout


def test_worker_refuses_to_start_without_its_configuration(environ):
    env = {"PATH": os.environ["PATH"], **environ}
    del env["KESTREL_RUNNER_KEY_FILE"]
    completed = run_cli("worker", env=env)
    assert completed.returncode == 2
    assert "KESTREL_RUNNER_KEY_FILE" in completed.stderr


def test_runner_modules_import_without_the_control_plane():
    # kombu opportunistically imports django.utils (for lazy strings) when Django happens
    # to be installed; what must never load is the control plane, its settings or its ORM.
    code = (
        "import sys, runners.contract.tokens, runners.worker, runners.__main__\n"
        "loaded = [m for m in sys.modules if m.startswith(('kestrel_one', 'django.conf', "
        "'django.db', 'django.apps'))]\n"
        "assert not loaded, loaded\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    completed = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr


def test_the_sandbox_names_a_heartbeat_may_carry_are_the_backends_and_none():
    # The contract cannot import the backends; this keeps its list in step with them.
    assert frozenset({*BACKEND_FACTORIES, "none"}) == HEARTBEAT_SANDBOXES
    assert SANDBOX_CHOICES == ("auto", *BACKEND_FACTORIES)
