"""A runner host that was down when a project was deleted removes its workspace after all,
through real processes: a runner worker on Docker, stopped and started again on the same
host folders, and a reports worker that answers its workspace inventory."""

from __future__ import annotations

import os

import pytest
from django.db import connection

from kestrel_one.accounts.principal import Principal, PrincipalKind, system_principal
from kestrel_one.execution.models import ActionState, DeletedProject
from kestrel_one.tenancy.services import project_delete
from runners.workspace import WorkspaceQuota
from tests.execution.test_end_to_end import E2E_POLICY, RUNNER_ID, run
from tests.execution.test_runner_bounds_e2e import wait_for
from tests.execution.workers import governed_thread, real_workers, runner_worker
from tests.support import stop

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.docker]


@pytest.fixture
def workers(django_db_setup, django_db_blocker, tmp_path_factory, docker_backend):
    """The control plane's workers only: the test starts and stops the runner (the host)."""
    with django_db_blocker.unblock():
        database = connection.settings_dict
    with real_workers(
        tmp_path_factory.mktemp("runner"), runner_id=RUNNER_ID, database=database, runner=False
    ) as files:
        yield files


@pytest.mark.spec("RUN-3")
def test_a_host_down_when_its_project_was_deleted_removes_the_workspace_when_it_restarts(
    workers, world
):
    """``project.delete`` is a broadcast: a host that is down when it is sent never gets it,
    and used to keep the deleted project's files for good. The deletion is now recorded, the
    restarted runner lists its workspaces (signed) when it is ready, and the control worker
    sends ``project.delete`` again to its pool; the runner removes the workspace, its quota
    filesystem and its image as it would have."""
    thread = governed_thread(
        workers, world.org, runner_id=RUNNER_ID, policy=E2E_POLICY, name="inventory"
    )
    owner = world["owner"]
    e2e = {
        "thread": thread,
        "actor": Principal(PrincipalKind.TOKEN, user=owner.user, token=owner.token),
        "logs": workers["logs"],
    }
    project = thread.project.public_id
    workspace = workers["workspaces"] / project
    image = WorkspaceQuota(workspace.parent).image(project)
    runner = runner_worker(workers, runner_id=RUNNER_ID)
    try:
        wrote = run(e2e, "fs.write", {"path": "notes/a.txt", "content": "kept until deleted"})
        assert wrote.state == ActionState.SUCCEEDED, wrote.error
        assert (workspace / "notes" / "a.txt").exists()
    finally:
        stop(runner)  # it unmounts the quota filesystem; the image keeps the files

    # The host is down: the broadcast reaches no one, and nothing removes the files.
    project_delete(actor=system_principal("tests"), project=thread.project)
    assert DeletedProject.objects.filter(project_public_id=project).exists()
    assert image.exists() and os.path.lexists(workspace)

    (workers["logs"] / "runner.log").rename(workers["logs"] / "runner-before-restart.log")
    restarted = runner_worker(workers, runner_id=RUNNER_ID)
    try:
        wait_for(
            lambda: not os.path.lexists(workspace) and not image.exists(),
            "removal of the deleted project's workspace after the restart",
            e2e,
        )
    finally:
        stop(restarted)
    reports_log = (workers["logs"] / "reports.log").read_text()
    assert "project.delete sent again" in reports_log and project in reports_log
