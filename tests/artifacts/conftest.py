"""Fixtures for records: a project whose policy lets the whole workspace be read and written,
an agent thread in it, an enrolled runner, and a broker stand-in."""

from __future__ import annotations

import pytest

from kestrel_one.accounts.principal import Principal, PrincipalKind, system_principal
from kestrel_one.execution.enrollment import runner_enroll
from kestrel_one.execution.services import action_dispatch, action_request, report_ingest
from kestrel_one.governance.services import policy_publish_environment
from kestrel_one.threads.services import thread_create
from runners.contract.tokens import generate_private_key_pem, public_key_pem
from tests.artifacts.helpers import finished_report
from tests.factories import EnvironmentFactory, ProjectFactory

WORKSPACE_POLICY = {
    "capabilities": {
        "fs.read": {"paths": ["**"]},
        "fs.write": {"paths": ["**"]},
        "shell.exec": {"env": ["API_KEY", "GH"], "limits": {"timeout_s": 60}},
        "code.exec": {"approval": "always"},
    }
}


def person(actor) -> Principal:
    return Principal(PrincipalKind.TOKEN, user=actor.user, token=actor.token)


@pytest.fixture
def records(world, monkeypatch):
    """A workspace-wide project in acme, its agent thread, a runner, and the sent commands."""
    environment = EnvironmentFactory(organization=world.org, name="records")
    policy_publish_environment(
        actor=system_principal("tests"), environment=environment, document=WORKSPACE_POLICY
    )
    project = ProjectFactory(organization=world.org, environment=environment, name="records")
    thread = thread_create(
        actor=person(world["owner"]), project=project, title="records", mode="agent"
    )
    key = generate_private_key_pem()
    runner = runner_enroll(
        actor=system_principal("tests"), pool="default", public_key_pem=public_key_pem(key).decode()
    )
    sent = []
    monkeypatch.setattr(
        "kestrel_one.celery.app.send_task",
        lambda name, args, queue: sent.append((name, args, queue)),
    )

    class Records:
        pass

    records = Records()
    records.project, records.thread, records.runner, records.key = project, thread, runner, key
    records.sent = sent

    def run(tool, args, result, *, actor=None, outcome="succeeded"):
        """Request, dispatch and finish one call with the given runner result."""
        action = action_request(
            actor=actor or person(world["owner"]), thread=thread, tool=tool, args=args
        )
        assert action.state == "queued", action.decision
        assert action_dispatch(action_id=action.pk)
        action.refresh_from_db()
        report_ingest(finished_report(action, runner, key, result=result, outcome=outcome))
        action.refresh_from_db()
        return action

    records.run = run
    return records
