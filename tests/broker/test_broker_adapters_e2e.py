"""A workload's adapter calls through the broker, all the way to the upstream (CRED-3).

Real processes: a Docker runner worker, a control worker, the control tier's adapter worker
and the test upstream (HTTPS with its own CA, counting requests). The workload's container
has no network; its ``kestrel-adapter`` call becomes an ``adapter.invoke`` action of the
same thread under the same policy and approvals, and its answer is the child's outcome.
"""

from __future__ import annotations

import json
import time

import pytest
from django.db import connection

from kestrel_one.accounts.principal import Principal, PrincipalKind, system_principal
from kestrel_one.credentials.services import credential_create
from kestrel_one.execution.approvals import approval_decide
from kestrel_one.execution.models import Action, ActionState, Receipt
from kestrel_one.execution.services import action_request
from kestrel_one.sandbox_broker.models import BrokeredRequest
from tests.execution.workers import governed_thread, real_workers_and_adapters

RUNNER_ID = "run_BROKERADAPTERS000000000000"
pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.docker,
    pytest.mark.spec("CRED-3"),
]

POLICY = {
    "capabilities": {
        "shell.exec": {"limits": {"timeout_s": 60, "memory_mb": 256, "pids": 64}},
        # The external operation is named with "approval": "never": it still waits for a
        # person (CRED-5), here while the workload waits.
        "adapter.invoke": {
            "approval": "never",
            "adapters": {"github": {"operations": ["issues.list", "issue_comment.create"]}},
        },
    }
}
DIRECT = (
    'python3 -c "import socket\n'
    "try:\n"
    "    socket.create_connection(('1.1.1.1', 443), timeout=3); print('CONNECTED')\n"
    "except OSError as error:\n"
    "    print('NO NETWORK', type(error).__name__)\"\n"
)
# The client's answer on stdout, its refusal on stderr, and its exit status, as JSON lines.
CALL = (
    "kestrel-adapter {args} >out.json 2>err.json; rc=$?\n"
    'printf \'{{"rc": %s}}\\n\' "$rc"; cat out.json err.json\n'
)


@pytest.fixture(scope="module")
def workers(django_db_setup, django_db_blocker, tmp_path_factory, docker_backend, upstream_server):
    with django_db_blocker.unblock():
        database = connection.settings_dict
    base = tmp_path_factory.mktemp("broker-adapters")
    with real_workers_and_adapters(
        base, runner_id=RUNNER_ID, database=database, upstream_env=upstream_server.env()
    ) as files:
        yield files


@pytest.fixture
def e2e(workers, world, upstream):
    thread = governed_thread(workers, world.org, runner_id=RUNNER_ID, policy=POLICY, name="brk")
    owner = world["owner"]
    credential = credential_create(
        actor=system_principal("tests"),
        organization=world.org,
        name="github",
        adapter="github",
        secret=upstream.secret("github"),
    )
    return {
        "thread": thread,
        "actor": Principal(PrincipalKind.TOKEN, user=owner.user, token=owner.token),
        "person": Principal(PrincipalKind.SESSION, user=owner.user),
        "credential": credential.public_id,
        "upstream": upstream,
        "logs": workers["logs"],
    }


def script_call(e2e, script: str, *, timeout_s: int = 60) -> Action:
    action = action_request(
        actor=e2e["actor"],
        thread=e2e["thread"],
        tool="shell.exec",
        args={"script": script, "timeout_s": timeout_s},
    )
    assert action.state == ActionState.QUEUED, action.decision
    return action


def wait_for(e2e, action: Action, states, *, polls: int = 600) -> Action:
    for _ in range(polls):  # bounded: polls of 0.2 s
        action.refresh_from_db()
        if action.state in states:
            return action
        time.sleep(0.2)
    names = ("runner.log", "control.log", "reports.log", "adapters.log")
    logs = "".join((e2e["logs"] / name).read_text()[-3000:] for name in names)
    raise AssertionError(f"{action.public_id} stayed {action.state}; logs:\n{logs}")


def finished(e2e, action: Action) -> Action:
    return wait_for(e2e, action, {ActionState.SUCCEEDED, ActionState.FAILED})


def client_output(call: Action) -> tuple[int, list]:
    """The client's exit status and what it printed (answer or refusal), after the first line."""
    lines = [line for line in call.result["stdout"].splitlines() if line.strip()]
    start = next(i for i, line in enumerate(lines) if line.startswith('{"rc"'))
    return json.loads(lines[start])["rc"], [json.loads(line) for line in lines[start + 1 :]]


def child_of(call: Action) -> Action:
    [brokered] = BrokeredRequest.objects.filter(parent=call).select_related("child")
    return brokered.child


def kestrel_adapter(*args: str) -> str:
    return " ".join(f"'{arg}'" for arg in args)


