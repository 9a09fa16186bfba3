"""Ending a thread end to end through real processes: a warm call in a thread, a call still
running when the thread is ended over HTTP, the control plane's broadcast after commit, and
the runner removing the thread's warm container once that call has been recorded."""

from __future__ import annotations

import time
import uuid

import docker
import pytest
from django.db import connection

from kestrel_one.execution.models import Action, ActionState
from kestrel_one.threads.models import Thread
from runners.sandbox.docker import LABEL_PREFIX
from runners.sandbox.warm_host import WARM_LABEL
from tests.execution.workers import governed_thread, real_workers

# Its own runner id: another suite's runner starting up removes idle warm containers of its
# id, which must never be what makes this test pass.
RUNNER_ID = f"run_E2EEND{uuid.uuid4().hex[:16].upper()}"
POLICY = {"capabilities": {"shell.exec": {"limits": {"timeout_s": 30, "pids": 64}}}}
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.docker]


@pytest.fixture(scope="module")
def workers(django_db_setup, django_db_blocker, tmp_path_factory, docker_backend):
    """A runner worker and a control worker, both real Celery processes on the real broker."""
    with django_db_blocker.unblock():
        database = connection.settings_dict
    with real_workers(
        tmp_path_factory.mktemp("thread-end"), runner_id=RUNNER_ID, database=database
    ) as files:
        yield files


def logs(workers) -> str:
    return "".join(
        (workers["logs"] / name).read_text(errors="replace")[-3000:]
        for name in ("runner.log", "control.log", "reports.log")
    )


def wait_for(condition, *, timeout: float, what: str, workers) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what} after {timeout} s\n{logs(workers)}")
        time.sleep(0.2)


def warm_containers(thread: Thread) -> list:
    client = docker.from_env()
    try:
        return client.containers.list(
            all=True,
            filters={
                "label": [
                    f"{WARM_LABEL}=true",
                    f"{LABEL_PREFIX}thread={thread.public_id}",
                    f"{LABEL_PREFIX}runner={RUNNER_ID}",
                ]
            },
        )
    finally:
        client.close()


def test_ending_a_thread_removes_its_warm_container_after_the_running_call_is_recorded(
    workers, world
):
    thread = governed_thread(workers, world.org, runner_id=RUNNER_ID, policy=POLICY, name="ending")
    project = thread.project
    client = world["owner"].client()
    actions_url = f"/api/v1/orgs/acme/projects/{project.public_id}/threads/{thread.public_id}"

    def request(script: str) -> dict:
        response = client.post(
            f"{actions_url}/actions",
            {"tool": "shell.exec", "args": {"script": script}},
            format="json",
        )
        assert response.status_code == 201, response.content
        return response.json()

    def state(action_id: str) -> str:
        return Action.objects.get(public_id=action_id).state

    warm = request("echo warm")
    wait_for(
        lambda: state(warm["id"]) == ActionState.SUCCEEDED,
        timeout=120,
        what="the first call to succeed",
        workers=workers,
    )
    assert len(warm_containers(thread)) == 1, "the thread's call left a warm container"

    running = request("sleep 3; echo done")
    wait_for(
        lambda: state(running["id"]) == ActionState.RUNNING,
        timeout=60,
        what="the second call to start",
        workers=workers,
    )
    ended = client.post(f"{actions_url}/end", {}, format="json")
    assert ended.status_code == 200, ended.content
    assert ended.json()["status"] == "ended"

    refused = client.post(
        f"{actions_url}/actions",
        {"tool": "shell.exec", "args": {"script": "echo too late"}},
        format="json",
    )
    assert refused.status_code == 409
    assert refused.json()["error"]["code"] == "thread_ended"

    wait_for(
        lambda: state(running["id"]) == ActionState.SUCCEEDED,
        timeout=60,
        what="the running call to be recorded",
        workers=workers,
    )
    assert Action.objects.get(public_id=running["id"]).result["stdout"] == "done\n"
    wait_for(
        lambda: not warm_containers(thread),
        timeout=30,
        what="the thread's warm container to be removed",
        workers=workers,
    )
    assert '"event": "thread_ended"' in (workers["logs"] / "runner.log").read_text()
    assert Action.objects.filter(thread=thread).count() == 2
