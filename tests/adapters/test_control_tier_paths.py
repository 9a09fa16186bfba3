"""The control plane's other paths for control-tier calls: the sweep sends an unsent call to
the adapters queue (never a signed command to a runner), an expired call is never run late,
and a call whose worker died after it may have sent is never sent again (CRED-5, RUN-9)."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from kestrel_one.accounts.principal import system_principal
from kestrel_one.adapters.checks import invocation_digest
from kestrel_one.adapters.models import AdapterInvocation
from kestrel_one.adapters.services import adapter_invoke_run
from kestrel_one.credentials.services import credential_create
from kestrel_one.execution.models import Action
from kestrel_one.execution.services import calls_sweep, control_call_claim
from tests.adapters.conftest import actions_url, invoke

# Transactional: dispatch happens after commit, as it does in production.
pytestmark = [pytest.mark.django_db(transaction=True)]
SYSTEM = system_principal("tests")
ISSUES = {"owner": "acme", "repo": "rockets"}
COMMENT = {"owner": "acme", "repo": "rockets", "issue_number": 7, "body": "Launched."}


@pytest.fixture
def sent(monkeypatch):
    """Every message the control plane hands to the broker: (task name, kwargs)."""
    messages = []
    monkeypatch.setattr(
        "kestrel_one.celery.app.send_task", lambda name, **kw: messages.append((name, kw))
    )
    return messages


@pytest.fixture
def credential(adapters, upstream):
    return credential_create(
        actor=SYSTEM,
        organization=adapters.org,
        name="ci",
        adapter="github",
        secret=upstream.secret("github"),
    )


def read_args(credential) -> dict:
    return {
        "adapter": "github",
        "operation": "issues.list",
        "args": ISSUES,
        "credential": credential.public_id,
    }


def test_a_queued_call_goes_to_the_adapters_queue_by_action_id_unsigned(adapters, credential, sent):
    answer = invoke(adapters["member"].client(), adapters, read_args(credential))
    assert answer.status_code == 201, answer.content
    action = Action.objects.get(public_id=answer.json()["id"])
    assert sent == [("control.adapter_invoke", {"args": [action.public_id], "queue": "adapters"})]
    # No command was signed for it: nothing a runner could take.
    assert action.command_digest == ""
    assert action.dispatched_at is not None


def test_the_sweep_sends_an_unsent_call_to_the_adapters_queue(adapters, credential, monkeypatch):
    def broker_down(*args, **kwargs):
        raise ConnectionError("broker down")

    monkeypatch.setattr("kestrel_one.celery.app.send_task", broker_down)
    answer = invoke(adapters["member"].client(), adapters, read_args(credential))
    action = Action.objects.get(public_id=answer.json()["id"])
    assert action.state == "queued" and action.dispatched_at is None
    assert action.error["code"] == "dispatch_pending"
    Action.objects.filter(pk=action.pk).update(created_at=timezone.now() - timedelta(minutes=5))
    messages = []
    monkeypatch.setattr(
        "kestrel_one.celery.app.send_task", lambda name, **kw: messages.append((name, kw))
    )
    assert calls_sweep()["redispatched"] == 1
    assert messages == [
        ("control.adapter_invoke", {"args": [action.public_id], "queue": "adapters"})
    ]
    action.refresh_from_db()
    assert action.dispatched_at is not None and action.error is None


def test_an_approved_external_call_is_dispatched_to_the_adapters_queue(adapters, credential, sent):
    args = {
        "adapter": "github",
        "operation": "issue_comment.create",
        "args": COMMENT,
        "credential": credential.public_id,
        "idempotency_key": "k-approve",
    }
    answer = invoke(adapters["member"].client(), adapters, args)
    assert answer.json()["state"] == "awaiting_approval"
    assert sent == []
    approved = (
        adapters["owner"]
        .client()
        .post(f"{actions_url(adapters)}/{answer.json()['id']}/approve", {}, format="json")
    )
    assert approved.status_code == 200, approved.content
    assert sent == [
        ("control.adapter_invoke", {"args": [answer.json()["id"]], "queue": "adapters"})
    ]


@pytest.mark.spec("CRED-5")
def test_an_expired_call_is_never_run_late(adapters, credential, sent, upstream):
    answer = invoke(adapters["member"].client(), adapters, read_args(credential))
    action = Action.objects.get(public_id=answer.json()["id"])
    Action.objects.filter(pk=action.pk).update(deadline_at=timezone.now() - timedelta(seconds=1))
    assert calls_sweep()["expired"] == 1
    assert adapter_invoke_run(action_id=action.public_id) == "not-queued"
    action.refresh_from_db()
    assert action.state == "expired"
    assert action.error["code"] == "command_expired"
    assert "control-tier worker" in action.error["message"]
    assert upstream.requests() == []


@pytest.mark.spec("CRED-5", "RUN-9")
def test_an_external_call_whose_worker_died_mid_request_is_never_sent_again(
    adapters, credential, sent, upstream
):
    args = {
        "adapter": "github",
        "operation": "issue_comment.create",
        "args": COMMENT,
        "credential": credential.public_id,
        "idempotency_key": "k-died",
    }
    answer = invoke(adapters["member"].client(), adapters, args)
    action_id = answer.json()["id"]
    approved = (
        adapters["owner"]
        .client()
        .post(f"{actions_url(adapters)}/{action_id}/approve", {}, format="json")
    )
    assert approved.status_code == 200, approved.content
    # A first delivery took the call and its key, then its worker died.
    action = control_call_claim(action_id=action_id, tool="adapter.invoke")
    AdapterInvocation.objects.create(
        organization=adapters.org,
        adapter="github",
        operation="issue_comment.create",
        idempotency_key="k-died",
        request_digest=invocation_digest(args, project=action.project.public_id),
        action=action,
        lease_until=timezone.now() + timedelta(minutes=1),
    )
    # The broker hands the task back: the call is not made again.
    adapter_invoke_run(action_id=action_id)
    action.refresh_from_db()
    assert action.state == "failed"
    assert action.error["code"] == "outcome_unknown"
    assert upstream.requests() == []
    # And a retry with the same key gets that answer, not a request.
    retry = invoke(adapters["member"].client(), adapters, args)
    approved = (
        adapters["owner"]
        .client()
        .post(f"{actions_url(adapters)}/{retry.json()['id']}/approve", {}, format="json")
    )
    assert approved.status_code == 200, approved.content
    adapter_invoke_run(action_id=retry.json()["id"])
    retried = Action.objects.get(public_id=retry.json()["id"])
    assert retried.state == "failed" and retried.error["code"] == "outcome_unknown"
    assert upstream.requests() == []


def test_a_running_call_past_its_deadline_is_lost(adapters, credential, sent):
    answer = invoke(adapters["member"].client(), adapters, read_args(credential))
    action = control_call_claim(action_id=answer.json()["id"], tool="adapter.invoke")
    Action.objects.filter(pk=action.pk).update(deadline_at=timezone.now() - timedelta(seconds=1))
    assert calls_sweep()["runner_lost"] == 1
    action.refresh_from_db()
    assert action.state == "failed" and action.error["code"] == "runner_lost"


@pytest.mark.spec("CRED-5", "CRED-6")
def test_a_fault_in_the_control_tier_ends_the_call_and_its_key_is_never_resent(
    adapters, credential, sent, upstream, monkeypatch
):
    args = {
        "adapter": "github",
        "operation": "issue_comment.create",
        "args": COMMENT,
        "credential": credential.public_id,
        "idempotency_key": "k-fault",
    }

    def broken(*a, **k):
        raise RuntimeError("a bug after the key was taken")

    monkeypatch.setattr("kestrel_one.adapters.services.prepare_request", broken)
    ids = []
    for _ in range(2):
        answer = invoke(adapters["member"].client(), adapters, args)
        approved = (
            adapters["owner"]
            .client()
            .post(f"{actions_url(adapters)}/{answer.json()['id']}/approve", {}, format="json")
        )
        assert approved.status_code == 200, approved.content
        adapter_invoke_run(action_id=answer.json()["id"])
        ids.append(answer.json()["id"])
        monkeypatch.undo()  # the second call finds the key answered, and is not sent
        monkeypatch.setattr("kestrel_one.celery.app.send_task", lambda *a, **k: None)
    first, second = (Action.objects.get(public_id=i) for i in ids)
    assert first.state == second.state == "failed"
    assert first.error["code"] == second.error["code"] == "adapter_error"
    assert "bug" not in str(first.error)
    assert upstream.requests() == []


@pytest.mark.spec("CRED-5", "CRED-2")
def test_the_providers_own_idempotency_header_carries_a_stable_key_and_the_credential_once(
    adapters, credential, sent, upstream, monkeypatch
):
    """Where a provider has its own idempotency header, the call sends one derived from the
    key (stable, naming nothing of ours); the credential goes in the presentation header
    only, exactly as the adapter presents it."""
    import dataclasses

    from kestrel_one.adapters import registry

    adapter, operation = registry.get_operation("github", "issue_comment.create")
    with_header = dataclasses.replace(operation, idempotency_header="Idempotency-Key")
    monkeypatch.setattr(
        "kestrel_one.adapters.services.get_operation", lambda a, o: (adapter, with_header)
    )
    args = {
        "adapter": "github",
        "operation": "issue_comment.create",
        "args": COMMENT,
        "credential": credential.public_id,
        "idempotency_key": "release-42",
    }
    answer = invoke(adapters["member"].client(), adapters, args)
    approved = (
        adapters["owner"]
        .client()
        .post(f"{actions_url(adapters)}/{answer.json()['id']}/approve", {}, format="json")
    )
    assert approved.status_code == 200, approved.content
    adapter_invoke_run(action_id=answer.json()["id"])
    assert Action.objects.get(public_id=answer.json()["id"]).state == "succeeded"
    (request,) = upstream.requests(host="github")
    headers = request["headers"]
    assert len(headers["idempotency-key"]) == 64 and "release-42" not in headers["idempotency-key"]
    assert headers["authorization"] == f"Bearer {upstream.secret('github')}"
    assert upstream.secret("github") not in json.dumps(
        {name: value for name, value in headers.items() if name != "authorization"}
    )
    assert upstream.secret("github") not in request.get("body", "")


@pytest.mark.spec("POL-3", "CRED-5")
def test_a_narrowing_published_after_dispatch_denies_the_call_before_it_runs(
    adapters, credential, sent, upstream
):
    from kestrel_one.governance.services import policy_publish_environment

    answer = invoke(adapters["member"].client(), adapters, read_args(credential))
    assert answer.json()["state"] == "queued" and sent
    narrower = {"capabilities": {"fs.read": {"paths": ["**"]}}}
    policy_publish_environment(
        actor=SYSTEM, environment=adapters.adapter_project.environment, document=narrower
    )
    assert adapter_invoke_run(action_id=answer.json()["id"]) == "not-queued"
    action = Action.objects.get(public_id=answer.json()["id"])
    assert action.state == "denied"
    assert action.error["code"] == "policy_denies"
    assert upstream.requests() == []


@pytest.mark.spec("CRED-5", "AUD-3")
def test_a_call_naming_no_credential_records_the_default_so_the_digest_binds_it(
    adapters, credential, sent, upstream
):
    bare = {"adapter": "github", "operation": "issues.list", "args": ISSUES}
    answer = invoke(adapters["member"].client(), adapters, bare)
    assert answer.status_code == 201, answer.content
    assert answer.json()["args"]["credential"] == credential.public_id
    action = Action.objects.get(public_id=answer.json()["id"])
    from runners.contract.canonical import digest

    assert action.args_digest == digest({**bare, "credential": credential.public_id})
    # A second org credential for the adapter: no default any more, the call must name one.
    credential_create(
        actor=SYSTEM,
        organization=adapters.org,
        name="other",
        adapter="github",
        secret=upstream.secret("github"),
    )
    again = invoke(adapters["member"].client(), adapters, bare)
    assert again.status_code == 400, again.content
    assert again.json()["error"]["code"] == "credential_ambiguous"
    assert "args.credential" in again.json()["error"]["details"]
