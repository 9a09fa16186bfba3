"""adapter.invoke end to end: the API, a real control-tier worker on the ``adapters`` queue,
the egress client and the test upstream (a real HTTPS server with its own CA).

Upstream requests are counted on the upstream's own log, so "one request" is what the
server received, not what our code believes it sent.
"""

from __future__ import annotations

import json
import threading

import pytest
from django.conf import settings
from django.db import connection

from kestrel_one.accounts.principal import system_principal
from kestrel_one.audit.models import AuditRecord
from kestrel_one.credentials.services import connection_create, credential_create
from kestrel_one.execution.models import Action, Receipt
from kestrel_one.threads.models import ThreadEvent
from tests.adapters.conftest import (
    ADAPTER_POLICY,
    actions_url,
    adapter_project,
    invoke,
    wait_for,
)
from tests.credentials.helpers import assert_secret_free, person
from tests.secret_search import SecretSearch

pytestmark = [pytest.mark.django_db(transaction=True)]

SYSTEM = system_principal("tests")
ISSUES = {"owner": "acme", "repo": "rockets", "state": "all"}
COMMENT = {"owner": "acme", "repo": "rockets", "issue_number": 7, "body": "Launched."}
# A grant of a model provider under adapter.invoke, as an admin might write one.
MODEL_POLICY = {
    "capabilities": {
        "adapter.invoke": {
            "adapters": {
                "openai": {"operations": ["chat.completions"]},
                "github": {"operations": ["issues.list"]},
            }
        },
    }
}


@pytest.fixture
def github(adapters, upstream):
    """An org credential holding the secret the upstream accepts for GitHub."""
    adapters.github_secret = upstream.secret("github")
    adapters.credential = credential_create(
        actor=SYSTEM,
        organization=adapters.org,
        name="ci bot",
        adapter="github",
        secret=adapters.github_secret,
    )
    return adapters


def settled(world, action_id: str, states=("succeeded", "failed", "denied", "expired")):
    action = Action.objects.get(public_id=action_id)
    return action if action.state in states else None


def finished(world, action_id: str, log) -> Action:
    return wait_for(lambda: settled(world, action_id), f"{action_id} to finish", log=log)


def approve(world, action_id: str, approver: str = "owner"):
    return (
        world[approver]
        .client()
        .post(f"{actions_url(world)}/{action_id}/approve", {"reason": "ok"}, format="json")
    )


def comment_args(world, key: str, body: str = "Launched.") -> dict:
    return {
        "adapter": "github",
        "operation": "issue_comment.create",
        "args": {**COMMENT, "body": body},
        "credential": world.credential.public_id,
        "idempotency_key": key,
    }


def secret_free_everywhere(secret: str, worker_log) -> None:
    """No form of ``secret`` in any row of any table, any Redis key (the broker's messages
    included) or the adapter worker's log (CRED-6)."""
    search = SecretSearch([secret])
    assert search.check_tables() > 0
    search.check_redis(settings.CELERY_BROKER_URL)
    assert search.check_files([worker_log]) == 1
    # The records the search read include the call's own.
    assert Receipt.objects.exists() and ThreadEvent.objects.exists()
    assert AuditRecord.objects.exists()


@pytest.mark.spec("CRED-2", "AUD-3", "CRED-6")
def test_a_read_reaches_its_one_resource_with_the_credential_for_that_invocation(
    github, upstream, adapter_worker
):
    answer = invoke(
        github["member"].client(),
        github,
        {
            "adapter": "github",
            "operation": "issues.list",
            "args": ISSUES,
            "credential": github.credential.public_id,
        },
    )
    assert answer.status_code == 201, answer.content
    assert answer.json()["state"] == "queued"
    action = finished(github, answer.json()["id"], adapter_worker)
    assert action.state == "succeeded", (action.error, adapter_worker.read_text()[-3000:])
    assert action.result["status"] == 200
    assert [issue["number"] for issue in action.result["body"]] == [3, 2, 1]
    received = upstream.requests(host="github")
    assert len(received) == 1
    assert received[0]["method"] == "GET"
    assert received[0]["path"] == "/repos/acme/rockets/issues"
    receipt = Receipt.objects.get(action=action)
    assert receipt.runner == "control-tier"
    assert receipt.evidence["resource"] == "GET https://api.github.com/repos/{owner}/{repo}/issues"
    assert receipt.evidence["response_status"] == 200
    assert receipt.evidence["response_bytes"] > 0
    assert len(receipt.evidence["response_sha256"]) == 64
    assert len(receipt.evidence["request_sha256"]) == 64
    assert receipt.evidence["released"]["record"] == github.credential.public_id
    assert receipt.evidence["released"]["fingerprint"] == github.credential.fingerprint
    assert receipt.args_digest == action.args_digest
    # The receipt over the API, and everything recorded, hold no form of the secret.
    shown = github["member"].client().get(f"{actions_url(github)}/{action.public_id}/receipt")
    assert shown.status_code == 200
    assert shown.json()["evidence"]["response_status"] == 200
    assert_secret_free(shown.content, github.github_secret)
    secret_free_everywhere(github.github_secret, adapter_worker)


