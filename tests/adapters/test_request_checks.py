"""adapter.invoke at request time: everything unknown or incomplete is refused with a 400
that names the field, before any decision is recorded (CRED-4, CRED-5)."""

from __future__ import annotations

import pytest

from kestrel_one.execution.models import Action
from tests.adapters.conftest import adapter_project, invoke

ISSUES = {"owner": "acme", "repo": "rockets"}
COMMENT = {"owner": "acme", "repo": "rockets", "issue_number": 7, "body": "Launched."}
CRD = "crd_01JAAAAAAAAAAAAAAAAAAAAAAA"


def refused(response, code: str, field: str) -> dict:
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["code"] == code, error
    assert field in error["details"], error
    return error


@pytest.mark.spec("CRED-4")
@pytest.mark.parametrize(
    ("args", "code", "field"),
    [
        (
            {"adapter": "gitlab", "operation": "issues.list", "args": ISSUES},
            "unknown_adapter",
            "args.adapter",
        ),
        (
            {"adapter": "github", "operation": "repos.delete", "args": ISSUES},
            "unknown_operation",
            "args.operation",
        ),
        (
            {"adapter": "github", "operation": "issues.list", "args": {"repo": "rockets"}},
            "invalid_operation_arguments",
            "args.args.owner",
        ),
        (
            {
                "adapter": "github",
                "operation": "issues.list",
                "args": {**ISSUES, "host": "evil.example"},
            },
            "invalid_operation_arguments",
            "args.args.host",
        ),
        (
            {"adapter": "github", "operation": "issues.list", "args": {**ISSUES, "owner": "../x"}},
            "invalid_operation_arguments",
            "args.args.owner",
        ),
        (
            {"adapter": "github", "operation": "issues.list", "args": ISSUES, "kind": "x"},
            "invalid",
            "args.kind",
        ),
        (
            {"adapter": "github", "operation": "issues.list", "args": ISSUES, "credential": "x"},
            "invalid",
            "args.credential",
        ),
    ],
)
def test_unknown_adapters_operations_and_arguments_are_refused(adapters, args, code, field):
    before = Action.objects.count()
    refused(invoke(adapters["member"].client(), adapters, args), code, field)
    assert Action.objects.count() == before


@pytest.mark.spec("CRED-5")
def test_an_external_operation_needs_an_idempotency_key(adapters):
    args = {"adapter": "github", "operation": "issue_comment.create", "args": COMMENT}
    error = refused(
        invoke(adapters["member"].client(), adapters, {**args, "credential": CRD}),
        "idempotency_key_required",
        "args.idempotency_key",
    )
    assert "external" in error["message"]


def explain(client, world, project, args: dict):
    return client.post(
        f"/api/v1/orgs/{world.org.slug}/projects/{project.public_id}/explain",
        {"tool": "adapter.invoke", "args": args, "mode": "agent"},
        format="json",
    )


@pytest.mark.spec("CRED-5")
def test_an_external_operation_always_needs_approval_even_when_the_policy_says_never(adapters):
    comment = {
        "adapter": "github",
        "operation": "issue_comment.create",
        "args": COMMENT,
        "credential": CRD,
        "idempotency_key": "launch-7",
    }
    answer = explain(adapters["member"].client(), adapters, adapters.adapter_project, comment)
    assert answer.status_code == 200, answer.content
    assert answer.json()["decision"] == "needs_approval"
    assert any("external effect" in reason for reason in answer.json()["reasons"])
    read = {"adapter": "github", "operation": "issues.list", "args": ISSUES, "credential": CRD}
    answer = explain(adapters["member"].client(), adapters, adapters.adapter_project, read)
    assert answer.json()["decision"] == "allow"


@pytest.mark.spec("CRED-5")
def test_no_write_adapter_is_enabled_unless_an_environment_names_the_operation(adapters):
    # The shared world's environment grants no adapter at all; this one only github reads.
    reads_only = {
        "capabilities": {
            "adapter.invoke": {"adapters": {"github": {"operations": ["issues.list"]}}}
        }
    }
    project, _ = adapter_project(adapters.org, name="reads-only", policy=reads_only)
    comment = {
        "adapter": "github",
        "operation": "issue_comment.create",
        "args": COMMENT,
        "credential": CRD,
        "idempotency_key": "launch-7",
    }
    for target in (project, adapters.project):
        answer = explain(adapters["member"].client(), adapters, target, comment)
        assert answer.status_code == 200, answer.content
        assert answer.json()["decision"] == "deny", answer.json()
    slack = {
        "adapter": "slack",
        "operation": "chat.postMessage",
        "args": {"channel": "#launch", "text": "go"},
        "credential": CRD,
        "idempotency_key": "k1",
    }
    answer = explain(adapters["member"].client(), adapters, adapters.adapter_project, slack)
    assert answer.json()["decision"] == "deny"


@pytest.mark.spec("CRED-2", "RUN-7")
def test_a_runner_refuses_a_command_naming_a_control_tier_tool():
    """Even a command the control plane signed is refused: a runner holds no credential, and
    the control plane never signs one (it sends the call to the adapters queue)."""
    from runners.contract.canonical import digest
    from runners.contract.tokens import (
        CommandRefused,
        generate_private_key_pem,
        public_key_pem,
        sign_command,
        verify_command,
    )

    key = generate_private_key_pem()
    args = {"adapter": "github", "operation": "issues.list", "args": ISSUES, "credential": CRD}
    token = sign_command(
        {
            "iss": "kestrel-control",
            "aud": "runner.blue",
            "jti": "act_01JTESTCALL",
            "org": "org_01JORG",
            "env": "env_01JENV",
            "prj": "prj_01JPRJ",
            "thr": "thr_01JTHR",
            "tool": "adapter.invoke",
            "args": args,
            "args_digest": digest(args),
            "policy_version": "pol_3",
            "limits": {"timeout_s": 30, "memory_mb": 256, "cpus": 1, "pids": 64, "output_kb": 64},
            "attempt": 1,
        },
        key,
    )
    with pytest.raises(CommandRefused) as refused:
        verify_command(token, control_public_key=public_key_pem(key), pool="blue")
    assert refused.value.code == "control_tier_tool"