def test_the_workload_has_no_network_and_its_adapter_call_succeeds_through_the_broker(e2e):
    args = kestrel_adapter(
        "github",
        "issues.list",
        json.dumps({"owner": "kestrel", "repo": "one"}),
        "--credential",
        e2e["credential"],
    )
    call = finished(e2e, script_call(e2e, DIRECT + CALL.format(args=args)))
    assert call.state == ActionState.SUCCEEDED, call.error
    assert call.result["stdout"].startswith("NO NETWORK"), call.result
    rc, printed = client_output(call)
    assert rc == 0, printed
    child = child_of(call)
    assert child.state == ActionState.SUCCEEDED and child.tool == "adapter.invoke"
    assert child.thread_id == call.thread_id
    assert child.requested_by == call.requested_by  # as the call's own requester
    assert printed == [child.result]
    assert child.result["status"] == 200 and isinstance(child.result["body"], list)
    # The upstream received exactly one request, from the adapter worker, with the credential.
    [received] = e2e["upstream"].requests(host="github", path="/repos/kestrel/one/issues")
    assert received["method"] == "GET"
    assert Receipt.objects.get(action=child).outcome == "succeeded"
    # The credential reached neither the workload nor anything it was told.
    assert e2e["upstream"].secret("github") not in json.dumps(call.result)


def test_an_external_operation_waits_for_a_person_while_the_workload_waits(e2e):
    comment = {"owner": "kestrel", "repo": "one", "issue_number": 7, "body": "built"}
    args = kestrel_adapter(
        "github",
        "issue_comment.create",
        json.dumps(comment),
        "--credential",
        e2e["credential"],
        "--idempotency-key",
        "build-7-done",
    )
    call = script_call(e2e, CALL.format(args=args))
    call = wait_for(e2e, call, {ActionState.RUNNING})
    for _ in range(300):  # the child appears once the broker's request is taken
        brokered = BrokeredRequest.objects.filter(parent=call).select_related("child").first()
        if brokered is not None:
            break
        time.sleep(0.2)
    child = brokered.child
    assert child.state == ActionState.AWAITING_APPROVAL
    # Nothing reached the upstream while it waited; the workload is still waiting too.
    assert e2e["upstream"].requests(host="github", method="POST") == []
    call.refresh_from_db()
    assert call.state == ActionState.RUNNING
    approval_decide(actor=e2e["person"], action=child, approve=True)
    call = finished(e2e, call)
    rc, printed = client_output(call)
    assert rc == 0, printed
    child.refresh_from_db()
    assert child.state == ActionState.SUCCEEDED
    assert printed == [child.result] and child.result["status"] == 201
    assert len(e2e["upstream"].requests(host="github", method="POST")) == 1


def test_a_denied_child_answers_the_workload_with_a_refusal(e2e):
    # A credential it may use, but an operation the environment's policy does not name:
    # denied at request.
    slack_credential = credential_create(
        actor=system_principal("tests"),
        organization=e2e["thread"].project.organization,
        name="slack",
        adapter="slack",
        secret=e2e["upstream"].secret("slack"),
    )
    slack = kestrel_adapter("slack", "chat.postMessage", json.dumps({"channel": "C1", "text": "x"}),
                            "--credential", slack_credential.public_id,
                            "--idempotency-key", "k1")  # fmt: skip
    denied = finished(e2e, script_call(e2e, CALL.format(args=slack)))
    rc, printed = client_output(denied)
    assert rc == 1
    [refusal] = printed
    child = child_of(denied)
    assert child.state == ActionState.DENIED
    assert refusal["outcome"] == "denied" and refusal["action"] == child.public_id
    assert refusal["code"] == "policy_denied"
    assert e2e["upstream"].requests(host="slack") == []

    # Denied by a person while the workload waits.
    comment = {"owner": "kestrel", "repo": "one", "issue_number": 8, "body": "no"}
    args = kestrel_adapter("github", "issue_comment.create", json.dumps(comment), "--credential",
                           e2e["credential"], "--idempotency-key", "build-8")  # fmt: skip
    call = wait_for(e2e, script_call(e2e, CALL.format(args=args)), {ActionState.RUNNING})
    for _ in range(300):
        brokered = BrokeredRequest.objects.filter(parent=call).select_related("child").first()
        if brokered is not None:
            break
        time.sleep(0.2)
    approval_decide(actor=e2e["person"], action=brokered.child, approve=False)
    call = finished(e2e, call)
    rc, [refusal] = client_output(call)
    assert rc == 1 and refusal["code"] == "approval_denied" and refusal["outcome"] == "denied"
    assert e2e["upstream"].requests(host="github", method="POST") == []


def test_nobody_deciding_within_the_calls_timeout_ends_in_a_timeout_and_a_cancelled_child(e2e):
    comment = {"owner": "kestrel", "repo": "one", "issue_number": 9, "body": "late"}
    args = kestrel_adapter("github", "issue_comment.create", json.dumps(comment), "--credential",
                           e2e["credential"], "--idempotency-key", "build-9")  # fmt: skip
    call = finished(e2e, script_call(e2e, CALL.format(args=args), timeout_s=8))
    rc, [refusal] = client_output(call)
    assert rc == 1 and refusal["code"] == "timeout"
    child = child_of(call)
    # The call ended, so its child cannot be approved into an effect nobody waits for.
    child = wait_for(e2e, child, {ActionState.CANCELLED}, polls=100)
    assert child.error["code"] == "parent_call_ended"
    with pytest.raises(Exception, match="cancelled"):
        approval_decide(actor=e2e["person"], action=child, approve=True)
    assert e2e["upstream"].requests(host="github", method="POST") == []
