"""Enrolling, listing and revoking runners."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from django.conf import settings

from kestrel_one.accounts.principal import system_principal
from kestrel_one.common.errors import ValidationFailed
from kestrel_one.execution.enrollment import runner_enroll
from kestrel_one.execution.models import Runner
from runners.contract.tokens import generate_private_key_pem, public_key_pem

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.spec("RUN-1")


def test_runner_enroll_prints_what_the_runner_needs(tmp_path):
    key = tmp_path / "runner.key"
    completed = subprocess.run(
        [sys.executable, "-m", "runners", "keygen", "--out", str(key)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert oct(key.stat().st_mode & 0o777) == "0o600"
    public = tmp_path / "runner.pub"
    public.write_text(completed.stdout)
    env = {
        **os.environ,
        "KESTREL_MODE": "single-host",
        "KESTREL_DATA_DIR": str(tmp_path / "var"),
        "DJANGO_SETTINGS_MODULE": "kestrel_one.settings",
        # Enrollment makes the runner's broker user, so it needs a broker that answers.
        "REDIS_URL": settings.REDIS_URL,
    }
    subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=ROOT, env=env, check=True)
    enrolled = subprocess.run(
        [
            sys.executable,
            "manage.py",
            "runner_enroll",
            "--pool",
            "default",
            "--public-key",
            str(public),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    body = json.loads(enrolled.stdout)
    assert body["runner"].startswith("run_") and body["pool"] == "default"
    assert "BEGIN PUBLIC KEY" in body["control_public_key"]
    assert "PRIVATE" not in enrolled.stdout
    assert key.read_text() not in enrolled.stdout
    # The runner's own broker login, shown this once: it works, and only for its pool.
    assert body["environment"]["KESTREL_BROKER_URL"] == settings.REDIS_URL
    own = redis.Redis.from_url(
        settings.REDIS_URL, username=body["runner"], password=body["broker_password"]
    )
    assert own.llen("runner.default") >= 0
    with pytest.raises(redis.exceptions.NoPermissionError):
        own.llen("runner.other-pool")
    own.close()
    bad = subprocess.run(
        [
            sys.executable,
            "manage.py",
            "runner_enroll",
            "--pool",
            "default",
            "--public-key",
            str(key),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode != 0 and "Ed25519 public key" in bad.stderr


def test_org_admin_sees_its_runners_and_the_shared_ones_serving_it(world):
    """Its dedicated runners and the shared runners of the pool its calls go to (the
    single-host runner is one), never another organization's, nor another pool's."""
    shared = runner_enroll(
        actor=system_principal("tests"),
        pool="default",
        public_key_pem=public_key_pem(generate_private_key_pem()).decode(),
    )
    runner_enroll(  # a platform pool no call of theirs goes to
        actor=system_principal("tests"),
        pool="gpu",
        public_key_pem=public_key_pem(generate_private_key_pem()).decode(),
    )
    globex_own = runner_enroll(
        actor=system_principal("tests"),
        organization=world.other_org,
        pool="globex-pool",
        public_key_pem=public_key_pem(generate_private_key_pem()).decode(),
    )
    listed = world["owner"].client().get("/api/v1/orgs/acme/runners").json()["results"]
    assert {r["id"]: r["shared"] for r in listed} == {
        world.runner.public_id: False,
        shared.public_id: True,
    }
    assert all("public_key" not in r and len(r["key_fingerprint"]) == 64 for r in listed)
    theirs = world["outsider"].client().get("/api/v1/orgs/globex/runners").json()["results"]
    assert {r["id"] for r in theirs} == {globex_own.public_id, shared.public_id}
    assert world.runner.public_id not in {r["id"] for r in theirs}


def test_a_shared_runner_is_revoked_by_the_operator_only(world):
    shared = runner_enroll(
        actor=system_principal("tests"),
        pool="default",
        public_key_pem=public_key_pem(generate_private_key_pem()).decode(),
    )
    response = world["owner"].client().delete(f"/api/v1/orgs/acme/runners/{shared.public_id}")
    assert response.status_code == 403
    assert "operator" in response.json()["error"]["message"]
    assert Runner.objects.get(pk=shared.pk).revoked_at is None


def test_revoking_a_runner_is_audited_and_final(world):
    owner = world["owner"].client()
    url = f"/api/v1/orgs/acme/runners/{world.runner.public_id}"
    assert owner.delete(url).json()["revoked_at"]
    assert Runner.objects.get(pk=world.runner.pk).revoked_at is not None
    assert world.org.audit_records.filter(action="runner.revoke").count() == 1
    assert owner.delete(url).status_code == 200
    assert world.org.audit_records.filter(action="runner.revoke").count() == 1


def test_members_cannot_see_runners(world):
    response = world["member"].client().get("/api/v1/orgs/acme/runners")
    assert response.status_code == 403


def test_enrollment_refuses_a_bad_pool_name(db):
    with pytest.raises(ValidationFailed, match="pool"):
        runner_enroll(
            actor=system_principal("tests"),
            pool="no spaces/allowed",
            public_key_pem=public_key_pem(generate_private_key_pem()).decode(),
        )