@pytest.mark.spec("CRED-5")
def test_an_external_call_waits_for_a_person_and_then_comments_once(
    github, upstream, adapter_worker, client
):
    answer = invoke(github["member"].client(), github, comment_args(github, "launch-7"))
    assert answer.status_code == 201, answer.content
    action_id = answer.json()["id"]
    # The policy says "approval": "never"; an external operation waits anyway.
    assert answer.json()["state"] == "awaiting_approval"
    # The approver sees exactly what will be sent, and with which credential (its id).
    shown = github["owner"].client().get(f"{actions_url(github)}/{action_id}").json()
    assert shown["args"]["credential"] == github.credential.public_id
    assert shown["args"]["args"] == COMMENT
    assert upstream.requests(host="github") == []
    # The requester's own token cannot approve it.
    assert approve(github, action_id, "member").status_code == 403
    assert approve(github, action_id).status_code == 200
    action = finished(github, action_id, adapter_worker)
    assert action.state == "succeeded", action.error
    assert action.result["status"] == 201
    assert action.result["body"]["body"] == "Launched."
    posted = upstream.requests(host="github", method="POST")
    assert len(posted) == 1
    assert posted[0]["path"] == "/repos/acme/rockets/issues/7/comments"
    # The console's action page shows the control-tier receipt, and no secret.
    client.force_login(github["owner"].user)
    page = client.get(f"/console/acme/actions/{action_id}")
    assert page.status_code == 200
    assert "in the control tier" in page.content.decode()
    assert "upstream answered HTTP 201" in page.content.decode()
    assert_secret_free(page.content, github.github_secret)


@pytest.mark.spec("CRED-5")
def test_a_changed_argument_after_the_request_is_refused_and_nothing_is_sent(
    github, upstream, adapter_worker
):
    from kestrel_one.execution.arguments import (
        action_arguments,
        arguments_sealed,
        arguments_shown,
    )

    answer = invoke(github["member"].client(), github, comment_args(github, "launch-8"))
    action = Action.objects.get(public_id=answer.json()["id"])
    # Someone with database access swaps the comment for another after the request.
    changed = action_arguments(action)
    changed["args"]["body"] = "Something else entirely."
    shown = arguments_shown(changed)
    Action.objects.filter(pk=action.pk).update(
        args=shown, sealed_args=arguments_sealed(changed, shown)
    )
    refused = approve(github, action.public_id)
    assert refused.status_code == 409, refused.content
    assert "changed after it was requested" in refused.json()["error"]["message"]
    assert Action.objects.get(pk=action.pk).state == "awaiting_approval"
    assert upstream.requests(host="github") == []


@pytest.mark.spec("CRED-5")
def test_a_changed_argument_after_approval_is_refused_by_the_worker(github, upstream, monkeypatch):
    """Changed between the approval and the worker: the worker checks the digest too."""
    from kestrel_one.adapters.services import adapter_invoke_run
    from kestrel_one.execution.arguments import (
        action_arguments,
        arguments_sealed,
        arguments_shown,
    )

    sent = []
    monkeypatch.setattr("kestrel_one.celery.app.send_task", lambda *a, **k: sent.append(k))
    answer = invoke(github["member"].client(), github, comment_args(github, "launch-9"))
    action_id = answer.json()["id"]
    assert approve(github, action_id).status_code == 200
    assert sent[-1]["queue"] == "adapters"
    action = Action.objects.get(public_id=action_id)
    assert action.state == "queued"
    changed = action_arguments(action)
    changed["args"]["body"] = "Not what was approved."
    shown = arguments_shown(changed)
    Action.objects.filter(pk=action.pk).update(
        args=shown, sealed_args=arguments_sealed(changed, shown)
    )
    adapter_invoke_run(action_id=action_id)
    action.refresh_from_db()
    assert action.state == "failed"
    assert action.error["code"] == "arguments_changed"
    assert upstream.requests(host="github") == []


