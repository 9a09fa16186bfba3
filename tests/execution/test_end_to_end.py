"""Every tool, end to end through real processes: the control-plane service signs a command,
a runner worker verifies it and runs the tool in a Docker container, signs the result, and a
control worker verifies and records it with a receipt."""

from __future__ import annotations

import hashlib
import os
import time

import pytest
from django.db import connection

from kestrel_one.accounts.principal import Principal, PrincipalKind
from kestrel_one.execution.models import Action, ActionState, Receipt
from kestrel_one.execution.services import action_request
from tests.execution.workers import governed_thread, real_workers

RUNNER_ID = "run_E2ETESTRUNNER0000000000000"
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.docker]

E2E_POLICY = {
    "capabilities": {
        "fs.read": {"paths": ["**"]},
        "fs.write": {"paths": ["**"]},
        "shell.exec": {"limits": {"timeout_s": 30, "memory_mb": 256, "pids": 64}},
        "code.exec": {"limits": {"timeout_s": 30}},
    }
}


@pytest.fixture(scope="module")
def workers(django_db_setup, django_db_blocker, tmp_path_factory, docker_backend):
    """A runner worker and a control worker, both real Celery processes on the real broker."""
    with django_db_blocker.unblock():
        database = connection.settings_dict
    with real_workers(
        tmp_path_factory.mktemp("runner"), runner_id=RUNNER_ID, database=database
    ) as files:
        yield files


@pytest.fixture
def e2e(workers, world):
    thread = governed_thread(workers, world.org, runner_id=RUNNER_ID, policy=E2E_POLICY, name="e2e")
    project = thread.project
    owner = world["owner"]
    return {
        "thread": thread,
        "actor": Principal(PrincipalKind.TOKEN, user=owner.user, token=owner.token),
        "workspace": workers["workspaces"] / project.public_id,
        "logs": workers["logs"],
    }


def run(e2e, tool: str, args: dict) -> Action:
    action = action_request(actor=e2e["actor"], thread=e2e["thread"], tool=tool, args=args)
    assert action.state == ActionState.QUEUED, action.decision
    return run_until_done(e2e, action)


def run_until_done(e2e, action: Action) -> Action:
    for _ in range(600):  # bounded by attempts: 600 polls of 0.2 s
        action.refresh_from_db()
        if action.state in {ActionState.SUCCEEDED, ActionState.FAILED}:
            return action
        time.sleep(0.2)
    logs = "".join(
        (e2e["logs"] / name).read_text()[-3000:]
        for name in ("runner.log", "control.log", "reports.log")
    )
    raise AssertionError(f"{action.tool} never finished ({action.state}); worker logs:\n{logs}")


def assert_receipt(action: Action) -> Receipt:
    receipt = Receipt.objects.get(action=action)
    assert receipt.call_id == action.public_id
    assert receipt.tool == action.tool and receipt.args == action.args
    assert receipt.scope == {
        "org": action.organization.public_id,
        "env": action.environment.public_id,
        "prj": action.project.public_id,
        "thr": action.thread.public_id,
    }
    assert receipt.policy_version == action.policy_version
    assert receipt.policy_version.startswith("env:pol_")
    assert receipt.runner == RUNNER_ID
    assert receipt.result == action.result
    # Whether or not the call outlived the runner's started-report delay, the thread shows
    # it started, then finished.
    kinds = list(action.events.order_by("sequence").values_list("kind", flat=True))
    assert kinds == ["action.requested", "action.decided", "action.started", "action.finished"]
    assert action.started_at is not None and action.started_at <= action.finished_at
    return receipt


@pytest.mark.spec("AUD-3", "RUN-1", "RUN-7")
def test_every_tool_runs_end_to_end_with_a_receipt(e2e):
    program = "print('hello from kestrel')\n"
    wrote = run(e2e, "fs.write", {"path": "src/hello.py", "content": program})
    assert wrote.state == ActionState.SUCCEEDED, wrote.error
    assert wrote.result["size"] == len(program.encode())
    assert wrote.result["sha256"] == hashlib.sha256(program.encode()).hexdigest()
    assert_receipt(wrote)

    read = run(e2e, "fs.read", {"path": "src/hello.py"})
    assert read.result["content"] == program
    assert read.result["sha256"] == wrote.result["sha256"]
    assert_receipt(read)

    listed = run(e2e, "fs.list", {"path": "src"})
    assert [entry["name"] for entry in listed.result["entries"]] == ["hello.py"]
    assert_receipt(listed)

    shell = run(e2e, "shell.exec", {"argv": ["python3", "src/hello.py"]})
    assert shell.result["exit_code"] == 0
    assert shell.result["stdout"] == "hello from kestrel\n" and shell.result["stderr"] == ""
    receipt = assert_receipt(shell)
    assert receipt.sandbox == "docker"

    script = run(e2e, "shell.exec", {"script": "echo out; echo err >&2; exit 3"})
    assert (script.result["exit_code"], script.result["stdout"], script.result["stderr"]) == (
        3,
        "out\n",
        "err\n",
    )

    code = run(e2e, "code.python", {"code": "import os; print(os.environ['TMPDIR'])"})
    assert code.result["exit_code"] == 0 and code.result["stdout"].strip()
    assert_receipt(code)

    deleted = run(e2e, "fs.delete", {"path": "src/hello.py"})
    assert deleted.state == ActionState.SUCCEEDED
    assert not (e2e["workspace"] / "src" / "hello.py").exists()
    assert_receipt(deleted)


