"""What a runner bounds, end to end through real processes (a runner worker on Docker and a
control worker): the size of its reports, its workspaces' disk and what a read costs, and
the removal of a deleted project's workspace."""

from __future__ import annotations

import hashlib
import os
import time

import docker
import pytest
from django.db import connection

from kestrel_one.accounts.principal import Principal, PrincipalKind, system_principal
from kestrel_one.artifacts.models import Artifact
from kestrel_one.execution.models import ActionState, Receipt
from kestrel_one.tenancy.services import project_delete
from runners.sandbox.docker import LABEL_PREFIX
from runners.workspace import WorkspaceQuota
from tests.execution.test_end_to_end import E2E_POLICY, RUNNER_ID, assert_receipt, run
from tests.execution.workers import governed_thread, real_workers

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.docker]


@pytest.fixture(scope="module")
def workers(django_db_setup, django_db_blocker, tmp_path_factory, docker_backend):
    with django_db_blocker.unblock():
        database = connection.settings_dict
    with real_workers(
        tmp_path_factory.mktemp("runner"), runner_id=RUNNER_ID, database=database
    ) as files:
        yield files


@pytest.fixture
def e2e(workers, world):
    thread = governed_thread(
        workers, world.org, runner_id=RUNNER_ID, policy=E2E_POLICY, name="bounds"
    )
    owner = world["owner"]
    return {
        "thread": thread,
        "actor": Principal(PrincipalKind.TOKEN, user=owner.user, token=owner.token),
        "workspace": workers["workspaces"] / thread.project.public_id,
        "logs": workers["logs"],
    }


@pytest.mark.spec("RUN-9", "AUD-3")
def test_output_whose_report_would_be_too_large_still_gets_its_receipt(e2e):
    """700 KB of NUL bytes is inside the 1 MiB output cap but 5.6 MB as a signed report:
    the runner cuts the report to its budget, saying so with the full stream's size and
    SHA-256, and the call that ran succeeds with a receipt (it used to end ``expired``)."""
    shell = run(e2e, "shell.exec", {"script": "head -c 700000 /dev/zero; echo done >&2"})
    assert shell.state == ActionState.SUCCEEDED, shell.error
    receipt = assert_receipt(shell)
    assert receipt.outcome == "succeeded"
    result = shell.result
    assert result["exit_code"] == 0 and result["stderr"] == "done\n"
    assert result["truncated"] is True
    cut = result["report_cut"]["stdout"]
    assert cut["bytes"] == 700_000
    assert cut["sha256"] == hashlib.sha256(b"\0" * 700_000).hexdigest()
    assert 0 < cut["kept_bytes"] < 700_000
    # What the report kept is an artifact, and the inline marker says the runner cut it.
    artifact = Artifact.objects.get(public_id=result["artifacts"]["stdout"])
    assert artifact.size == cut["kept_bytes"]
    assert "the command printed 700000 bytes" in result["stdout"]
    assert Receipt.objects.filter(action=shell).count() == 1


def wait_for(condition, what: str, e2e) -> None:
    for _ in range(300):  # bounded by attempts: 300 polls of 0.1 s
        if condition():
            return
        time.sleep(0.1)
    logs = (e2e["logs"] / "runner.log").read_text()[-3000:]
    raise AssertionError(f"{what} never happened; runner log:\n{logs}")


@pytest.mark.spec("RUN-3")
def test_a_sandboxed_command_cannot_fill_the_host_disk(e2e):
    """``fallocate -l 5G`` in the sandbox grew the host's disk by 5 GB; the workspace is now
    a filesystem of KESTREL_WORKSPACE_QUOTA_MB (1024 by default), and one call may grow it
    by KESTREL_CALL_WRITE_BUDGET_MB (256 by default): the kernel stops it there, and the
    call fails saying so."""
    shell = run(e2e, "shell.exec", {"script": "fallocate -l 5G big; echo rc=$?; df -k ."})
    assert shell.state == ActionState.FAILED
    assert shell.error["code"] == "write_budget_exceeded"
    assert "KESTREL_CALL_WRITE_BUDGET_MB" in shell.error["message"]
    assert assert_receipt(shell).outcome == "failed"
    workspace = e2e["workspace"]
    assert os.path.ismount(workspace)
    image = WorkspaceQuota(workspace.parent).image(workspace.name)
    assert os.stat(image).st_blocks * 512 <= (256 + 64) * 1024 * 1024
    listed = run(e2e, "fs.list", {"path": "."})
    assert [entry["name"] for entry in listed.result["entries"]] == ["big"]


def project_containers(project: str) -> list:
    client = docker.from_env()
    try:
        return client.containers.list(
            all=True, filters={"label": f"{LABEL_PREFIX}project={project}"}
        )
    finally:
        client.close()


def test_deleting_a_project_removes_its_workspace_through_the_runner(e2e):
    """The control plane tells the pool on commit (``project.delete``); the runner removes
    the project's warm containers, which mount the workspace and would keep its files
    reachable until their idle timeout, then the workspace, its quota filesystem and its
    image."""
    wrote = run(e2e, "fs.write", {"path": "notes/a.txt", "content": "kept until deleted"})
    assert wrote.state == ActionState.SUCCEEDED, wrote.error
    shell = run(e2e, "shell.exec", {"script": "cat notes/a.txt"})
    assert shell.state == ActionState.SUCCEEDED, shell.error
    workspace = e2e["workspace"]
    image = WorkspaceQuota(workspace.parent).image(workspace.name)
    assert (workspace / "notes" / "a.txt").exists() and image.exists()
    project = e2e["thread"].project.public_id
    assert project_containers(project), "the shell call left no warm container"

    project_delete(actor=system_principal("tests"), project=e2e["thread"].project)
    wait_for(
        lambda: not os.path.lexists(workspace) and not image.exists(),
        "removal of the deleted project's workspace",
        e2e,
    )
    assert not os.path.ismount(workspace)
    wait_for(lambda: not project_containers(project), "removal of its warm container", e2e)