@pytest.mark.spec("CRED-5", "RUN-9")
def test_the_same_idempotency_key_twice_makes_one_upstream_request(
    github, upstream, adapter_worker
):
    first = invoke(github["member"].client(), github, comment_args(github, "launch-10"))
    assert approve(github, first.json()["id"]).status_code == 200
    first_action = finished(github, first.json()["id"], adapter_worker)
    second = invoke(github["member"].client(), github, comment_args(github, "launch-10"))
    assert second.status_code == 201, second.content
    assert approve(github, second.json()["id"]).status_code == 200
    second_action = finished(github, second.json()["id"], adapter_worker)
    assert first_action.state == second_action.state == "succeeded"
    assert second_action.result["replayed"] is True
    assert second_action.result["body"]["id"] == first_action.result["body"]["id"]
    assert len(upstream.requests(host="github", method="POST")) == 1
    receipt = Receipt.objects.get(action=second_action)
    assert receipt.evidence["upstream_requests"] == 0
    assert receipt.evidence["replayed_from"] == first_action.public_id
    # The same key with another comment is another call: refused before anything is decided.
    other = invoke(github["member"].client(), github, comment_args(github, "launch-10", "Hi"))
    assert other.status_code == 409, other.content
    assert other.json()["error"]["code"] == "idempotency_key_reused"
    assert len(upstream.requests(host="github", method="POST")) == 1


@pytest.mark.spec("CRED-5", "TEN-1")
def test_an_idempotency_key_is_never_answered_with_another_projects_call(
    github, upstream, adapter_worker
):
    other, other_thread = adapter_project(github.org, name="elsewhere", policy=ADAPTER_POLICY)
    where = {"project": other, "thread": other_thread}
    member = github["member"].client()
    # Both requested before either has taken the key: the worker is what meets them.
    first = invoke(member, github, comment_args(github, "launch-x"))
    second = invoke(member, github, comment_args(github, "launch-x"), **where)
    assert first.status_code == second.status_code == 201, second.content
    assert approve(github, first.json()["id"]).status_code == 200
    assert finished(github, first.json()["id"], adapter_worker).state == "succeeded"
    approved = (
        github["owner"]
        .client()
        .post(
            f"{actions_url(github, **where)}/{second.json()['id']}/approve",
            {"reason": "ok"},
            format="json",
        )
    )
    assert approved.status_code == 200, approved.content
    action = finished(github, second.json()["id"], adapter_worker)
    # Not the first project's answer (its result and its effect are that project's): refused,
    # and nothing is sent for it either.
    assert action.state == "failed", action.result
    assert action.error["code"] == "idempotency_key_reused"
    assert action.result is None
    assert len(upstream.requests(host="github", method="POST")) == 1
    # And a new request there with the key is refused before anything is decided.
    again = invoke(member, github, comment_args(github, "launch-x"), **where)
    assert again.status_code == 409, again.content
    assert again.json()["error"]["code"] == "idempotency_key_reused"


@pytest.mark.spec("CRED-5", "RUN-9")
def test_twenty_concurrent_calls_with_one_key_make_one_upstream_request(
    github, upstream, adapter_worker, monkeypatch
):
    # Requested and approved first, then all twenty sent to the worker at once.
    held = []
    from kestrel_one.execution import services

    monkeypatch.setattr(services, "_control_send", lambda action: held.append(action) or True)
    ids = []
    for _ in range(20):
        answer = invoke(github["member"].client(), github, comment_args(github, "launch-20"))
        assert answer.status_code == 201, answer.content
        assert approve(github, answer.json()["id"]).status_code == 200
        ids.append(answer.json()["id"])
    assert len(held) == 20
    monkeypatch.undo()
    connection.close()  # each sender thread opens its own

    def send(action):
        try:
            services._control_send(action)
        finally:
            connection.close()  # this thread's own

    senders = [threading.Thread(target=send, args=(a,)) for a in held]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join()
    actions = [finished(github, action_id, adapter_worker) for action_id in ids]
    assert {action.state for action in actions} == {"succeeded"}, [a.error for a in actions]
    assert len({action.result["body"]["id"] for action in actions}) == 1
    assert sum(1 for action in actions if not action.result.get("replayed")) == 1
    assert len(upstream.requests(host="github", method="POST")) == 1