@pytest.mark.spec("RUN-6")
def test_a_refused_path_is_a_failed_action_with_a_receipt(e2e):
    (e2e["workspace"]).mkdir(parents=True, exist_ok=True)
    os.symlink("/etc", e2e["workspace"] / "etc-link")
    refused = run(e2e, "fs.read", {"path": "etc-link/passwd"})
    assert refused.state == ActionState.FAILED
    assert refused.error["code"] == "path_refused"
    assert "root:" not in str(refused.error)
    assert Receipt.objects.get(action=refused).outcome == "failed"


@pytest.mark.spec("RUN-4")
def test_a_command_that_exits_non_zero_succeeded_and_its_result_has_the_exit_code(e2e, world):
    """What docs/api.md promises: ``succeeded`` means the tool ran; the status is in the result."""
    action = run(e2e, "shell.exec", {"script": "echo half done; exit 3"})
    thread = e2e["thread"]
    shown = (
        world["owner"]
        .client()
        .get(
            f"/api/v1/orgs/{thread.organization.slug}/projects/{thread.project.public_id}"
            f"/threads/{thread.public_id}/actions/{action.public_id}"
        )
    )
    assert shown.status_code == 200, shown.content
    body = shown.json()
    assert body["state"] == "succeeded"
    assert body["result"]["exit_code"] == 3 and body["result"]["stdout"] == "half done\n"
    documented = {"exit_code", "stdout", "stderr", "truncated", "duration_ms", "timed_out"}
    assert documented | {"oom_killed", "sandbox"} <= set(body["result"])
    assert body["error"] is None


@pytest.mark.spec("AUD-5", "RUN-7")
def test_a_call_outliving_the_started_delay_is_running_before_it_finishes(e2e):
    # The call waits for a file the test creates only once the control plane recorded the
    # runner's "started" report: the order is forced, no clock is compared.
    action = action_request(
        actor=e2e["actor"],
        thread=e2e["thread"],
        tool="shell.exec",
        args={"script": "while [ ! -e go ]; do sleep 0.1; done; echo went"},
    )
    for _ in range(300):  # bounded by attempts: 300 polls of 0.2 s
        action.refresh_from_db()
        if action.state != ActionState.QUEUED:
            break
        time.sleep(0.2)
    assert action.state == ActionState.RUNNING, action.state
    (e2e["workspace"] / "go").touch()

    finished = run_until_done(e2e, action)
    assert finished.state == ActionState.SUCCEEDED, finished.error
    assert finished.result["stdout"] == "went\n"
    assert_receipt(finished)


@pytest.mark.spec("AUD-5", "RUN-6")
def test_a_checkpoint_is_taken_kept_and_restored_exactly_end_to_end(e2e):
    from kestrel_one.artifacts.models import Checkpoint
    from kestrel_one.execution.checkpoints import checkpoint_restore

    assert run(e2e, "fs.write", {"path": "src/app.py", "content": "v1\n"}).result["size"] == 3
    taken = run(e2e, "workspace.checkpoint", {})
    assert taken.state == ActionState.SUCCEEDED, taken.error
    checkpoint = Checkpoint.objects.get(action=taken)
    assert taken.result["checkpoint"] == checkpoint.public_id and taken.result["files"] == 1

    run(e2e, "fs.write", {"path": "src/app.py", "content": "v2\n"})
    run(e2e, "fs.write", {"path": "later/notes.txt", "content": "made after\n"})
    restore = checkpoint_restore(
        actor=e2e["actor"], checkpoint=checkpoint, thread=e2e["thread"], exact=True
    )
    restored = run_until_done(e2e, restore)
    assert restored.state == ActionState.SUCCEEDED, restored.error
    assert restored.result["removed"] == 2  # later/ and later/notes.txt
    assert (e2e["workspace"] / "src" / "app.py").read_text() == "v1\n"
    assert not (e2e["workspace"] / "later").exists()
    assert_receipt(restored)
