"""Adapter-call fixtures: a project whose environment grants adapter operations, a person
who requests and another who approves, and (for end-to-end tests) a real adapter worker."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis
from django.conf import settings
from django.db import connection

from kestrel_one.accounts.principal import system_principal
from kestrel_one.governance.services import policy_publish_environment
from kestrel_one.tenancy.services import environment_create, project_create
from kestrel_one.threads.services import thread_create
from runners.contract.names import ADAPTERS_QUEUE
from tests.execution.workers import adapters_worker
from tests.support import stop

SYSTEM = system_principal("tests")

# Reads need no approval; the external operation is named with "approval": "never" on
# purpose: it must still wait for a person (CRED-5).
ADAPTER_POLICY = {
    "capabilities": {
        "adapter.invoke": {
            "approval": "never",
            "adapters": {
                "github": {"operations": ["issues.list", "issue_comment.create"]},
            },
        },
        "fs.read": {"paths": ["**"]},
    }
}


def adapter_project(organization, *, name: str, policy: dict):
    environment = environment_create(actor=SYSTEM, organization=organization, name=name)
    policy_publish_environment(actor=SYSTEM, environment=environment, document=policy)
    project = project_create(
        actor=SYSTEM, organization=organization, environment=environment, name=name
    )
    thread = thread_create(actor=SYSTEM, project=project, title=name, mode="agent")
    return project, thread


@pytest.fixture
def adapters(world):
    """``world`` plus a project (and agent thread) whose environment grants github reads
    and issue comments."""
    world.adapter_project, world.adapter_thread = adapter_project(
        world.org, name="integrations", policy=ADAPTER_POLICY
    )
    return world


def actions_url(world, project=None, thread=None) -> str:
    project = project or world.adapter_project
    thread = thread or world.adapter_thread
    return (
        f"/api/v1/orgs/{world.org.slug}/projects/{project.public_id}/threads/"
        f"{thread.public_id}/actions"
    )


def invoke(client, world, args: dict, **where):
    return client.post(
        actions_url(world, **where), {"tool": "adapter.invoke", "args": args}, format="json"
    )


@pytest.fixture(scope="module")
def adapter_worker(django_db_setup, django_db_blocker, upstream_server, tmp_path_factory):
    """A real control-tier adapter worker (queue ``adapters``, 4 slots) on the test database
    and broker, reaching the test upstream through the egress overrides. Yields its log."""
    with django_db_blocker.unblock():
        database = connection.settings_dict
    redis.Redis.from_url(settings.CELERY_BROKER_URL).delete(ADAPTERS_QUEUE)
    base = tmp_path_factory.mktemp("adapter-worker")
    process = adapters_worker(
        base, database=database, upstream_env=upstream_server.env(), concurrency=4
    )
    log = base / "adapters.log"
    try:
        yield log
    finally:
        stop(process)


def wait_for(predicate, what: str, *, log: Path | None = None, attempts: int = 300):
    """Poll every 0.2 s, at most ``attempts`` times (a bound, not a timing assertion)."""
    for _ in range(attempts):
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    tail = log.read_text()[-4000:] if log and log.exists() else ""
    raise AssertionError(f"gave up waiting for {what}\n{tail}")