@pytest.mark.spec("CRED-6", "CRED-2")
def test_an_upstream_error_that_echoes_the_credential_is_recorded_without_it(
    adapters, upstream, adapter_worker
):
    secret = upstream.secret("github")
    credential = credential_create(
        actor=SYSTEM, organization=adapters.org, name="echo", adapter="github", secret=secret
    )
    project, thread = adapter_project(adapters.org, name="models", policy=MODEL_POLICY)
    answer = invoke(
        adapters["member"].client(),
        adapters,
        {
            "adapter": "github",
            "operation": "issues.list",
            "args": {"owner": "acme", "repo": "kestrel-echo-credential"},
            "credential": credential.public_id,
        },
        project=project,
        thread=thread,
    )
    assert answer.status_code == 201, answer.content
    action = finished(adapters, answer.json()["id"], adapter_worker)
    assert action.state == "failed"
    assert action.error["code"] == "upstream_error"
    assert action.error["status"] == 422
    assert len(upstream.requests(host="github")) == 1
    shown = (
        adapters["member"]
        .client()
        .get(f"{actions_url(adapters, project, thread)}/{action.public_id}")
    )
    assert_secret_free(shown.content, secret)
    assert "[redacted]" in json.dumps(action.result)  # the upstream did echo it
    secret_free_everywhere(secret, adapter_worker)


@pytest.mark.spec("TEN-5", "CRED-4")
def test_another_persons_connection_or_an_unknown_credential_is_refused_at_request(
    adapters, upstream, adapter_worker
):
    mine = connection_create(
        actor=person(adapters["admin"]),
        organization=adapters.org,
        adapter="github",
        secret=upstream.secret("github"),
    )
    args = {
        "adapter": "github",
        "operation": "issues.list",
        "args": ISSUES,
        "connection": mine.public_id,
    }
    refused = invoke(adapters["member"].client(), adapters, args)
    assert refused.status_code == 400, refused.content
    assert refused.json()["error"]["code"] == "credential_not_found"
    assert "args.connection" in refused.json()["error"]["details"]
    # Exactly the refusal a connection that does not exist gets (TEN-5).
    missing_id = "con_01JAAAAAAAAAAAAAAAAAAAAAAA"
    missing = invoke(adapters["member"].client(), adapters, {**args, "connection": missing_id})
    assert missing.status_code == 400
    assert missing.json()["error"]["code"] == refused.json()["error"]["code"]
    assert missing.json()["error"]["message"] == refused.json()["error"]["message"].replace(
        mine.public_id, missing_id
    )
    # Its owner may use it, all the way to the upstream.
    own = invoke(adapters["admin"].client(), adapters, args)
    assert own.status_code == 201, own.content
    used = finished(adapters, own.json()["id"], adapter_worker)
    assert used.state == "succeeded", used.error
    assert len(upstream.requests(host="github")) == 1
    # No credential named and none in the organization: refused, naming the field.
    bare = {"adapter": "github", "operation": "issues.list", "args": ISSUES}
    answer = invoke(adapters["member"].client(), adapters, bare)
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "credential_required"
    assert "args.credential" in answer.json()["error"]["details"]


@pytest.mark.spec("CRED-4", "POL-2")
@pytest.mark.parametrize(
    ("adapter", "operation", "args"),
    [
        ("openai", "chat.completions", {"model": "gpt-4o-mini", "messages": []}),
        ("anthropic", "messages.create", {"model": "claude", "messages": [], "max_tokens": 8}),
    ],
)
def test_a_model_provider_is_never_called_through_adapter_invoke(
    adapters, upstream, adapter, operation, args
):
    """Its calls are the model gateway's, under the project's model list and token budget:
    a grant of adapter.invoke naming it would step around both, so the call is refused
    before it is an action, whatever the policy grants."""
    project, thread = adapter_project(adapters.org, name="models", policy=MODEL_POLICY)
    answer = invoke(
        adapters["member"].client(),
        adapters,
        {"adapter": adapter, "operation": operation, "args": args},
        project=project,
        thread=thread,
    )
    assert answer.status_code == 400, answer.content
    error = answer.json()["error"]
    assert error["code"] == "model_provider"
    assert "model.invoke" in error["message"]
    assert error["details"] == {"args.adapter": ["a model provider: use model.invoke"]}
    assert not Action.objects.filter(project=project).exists()
    assert upstream.requests() == []
