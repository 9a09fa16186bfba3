"""Settings from the environment: hosted mode names what is missing and passes check --deploy."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOSTED = {
    "KESTREL_MODE": "hosted",
    "DATABASE_URL": "postgres://postgres@127.0.0.1:5432/postgres",
    "REDIS_URL": "redis://127.0.0.1:6379/15",
    "DJANGO_SECRET_KEY": "x" * 20 + "-not-a-real-secret-but-long-enough-for-the-check-" + "y" * 20,
    "KESTREL_ALLOWED_HOSTS": "kestrel.example.com",
    "KESTREL_SIGNING_KEY_FILE": "/etc/kestrel/signing.pem",
    "KESTREL_CREDENTIALS_KEY_FILE": "/etc/kestrel/credentials.key",
}


def run_manage(extra: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in HOSTED and not k.startswith("KESTREL_")}
    env.update(
        extra,
        DJANGO_SETTINGS_MODULE="kestrel_one.settings",
        KESTREL_DATA_DIR="/tmp/kestrel-settings-test",
    )
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_hosted_mode_names_every_missing_variable():
    result = run_manage(
        {"KESTREL_MODE": "hosted", "REDIS_URL": "redis://127.0.0.1:6379/0"}, "check"
    )
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr
    for name in ("DATABASE_URL", "DJANGO_SECRET_KEY", "KESTREL_ALLOWED_HOSTS"):
        assert name in result.stderr
    assert "REDIS_URL," not in result.stderr


def test_unknown_mode_is_refused():
    result = run_manage({"KESTREL_MODE": "cluster"}, "check")
    assert result.returncode != 0 and "KESTREL_MODE" in result.stderr


def test_hosted_check_deploy_shows_no_warning():
    result = run_manage(HOSTED, "check", "--deploy", "--fail-level", "WARNING")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def test_migrations_are_committed():
    result = run_manage({}, "makemigrations", "--check", "--dry-run")
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_refusal_allowance_below_one_is_refused():
    result = run_manage({"KESTREL_AUDIT_REFUSALS_PER_MINUTE": "0"}, "check")
    assert result.returncode != 0
    assert "KESTREL_AUDIT_REFUSALS_PER_MINUTE must be at least 1" in result.stderr


def test_a_login_limit_or_lockout_below_one_is_refused():
    for name in ("KESTREL_LOGIN_FAILURE_LIMIT", "KESTREL_LOGIN_LOCKOUT_MINUTES"):
        result = run_manage({name: "0"}, "check")
        assert result.returncode != 0
        assert "KESTREL_LOGIN_LOCKOUT_MINUTES must be at least 1" in result.stderr


def test_hosted_mode_refuses_runners_without_broker_users_of_their_own():
    result = run_manage({**HOSTED, "KESTREL_RUNNER_BROKER_USERS": "false"}, "check")
    assert result.returncode != 0
    assert "KESTREL_RUNNER_BROKER_USERS=0 is refused in hosted mode" in result.stderr
    # A single host may share the control plane's broker access (a Redis without ACLs).
    assert run_manage({"KESTREL_RUNNER_BROKER_USERS": "false"}, "check").returncode == 0


def test_hosted_mode_requires_the_credentials_key_file():
    without = {k: v for k, v in HOSTED.items() if k != "KESTREL_CREDENTIALS_KEY_FILE"}
    result = run_manage(without, "check")
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr
    assert "KESTREL_CREDENTIALS_KEY_FILE" in result.stderr
