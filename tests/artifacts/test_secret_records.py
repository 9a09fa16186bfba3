"""Arguments and results are redacted when received: what is stored is what may be shown, the
environment overlay is write-only, and the runner still gets the exact call."""

from __future__ import annotations

import json

import pytest

from kestrel_one.common.redaction import fingerprint
from kestrel_one.execution.approvals import approval_decide
from kestrel_one.execution.arguments import action_arguments, call_args_digest
from kestrel_one.execution.keys import control_public_key_pem
from kestrel_one.execution.models import Action, Plan, Receipt
from kestrel_one.execution.plans import plan_accept, plan_propose
from kestrel_one.execution.services import action_dispatch, action_request, report_ingest
from kestrel_one.threads.services import thread_create
from runners.contract.canonical import arguments_digest, digest
from runners.contract.tokens import verify_command
from tests.artifacts.conftest import person
from tests.artifacts.helpers import finished_report
from tests.artifacts.test_output_artifacts import shell_result

pytestmark = pytest.mark.spec("CRED-1", "AUD-2")

SHAPELESS = "plainvalue-4217-no-shape"
GITHUB_TOKEN = "ghp_" + "R4nd0mGitHubT0kenF0rTest5AbCdEfGhIjK"
ENV = {"API_KEY": SHAPELESS, "GH": GITHUB_TOKEN}


def _stored(action: Action) -> str:
    action.refresh_from_db()
    return json.dumps([action.args, action.result, action.error, action.decision])


def test_env_values_are_write_only_and_the_command_carries_the_real_ones(world, records):
    # In the shared world a shell call needs a person's approval: its command is signed later.
    args = {"argv": ["sh", "-c", "echo $API_KEY"], "env": ENV}
    action = action_request(
        actor=person(world["member"]), thread=world.thread, tool="shell.exec", args=args
    )
    assert action.state == "awaiting_approval"
    stored = Action.objects.get(pk=action.pk)
    assert stored.args["env"] == {name: fingerprint(value) for name, value in ENV.items()}
    # Over the exact call, not the shown one, and salted: the shown args hide the env values.
    assert stored.args_digest == call_args_digest(args) != digest(args)
    assert SHAPELESS not in _stored(stored) and GITHUB_TOKEN not in stored.sealed_args
    assert action_arguments(stored) == args  # sealed, for the command an approval signs

    approval_decide(actor=person(world["owner"]), action=stored, approve=True)
    assert action_dispatch(action_id=stored.pk)
    command_token = records.sent[-1][1][0]
    command = verify_command(
        command_token, control_public_key=control_public_key_pem(), pool="default"
    )
    assert command.args == args  # the runner gets the real values
    assert arguments_digest(args, command.args_salt) == stored.args_digest  # and checks them

    stored.refresh_from_db()
    printed = shell_result(f"key is {SHAPELESS}\ntoken {GITHUB_TOKEN}\npassword=hunter22\n")
    report_ingest(finished_report(stored, records.runner, records.key, result=printed))
    stored.refresh_from_db()
    assert stored.state == "succeeded"
    assert stored.sealed_args == ""  # erased with the call's end
    assert stored.result["stdout"] == "key is [redacted]\ntoken [redacted]\npassword=[redacted]\n"
    receipt = Receipt.objects.get(action=stored)
    assert receipt.result == stored.result and receipt.args == stored.args
    for text in (_stored(stored), json.dumps([receipt.args, receipt.result])):
        for secret in (SHAPELESS, GITHUB_TOKEN, "hunter22"):
            assert secret not in text
    shown = (
        world["viewer"]
        .client()
        .get(
            f"/api/v1/orgs/acme/projects/{world.project.public_id}"
            f"/threads/{world.thread.public_id}/actions/{stored.public_id}"
        )
    )
    assert shown.status_code == 200
    assert SHAPELESS not in shown.content.decode() and GITHUB_TOKEN not in shown.content.decode()
    # The viewer sees every other argument and the digest; even the right guess of the env
    # values cannot be told from a wrong one without the control plane's key.
    assert shown.json()["args_digest"] not in {digest(args), digest({**args, "env": {}})}


def test_a_denied_call_keeps_no_exact_arguments(world, records):
    args = {"argv": ["true"], "env": ENV}
    action = action_request(
        actor=person(world["member"]), thread=world.thread, tool="shell.exec", args=args
    )
    approval_decide(actor=person(world["owner"]), action=action, approve=False)
    action.refresh_from_db()
    assert action.state == "denied" and action.sealed_args == ""


def test_plan_steps_are_kept_and_shown_redacted_and_still_bind_the_exact_call(world, records):
    thread = thread_create(
        actor=person(world["owner"]), project=records.project, title="plan", mode="plan"
    )
    args = {"argv": ["deploy", f"--token={GITHUB_TOKEN}"], "env": ENV}
    plan = plan_propose(
        actor=person(world["member"]), thread=thread, steps=[{"tool": "shell.exec", "args": args}]
    )
    stored = Plan.objects.get(pk=plan.pk)
    assert GITHUB_TOKEN not in json.dumps(stored.steps) and SHAPELESS not in json.dumps(
        stored.steps
    )
    assert stored.steps[0]["args_digest"] == call_args_digest(args) != digest(args)
    shown = (
        world["viewer"]
        .client()
        .get(
            f"/api/v1/orgs/acme/projects/{records.project.public_id}"
            f"/threads/{thread.public_id}/plans/{plan.public_id}"
        )
    )
    assert shown.status_code == 200 and GITHUB_TOKEN not in shown.content.decode()
    plan_accept(actor=person(world["owner"]), plan=stored)
    # The agent names the step with the exact arguments, which match by digest.
    step = action_request(
        actor=person(world["member"]),
        thread=thread,
        tool="shell.exec",
        args=args,
        plan_step={"plan": plan.public_id, "step": 0},
    )
    assert step.state == "queued" and step.plan_id == stored.pk
