"""How an adapter call fails: with a code, secret-free, and (for a key) at most once.

Run in-process (``adapter_invoke_run`` as the worker runs it) against the test upstream, so
each failure can be arranged: a CA the egress client does not trust, an operation timeout
shorter than the upstream's answer.
"""

from __future__ import annotations

import dataclasses

import pytest

from kestrel_one.accounts.principal import system_principal
from kestrel_one.adapters import registry
from kestrel_one.adapters.models import AdapterInvocation
from kestrel_one.adapters.services import adapter_invoke_run
from kestrel_one.credentials.services import credential_create
from kestrel_one.execution.models import Action, Receipt
from tests.adapters.conftest import adapter_project, invoke
from tests.credentials.helpers import assert_secret_free

pytestmark = [pytest.mark.django_db(transaction=True)]
SYSTEM = system_principal("tests")
POLICY = {
    "capabilities": {
        "adapter.invoke": {"adapters": {"github": {"operations": ["issues.list"]}}},
    }
}


@pytest.fixture
def calls(adapters, upstream, monkeypatch):
    monkeypatch.setattr("kestrel_one.celery.app.send_task", lambda *a, **k: None)
    adapters.models_project, adapters.models_thread = adapter_project(
        adapters.org, name="failures", policy=POLICY
    )
    adapters.secrets = {"github": upstream.secret("github")}
    adapters.credentials = {
        name: credential_create(
            actor=SYSTEM, organization=adapters.org, name=name, adapter=name, secret=secret
        )
        for name, secret in adapters.secrets.items()
    }
    return adapters


def run(world, args: dict) -> Action:
    answer = invoke(
        world["member"].client(),
        world,
        args,
        project=world.models_project,
        thread=world.models_thread,
    )
    assert answer.status_code == 201, answer.content
    adapter_invoke_run(action_id=answer.json()["id"])
    return Action.objects.get(public_id=answer.json()["id"])


def issues(world, repo: str, **extra) -> dict:
    """issues.list of ``repo``: the test upstream fails as a repository's name asks."""
    return {
        "adapter": "github",
        "operation": "issues.list",
        "args": {"owner": "acme", "repo": repo},
        "credential": world.credentials["github"].public_id,
        **extra,
    }


@pytest.mark.spec("CRED-2", "CRED-6")
def test_an_untrusted_certificate_fails_tls_failed_and_sends_nothing(calls, upstream, settings):
    settings.KESTREL_EGRESS_CA_BUNDLE = None  # the test CA is no longer trusted
    issues = {
        "adapter": "github",
        "operation": "issues.list",
        "args": {"owner": "acme", "repo": "rockets"},
        "credential": calls.credentials["github"].public_id,
        "idempotency_key": "tls-1",
    }
    action = run(calls, issues)
    assert action.state == "failed"
    assert action.error["code"] == "tls_failed", action.error
    assert upstream.requests() == []
    # Nothing reached the provider: the key is free for a retry once TLS is fixed.
    assert not AdapterInvocation.objects.filter(idempotency_key="tls-1").exists()
    assert Receipt.objects.get(action=action).evidence["upstream_requests"] == 0
    assert_secret_free(str(action.error), calls.secrets["github"])


@pytest.mark.spec("CRED-5", "CRED-6")
def test_a_timeout_carries_its_code_and_the_key_never_sends_again(calls, upstream, monkeypatch):
    _, operation = registry.get_operation("github", "issues.list")
    short = dataclasses.replace(operation, timeout_s=1.0)
    monkeypatch.setattr(
        "kestrel_one.adapters.services.get_operation",
        lambda adapter, name: (registry.ADAPTERS[adapter], short),
    )
    first = run(calls, issues(calls, "kestrel-slow", idempotency_key="slow-1"))
    assert first.state == "failed"
    assert first.error["code"] == "timeout", first.error
    assert len(upstream.requests(host="github")) == 1
    # The request may have reached the provider: the same key gets that answer, unsent.
    again = run(calls, issues(calls, "kestrel-slow", idempotency_key="slow-1"))
    assert again.state == "failed" and again.error["code"] == "timeout"
    assert len(upstream.requests(host="github")) == 1
    assert Receipt.objects.get(action=again).evidence["replayed_from"] == first.public_id


@pytest.mark.spec("CRED-6")
def test_an_upstream_error_is_recorded_with_its_status(calls, upstream):
    action = run(calls, issues(calls, "kestrel-upstream-error"))
    assert action.state == "failed"
    assert action.error == {
        "code": "upstream_error",
        "message": "github issues.list answered HTTP 500",
        "status": 500,
    }
    assert action.result["status"] == 500
    assert action.result["body"]["message"] == "Server Error"


@pytest.mark.spec("CRED-6", "TEN-5")
def test_a_credential_revoked_after_the_request_is_refused_and_nothing_is_sent(calls, upstream):
    from kestrel_one.credentials.services import credential_revoke

    answer = invoke(
        calls["member"].client(),
        calls,
        issues(calls, "rockets"),
        project=calls.models_project,
        thread=calls.models_thread,
    )
    credential_revoke(actor=SYSTEM, credential=calls.credentials["github"])
    adapter_invoke_run(action_id=answer.json()["id"])
    action = Action.objects.get(public_id=answer.json()["id"])
    assert action.state == "failed"
    assert action.error["code"] == "credential_not_found"
    assert upstream.requests() == []
