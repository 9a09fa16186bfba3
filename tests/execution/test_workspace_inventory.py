"""A deleted project's workspace on a runner host that missed the ``project.delete``
broadcast: the host's workspace inventory brings the message again (runners.inventory,
kestrel_one.execution.inventory)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from kestrel_one.accounts.principal import system_principal
from kestrel_one.execution.heartbeats import RunnerNoticeRefused
from kestrel_one.execution.inventory import runner_workspaces_reconcile
from kestrel_one.execution.keys import control_private_key
from kestrel_one.execution.models import DeletedProject, Runner
from kestrel_one.tenancy.services import project_delete
from runners.contract.inventory import (
    MAX_INVENTORY_PROJECTS,
    sign_workspace_inventory,
    verify_workspace_inventory,
)
from runners.contract.names import control_exchange
from runners.contract.tokens import (
    ResultRefused,
    generate_private_key_pem,
    public_key_pem,
    sign_heartbeat,
    verify_control_message,
)


def inventory(runner, key, projects, *, pool=None, part=1, parts=1, now=None) -> str:
    return sign_workspace_inventory(
        pool=pool or runner.pool,
        projects=projects,
        part=part,
        parts=parts,
        private_key_pem=key,
        runner_id=runner.public_id,
        now=now,
    )


class Announcements:
    """The broker stand-in: the control messages sent, each verified with the control key
    for the pool it went to, as (pool, type, org, env, prj, thr)."""

    def __init__(self, monkeypatch) -> None:
        self.sent: list[dict] = []
        monkeypatch.setattr(
            "kestrel_one.celery.app.send_task", lambda *args, **options: self.sent.append(options)
        )

    def taken(self) -> list[tuple]:
        control_public = public_key_pem(control_private_key())
        found = []
        for options in self.sent:
            pool = options["exchange"].name.removeprefix("runner-control.")
            assert options["exchange"].name == control_exchange(pool)
            (token,) = options["args"]
            message = verify_control_message(token, control_public_key=control_public, pool=pool)
            found.append((pool, message.type, message.org, message.env, message.prj, message.thr))
        self.sent.clear()
        return found


@pytest.fixture
def announced(monkeypatch):
    return Announcements(monkeypatch)


def test_an_inventory_verifies_only_with_its_runners_key_and_exact_claims(runner, runner_key):
    token = inventory(runner, runner_key, ["prj_a", "prj_b"])
    verified = verify_workspace_inventory(
        token, runner_public_key=runner.public_key, runner_id=runner.public_id
    )
    assert verified.projects == ("prj_a", "prj_b") and verified.pool == runner.pool
    refusals = {
        "a forged key": (inventory(runner, generate_private_key_pem(), []), "bad_signature"),
        "a heartbeat": (
            sign_heartbeat(
                pool=runner.pool,
                sandbox="docker",
                private_key_pem=runner_key,
                runner_id=runner.public_id,
            ),
            "malformed",
        ),
        "a path for an id": (inventory(runner, runner_key, ["../etc"]), "malformed"),
        "an id twice": (inventory(runner, runner_key, ["prj_a", "prj_a"]), "malformed"),
        "too many ids": (
            inventory(runner, runner_key, [f"prj_{n}" for n in range(MAX_INVENTORY_PROJECTS + 1)]),
            "malformed",
        ),
        "a part past the parts": (inventory(runner, runner_key, [], part=2), "malformed"),
        "no parts": (inventory(runner, runner_key, [], part=0, parts=0), "malformed"),
        "an hour old": (
            inventory(
                runner,
                runner_key,
                [],
                now=int((timezone.now() - timedelta(hours=1)).timestamp()),
            ),
            "expired",
        ),
    }
    for name, (token, code) in refusals.items():
        with pytest.raises(ResultRefused) as refused:
            verify_workspace_inventory(
                token, runner_public_key=runner.public_key, runner_id=runner.public_id
            )
        assert refused.value.code == code, name


def test_a_deleted_project_is_recorded_with_what_its_notice_names(world):
    project = world.project
    project_delete(actor=system_principal("tests"), project=project)
    record = DeletedProject.objects.get(project_public_id=project.public_id)
    assert record.control_scope() == {
        "org": world.org.public_id,
        "env": project.environment.public_id,
        "prj": project.public_id,
        "thr": None,
    }


def test_an_inventory_brings_project_delete_again_only_for_the_deleted_projects_it_lists(
    world, runner, runner_key, announced
):
    deleted = world.project
    project_delete(actor=system_principal("tests"), project=deleted)
    announced.sent.clear()  # the deletion's own notice (none: the project ran no call)
    kept = world.other_project.public_id
    outcome = runner_workspaces_reconcile(
        inventory(runner, runner_key, [deleted.public_id, kept, "prj_never_here"])
    )
    assert outcome.resent == (deleted.public_id,)
    assert outcome.unknown == ("prj_never_here",) and outcome.listed == 3
    assert announced.taken() == [
        (
            runner.pool,
            "project.delete",
            world.org.public_id,
            deleted.environment.public_id,
            deleted.public_id,
            None,
        )
    ]
    # A host that keeps none of them is told nothing.
    assert runner_workspaces_reconcile(inventory(runner, runner_key, [kept])).resent == ()
    assert announced.taken() == []


def test_an_inventory_of_a_revoked_or_misplaced_runner_brings_nothing(
    world, runner, runner_key, announced
):
    project_delete(actor=system_principal("tests"), project=world.project)
    announced.sent.clear()
    listed = [world.project.public_id]
    with pytest.raises(RunnerNoticeRefused) as refused:
        runner_workspaces_reconcile(inventory(runner, runner_key, listed, pool="elsewhere"))
    assert refused.value.code == "wrong_pool"
    with pytest.raises(RunnerNoticeRefused) as refused:
        runner_workspaces_reconcile(inventory(runner, generate_private_key_pem(), listed))
    assert refused.value.code == "bad_signature"
    Runner.objects.filter(pk=runner.pk).update(revoked_at=timezone.now())
    with pytest.raises(RunnerNoticeRefused) as refused:
        runner_workspaces_reconcile(inventory(runner, runner_key, listed))
    assert refused.value.code == "unknown_runner"
    assert announced.taken() == []
