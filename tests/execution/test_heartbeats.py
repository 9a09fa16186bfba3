"""Runner heartbeats and what GET /api/v1/health makes of them and of the broker."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from kestrel_one.execution.heartbeats import RunnerNoticeRefused, runner_heartbeat_record
from kestrel_one.execution.models import Runner
from runners.contract.tokens import (
    ResultRefused,
    generate_private_key_pem,
    sign_heartbeat,
    sign_result,
    verify_heartbeat,
)
from tests.support import free_port


def beat(runner, key, *, sandbox="docker", pool=None, now=None) -> str:
    return sign_heartbeat(
        pool=pool or runner.pool,
        sandbox=sandbox,
        private_key_pem=key,
        runner_id=runner.public_id,
        now=now,
    )


def test_a_heartbeat_verifies_only_with_its_runners_key(runner, runner_key):
    token = beat(runner, runner_key)
    verified = verify_heartbeat(
        token, runner_public_key=runner.public_key, runner_id=runner.public_id
    )
    assert verified.sandbox == "docker" and verified.runner_id == runner.public_id
    forged = beat(runner, generate_private_key_pem())
    with pytest.raises(ResultRefused) as refused:
        verify_heartbeat(forged, runner_public_key=runner.public_key, runner_id=runner.public_id)
    assert refused.value.code == "bad_signature"


def test_a_heartbeat_is_not_a_report_and_names_a_known_sandbox(runner, runner_key):
    report = sign_result({"call_id": "act_1"}, runner_key, runner.public_id)
    with pytest.raises(ResultRefused, match="typ"):
        verify_heartbeat(report, runner_public_key=runner.public_key, runner_id=runner.public_id)
    with pytest.raises(ResultRefused, match="sandbox"):
        verify_heartbeat(
            beat(runner, runner_key, sandbox="unsandboxed"),
            runner_public_key=runner.public_key,
            runner_id=runner.public_id,
        )
    old = beat(runner, runner_key, now=int((timezone.now() - timedelta(hours=1)).timestamp()))
    with pytest.raises(ResultRefused, match="expired"):
        verify_heartbeat(old, runner_public_key=runner.public_key, runner_id=runner.public_id)


def test_a_verified_heartbeat_is_recorded_on_the_runner(runner, runner_key):
    runner_heartbeat_record(beat(runner, runner_key, sandbox="bubblewrap"))
    runner.refresh_from_db()
    assert runner.sandbox == "bubblewrap" and runner.last_seen_at is not None


def test_a_revoked_or_misplaced_runner_is_not_recorded(runner, runner_key):
    with pytest.raises(RunnerNoticeRefused) as refused:
        runner_heartbeat_record(beat(runner, runner_key, pool="elsewhere"))
    assert refused.value.code == "wrong_pool"
    Runner.objects.filter(pk=runner.pk).update(revoked_at=timezone.now())
    with pytest.raises(RunnerNoticeRefused) as refused:
        runner_heartbeat_record(beat(runner, runner_key))
    assert refused.value.code == "unknown_runner"
    runner.refresh_from_db()
    assert runner.sandbox == "" and runner.last_seen_at is None


def health(api) -> dict:
    response = api.get("/api/v1/health")
    assert response.status_code == 200
    return response.json()


def test_health_is_ok_with_a_broker_and_a_runner_with_a_sandbox(api, runner, runner_key):
    runner_heartbeat_record(beat(runner, runner_key, sandbox="docker"))
    assert health(api) == {
        "status": "ok",
        "broker": "ok",
        "runner": "ok",
        "sandbox": "docker",
        "missing": [],
        "message": "Calls can execute.",
    }


def test_health_names_a_runner_gone_silent(api, runner, runner_key):
    runner_heartbeat_record(beat(runner, runner_key))
    Runner.objects.filter(pk=runner.pk).update(last_seen_at=timezone.now() - timedelta(minutes=5))
    body = health(api)
    assert body["status"] == "degraded" and body["missing"] == ["runner"]
    assert body["runner"] == "none" and body["sandbox"] == "none"


def test_health_names_a_runner_without_a_sandbox(api, runner, runner_key):
    runner_heartbeat_record(beat(runner, runner_key, sandbox="none"))
    body = health(api)
    assert body["status"] == "degraded" and body["missing"] == ["sandbox"]
    assert "fail closed" in body["message"]


def test_health_names_a_broker_that_does_not_answer_and_nothing_secret(
    api, runner, runner_key, settings
):
    runner_heartbeat_record(beat(runner, runner_key))
    port = free_port()
    settings.REDIS_URL = f"redis://kestrel:hunter2@127.0.0.1:{port}/0"
    body = health(api)
    assert body["status"] == "degraded" and body["missing"] == ["broker"]
    assert body["broker"] == "unreachable"
    assert "hunter2" not in str(body) and str(port) not in str(body)
