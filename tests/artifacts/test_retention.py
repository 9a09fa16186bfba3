"""Retention per organization, proven with explicit times: nothing past it remains, and each
sweep that deleted something is one audit record with the counts (AUD-6)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from kestrel_one.accounts.scopes import Role
from kestrel_one.artifacts.models import Artifact, Checkpoint, OrganizationRetention, ShareLink
from kestrel_one.artifacts.storage import storage_exists
from kestrel_one.audit.models import AuditRecord
from kestrel_one.execution.models import Action, Receipt
from kestrel_one.execution.retention import retention_sweep, retention_sweep_organization
from kestrel_one.threads.models import Thread, ThreadEvent
from kestrel_one.threads.services import thread_create
from tests.artifacts.conftest import person
from tests.artifacts.helpers import workspace_archive
from tests.artifacts.test_output_artifacts import shell_result
from tests.audit.helpers import tampering

pytestmark = pytest.mark.spec("AUD-6")

URL = "/api/v1/orgs/acme/retention"
SETTINGS = {"events_days": 10, "artifacts_days": 20, "checkpoints_days": 5, "audit_days": 365}


@pytest.fixture
def kept(world, records):
    """Output, a checkpoint and a share link in one finished thread of acme."""
    run = records.run("shell.exec", {"argv": ["make"]}, shell_result("z" * 40_000))
    records.run("workspace.checkpoint", {}, workspace_archive())
    OrganizationRetention.objects.create(organization=world.org, **SETTINGS)
    from kestrel_one.artifacts.services import share_create

    share_create(actor=person(world["owner"]), artifact=run.artifacts.get(), expires_in=3600)
    return records


def sweeps(org):
    return AuditRecord.objects.filter(organization=org, action="retention.sweep")


def test_nothing_is_deleted_before_its_time(world, kept):
    counts = retention_sweep_organization(organization=world.org, now=timezone.now())
    assert not any(counts.values())
    assert not sweeps(world.org).exists()


def test_each_kind_goes_when_its_own_retention_ends(
    world, kept, django_capture_on_commit_callbacks
):
    now = timezone.now()
    checkpoint = Checkpoint.objects.get(project=kept.project)
    output = Artifact.objects.get(project=kept.project, kind="stdout")
    files = [checkpoint.artifact.storage_name, output.storage_name]

    # Day 6: checkpoints (5 days) are gone; the rest stays.
    with django_capture_on_commit_callbacks(execute=True):
        counts = retention_sweep_organization(organization=world.org, now=now + timedelta(days=6))
    assert counts["checkpoints"] == 1 and counts["artifacts"] == 0 and counts["threads"] == 0
    assert counts["share_links"] == 1  # it lived an hour
    assert not Checkpoint.objects.filter(pk=checkpoint.pk).exists()
    assert not storage_exists(files[0]) and storage_exists(files[1])
    record = sweeps(world.org).get()
    assert record.actor_id == "system:retention"
    assert record.data["deleted"]["checkpoints"] == 1
    assert record.data["checkpoints"] == [checkpoint.public_id]

    # Day 11: events and replay data (10 days): the whole finished thread, with its actions,
    # receipts and events. The output artifact stays.
    with django_capture_on_commit_callbacks(execute=True):
        counts = retention_sweep_organization(organization=world.org, now=now + timedelta(days=11))
    assert counts["threads"] >= 1
    assert not Thread.objects.filter(pk=kept.thread.pk).exists()
    assert not Action.objects.filter(project=kept.project).exists()
    assert not Receipt.objects.filter(action__project=kept.project).exists()
    assert not ThreadEvent.objects.filter(thread_id=kept.thread.pk).exists()
    assert Artifact.objects.filter(pk=output.pk, thread=None).exists()
    assert storage_exists(files[1])

    # Day 21: artifacts (20 days).
    with django_capture_on_commit_callbacks(execute=True):
        counts = retention_sweep_organization(organization=world.org, now=now + timedelta(days=21))
    assert counts["artifacts"] >= 1
    assert not Artifact.objects.filter(organization=world.org).exists()
    assert not storage_exists(files[1])
    assert not ShareLink.objects.filter(organization=world.org).exists()
    assert sweeps(world.org).count() == 3  # one record per sweep that deleted something
    assert sum(r.data["deleted"]["artifacts"] for r in sweeps(world.org)) == counts["artifacts"]


def test_a_thread_in_use_keeps_recent_events_and_loses_old_ones(world, kept):
    now = timezone.now()
    old = now - timedelta(days=30)
    ThreadEvent.objects.filter(thread=kept.thread).update(created_at=old)
    Action.objects.filter(thread=kept.thread).update(created_at=old, finished_at=old)
    # A new request today keeps the thread alive.
    kept.run("fs.read", {"path": "README.md"}, {"path": "README.md", "content": "hi"})
    counts = retention_sweep_organization(organization=world.org, now=now)
    assert counts["threads"] == 0 and counts["events"] > 0 and counts["actions"] >= 2
    cutoff = now - timedelta(days=SETTINGS["events_days"])
    assert not ThreadEvent.objects.filter(thread=kept.thread, created_at__lt=cutoff).exists()
    remaining = list(Action.objects.filter(thread=kept.thread).values_list("tool", flat=True))
    assert remaining == ["fs.read"]
    replay = (
        world["owner"]
        .client()
        .get(
            f"/api/v1/orgs/acme/projects/{kept.project.public_id}"
            f"/threads/{kept.thread.public_id}/replay"
        )
        .json()
    )
    assert replay["first_sequence"] == replay["events"][0]["sequence"] > 1


def test_pending_calls_keep_their_thread(world, kept):
    thread = thread_create(
        actor=person(world["owner"]), project=kept.project, title="waiting", mode="agent"
    )
    from kestrel_one.execution.services import action_request

    action_request(actor=world.agent, thread=thread, tool="code.python", args={"code": "1"})
    counts = retention_sweep_organization(
        organization=world.org, now=timezone.now() + timedelta(days=11)
    )
    assert Thread.objects.filter(pk=thread.pk).exists()
    assert counts["threads"] >= 1  # the finished thread went


def test_the_sweep_covers_every_organization_with_its_own_settings(world, kept):
    later = timezone.now() + timedelta(days=100)
    swept = retention_sweep(now=later)
    assert set(swept) >= {"acme", "globex"}
    # Acme's thread, artifacts and checkpoint are all past retention; globex had nothing.
    assert not Artifact.objects.filter(organization=world.org).exists()
    assert sweeps(world.org).count() == 1
    assert not sweeps(world.other_org).exists()


def test_the_audit_chain_is_trimmed_by_the_audit_app_and_still_verifies(world, kept):
    from kestrel_one.audit import services as audit_services

    if not hasattr(audit_services, "audit_trim"):
        pytest.skip("the audit app offers no trim yet")
    from kestrel_one.audit.selectors import audit_chain_verify

    with tampering():  # the whole log ages at once
        AuditRecord.objects.filter(organization=world.org).update(
            created_at=timezone.now() - timedelta(days=400)
        )
    counts = retention_sweep_organization(organization=world.org, now=timezone.now())
    assert counts["audit_records"] > 0
    assert audit_chain_verify(world.org).ok


def test_admins_set_retention_and_everyone_else_only_reads(world):
    assert world["viewer"].client().get(URL).json() == {
        "events_days": 90,
        "artifacts_days": 90,
        "checkpoints_days": 30,
        "audit_days": 365,
    }
    for name in ("member", "viewer"):
        assert world[name].client().put(URL, SETTINGS, format="json").status_code == 403
    response = world["admin"].client().put(URL, SETTINGS, format="json")
    assert response.status_code == 200 and response.json() == SETTINGS
    record = AuditRecord.objects.get(organization=world.org, action="retention.update")
    assert record.data["after"] == SETTINGS
    for bad in ({**SETTINGS, "events_days": 0}, {**SETTINGS, "forever": True}, {"events_days": 5}):
        response = world["owner"].client().put(URL, bad, format="json")
        assert response.status_code == 400, bad
    assert world["outsider"].client().get(URL).status_code == 404


@pytest.mark.spec("AUD-7")
def test_an_auditor_reads_retention_but_cannot_change_it(world):
    if not hasattr(Role, "AUDITOR"):
        pytest.skip("no auditor role yet")
    from tests.conftest import make_person

    auditor = make_person(world.org, Role.AUDITOR, name="auditor")
    assert auditor.client().get(URL).status_code == 200
    assert auditor.client().put(URL, SETTINGS, format="json").status_code == 403
