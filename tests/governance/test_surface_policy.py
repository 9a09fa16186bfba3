"""Surface policies (POL-2): the surface term of Environment ∩ Project ∩ surface ∩ mode ∩ token
scope is the organization's published policy of that surface (api, console, mcp)."""

from __future__ import annotations

import pytest
from django.db import IntegrityError, transaction
from rest_framework.test import APIClient

from kestrel_one.accounts.principal import Principal, PrincipalKind, system_principal
from kestrel_one.accounts.services import token_create
from kestrel_one.audit.models import AuditRecord
from kestrel_one.execution.models import Action
from kestrel_one.execution.services import action_request, calls_sweep
from kestrel_one.governance.models import SurfacePolicyVersion
from kestrel_one.governance.selectors import effective_policy, policy_version_label
from kestrel_one.governance.services import surface_policy_publish
from kestrel_one.tenancy.bootstrap import agent_token_create
from kestrel_one.threads.services import thread_create
from policies import Mode
from tests.execution.test_actions_api import action_url

READS_ONLY = {"capabilities": {"fs.read": {"paths": ["**"]}}}
NO_SHELL = {
    "capabilities": {
        "fs.read": {"paths": ["**"]},
        "fs.write": {"paths": ["**"]},
    }
}


def surfaces_url(suffix: str = "") -> str:
    return f"/api/v1/orgs/acme/surfaces{suffix}"


def explain(world, tool: str, args: dict, **extra) -> dict:
    response = (
        world["owner"]
        .client()
        .post(
            f"/api/v1/orgs/acme/projects/{world.project.public_id}/explain",
            {"tool": tool, "args": args, **extra},
            format="json",
        )
    )
    assert response.status_code == 200, response.content
    return response.json()


def person(actor) -> Principal:
    return Principal(PrincipalKind.TOKEN, user=actor.user, token=actor.token)


def publish(world, surface: str, document: dict) -> SurfacePolicyVersion:
    return surface_policy_publish(
        actor=person(world["owner"]), organization=world.org, surface=surface, document=document
    )


@pytest.fixture
def broker(monkeypatch):
    """Records every command sent (the real broker is not needed to judge them)."""
    sent = []
    monkeypatch.setattr("kestrel_one.celery.app.send_task", lambda *a, **k: sent.append(a))
    return sent


# The meet.


@pytest.mark.spec("POL-2")
def test_without_a_surface_policy_every_surface_grants_what_the_api_does(world):
    for surface in ("api", "console", "mcp"):
        body = explain(world, "shell.exec", {"argv": ["make"]}, surface=surface)
        assert body["decision"] == "needs_approval", surface
        assert body["surface"] == surface
        assert body["surface_policy"] == {"name": surface, "version": None, "document": None}
        assert body["policy_version"].endswith(f"+surface:{surface}")


@pytest.mark.spec("POL-2")
def test_a_surface_policy_narrows_calls_through_that_surface_only(world):
    version = publish(world, "mcp", READS_ONLY)
    on_api = explain(world, "shell.exec", {"argv": ["make"]})
    assert on_api["decision"] == "needs_approval"
    assert on_api["surface"] == "api" and on_api["surface_policy"]["version"] is None

    on_mcp = explain(world, "shell.exec", {"argv": ["make"]}, surface="mcp")
    assert on_mcp["decision"] == "deny"
    assert on_mcp["reasons"][0] == (
        f"shell.exec is not granted by the mcp surface policy ({version.public_id})"
    )
    assert on_mcp["surface_policy"] == {
        "name": "mcp",
        "version": version.public_id,
        "document": version.document,
    }
    assert on_mcp["versions"]["surface"] == version.public_id
    # What the surface grants still meets the environment and project: no widening.
    read = explain(world, "fs.read", {"path": "README.md"}, surface="mcp")
    assert read["decision"] == "allow"


@pytest.mark.spec("POL-2")
def test_a_request_through_mcp_is_denied_naming_the_surface(world):
    version = publish(world, "mcp", READS_ONLY)
    thread = thread_create(actor=world.agent, project=world.project, title="t", mode="agent")
    args = {"argv": ["make", "test"]}
    on_api = action_request(actor=world.agent, thread=thread, tool="shell.exec", args=args)
    assert on_api.state == "awaiting_approval" and on_api.surface == "api"
    on_mcp = action_request(
        actor=world.agent, thread=thread, tool="shell.exec", args=args, surface="mcp"
    )
    assert on_mcp.state == "denied" and on_mcp.surface == "mcp"
    assert f"mcp surface policy ({version.public_id})" in on_mcp.decision["reasons"][0]
    assert on_mcp.policy_version.endswith(f"+surface:mcp@{version.public_id}")


@pytest.mark.spec("POL-2")
def test_a_surface_policy_that_limits_a_grant_says_so(world):
    version = publish(world, "console", {"capabilities": {"fs.read": {"paths": ["docs/**"]}}})
    body = explain(world, "fs.read", {"path": "src/a.py"}, surface="console")
    assert body["decision"] == "deny"
    assert body["reasons"][0].startswith(
        f"the console surface policy ({version.public_id}) does not allow this call: "
    )


@pytest.mark.spec("POL-2")
def test_effective_policy_takes_the_surface(world):
    publish(world, "mcp", READS_ONLY)
    url = f"/api/v1/orgs/acme/projects/{world.project.public_id}/effective-policy"
    client = world["owner"].client()
    api = client.get(url).json()
    mcp = client.get(url, {"surface": "mcp"}).json()
    assert "shell.exec" in api["document"]["capabilities"]
    assert set(mcp["document"]["capabilities"]) == {"fs.read"}
    assert mcp["surface"] == "mcp" and mcp["surface_policy"]["version"].startswith("spv_")
    unknown = client.get(url, {"surface": "fax"})
    assert unknown.status_code == 400
    assert unknown.json()["error"]["details"] == {"surface": ["one of api, console, mcp"]}


def test_explain_refuses_an_unknown_surface(world):
    response = (
        world["owner"]
        .client()
        .post(
            f"/api/v1/orgs/acme/projects/{world.project.public_id}/explain",
            {"tool": "fs.read", "args": {"path": "a"}, "surface": "telnet"},
            format="json",
        )
    )
    assert response.status_code == 400
    assert "Unknown surface 'telnet'" in response.json()["error"]["message"]


# Versions and labels.


@pytest.mark.spec("POL-2", "POL-6")
def test_the_label_names_the_surface_version_and_versions_are_immutable(world):
    before = policy_version_label(project=world.project, mode=Mode.AGENT, surface="mcp")
    assert before.endswith("+surface:mcp")
    first = publish(world, "mcp", READS_ONLY)
    assert publish(world, "mcp", READS_ONLY) == first, "the same document makes no new version"
    second = publish(world, "mcp", NO_SHELL)
    assert second.previous_id == first.pk and second.public_id.startswith("spv_")
    assert len(second.sha256) == 64
    label = policy_version_label(project=world.project, mode=Mode.AGENT, surface="mcp")
    assert label == before + f"@{second.public_id}"
    # The other surfaces keep their labels exactly.
    assert policy_version_label(project=world.project, mode=Mode.AGENT).endswith("+surface:api")

    with pytest.raises(ValueError, match="immutable"):
        second.save()
    for change in (
        lambda: SurfacePolicyVersion.objects.filter(pk=second.pk).update(document={}),
        lambda: SurfacePolicyVersion.objects.filter(pk=second.pk).delete(),
    ):
        with pytest.raises(IntegrityError), transaction.atomic():
            change()
    assert SurfacePolicyVersion.objects.get(pk=second.pk).document == second.document


def test_effective_policy_is_never_served_from_a_stale_cache(world):
    agent = world.agent
    wide = effective_policy(project=world.project, principal=agent, mode=Mode.AGENT, surface="mcp")
    assert "shell.exec" in wide.policy.capabilities
    publish(world, "mcp", READS_ONLY)
    narrow = effective_policy(
        project=world.project, principal=agent, mode=Mode.AGENT, surface="mcp"
    )
    assert narrow.policy.capabilities == {"fs.read"}
    publish(world, "mcp", NO_SHELL)
    again = effective_policy(project=world.project, principal=agent, mode=Mode.AGENT, surface="mcp")
    assert again.policy.capabilities == {"fs.read", "fs.write"}


# Narrowing a surface re-decides what waits (POL-3).


@pytest.mark.spec("POL-2", "POL-3")
def test_narrowing_a_surface_ends_an_awaiting_action_of_that_surface_denied(world, broker):
    thread = thread_create(actor=world.agent, project=world.project, title="t", mode="agent")
    args = {"argv": ["make", "deploy"]}
    through_mcp = action_request(
        actor=world.agent, thread=thread, tool="shell.exec", args=args, surface="mcp"
    )
    through_api = action_request(actor=world.agent, thread=thread, tool="shell.exec", args=args)
    assert through_mcp.state == through_api.state == "awaiting_approval"
    narrowed = publish(world, "mcp", NO_SHELL)

    admin = world["admin"].client()
    refused = admin.post(action_url(world, thread.public_id, through_mcp.public_id, "/approve"))
    assert refused.status_code == 409, refused.content
    through_mcp.refresh_from_db()
    assert through_mcp.state == "denied"
    assert through_mcp.error["code"] == "policy_denies"
    assert narrowed.public_id in through_mcp.error["message"]
    assert through_mcp.policy_version.endswith(f"+surface:mcp@{narrowed.public_id}")
    assert AuditRecord.objects.filter(action="action.redecide", outcome="deny").count() == 1

    # The API surface did not narrow: its action is approved as it was decided.
    approved = admin.post(action_url(world, thread.public_id, through_api.public_id, "/approve"))
    assert approved.status_code == 200, approved.content
    assert approved.json()["state"] == "queued"
    assert approved.json()["policy_version"] == through_api.policy_version


@pytest.mark.spec("POL-2", "POL-3")
def test_narrowing_a_surface_redecides_a_queued_action(world, broker):
    from datetime import timedelta

    from django.utils import timezone

    thread = thread_create(actor=world.agent, project=world.project, title="t", mode="agent")
    queued = action_request(
        actor=world.agent,
        thread=thread,
        tool="fs.write",
        args={"path": "src/a.py", "content": "x"},
        surface="mcp",
    )
    assert queued.state == "queued"
    # Its send was lost (the request's own send runs after commit, which a test never reaches).
    Action.objects.filter(pk=queued.pk).update(created_at=timezone.now() - timedelta(minutes=5))
    narrowed = publish(world, "mcp", READS_ONLY)
    assert calls_sweep()["redispatched"] == 0
    queued.refresh_from_db()
    assert queued.state == "denied" and queued.error["code"] == "policy_denies"
    assert f"mcp surface policy ({narrowed.public_id})" in queued.error["message"]
    assert broker == []


# The API.


@pytest.mark.spec("POL-2")
def test_an_admin_publishes_a_surface_policy_and_it_is_audited(world):
    admin = world["admin"].client()
    listed = admin.get(surfaces_url()).json()["surfaces"]
    assert [s["name"] for s in listed] == ["api", "console", "mcp"]
    assert all(s["version"] is None and s["grants_everything"] for s in listed)

    response = admin.put(surfaces_url("/mcp/policy"), READS_ONLY, format="json")
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["name"] == "mcp" and body["version"].startswith("spv_")
    assert body["document"] == {"capabilities": {"fs.read": {"approval": "never", "paths": ["**"]}}}
    assert not body["grants_everything"]
    assert body["created_by"] == world["admin"].token.public_id
    assert admin.get(surfaces_url("/mcp/policy")).json() == body
    listed = {s["name"]: s for s in admin.get(surfaces_url()).json()["surfaces"]}
    assert listed["mcp"]["version"] == body["version"] and listed["api"]["version"] is None

    record = AuditRecord.objects.get(action="surface_policy.publish")
    assert record.actor_id == world["admin"].token.public_id
    assert record.target_id == body["version"]
    assert record.data["surface"] == "mcp" and record.data["previous_version"] is None


@pytest.mark.spec("POL-2", "POL-5")
@pytest.mark.parametrize("name", ["member", "viewer", "limited"])
def test_members_without_the_scope_cannot_publish(world, name):
    response = world[name].client().put(surfaces_url("/mcp/policy"), READS_ONLY, format="json")
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "permission_denied"
    assert not SurfacePolicyVersion.objects.exists()
    assert world[name].client().get(surfaces_url("/mcp/policy")).status_code == 200


@pytest.mark.spec("POL-2", "POL-5")
def test_no_agent_can_publish_a_surface_policy(world, settings):
    # Like an environment policy: only with policies:write, which an agent never holds. An
    # integration an owner gave the scope on purpose (a policy bot) may; one without may not.
    for scopes, status in ((["org:read", "projects:write"], 403), (["policies:write"], 200)):
        _, integration = token_create(
            actor=system_principal("tests"),
            organization=world.org,
            name="ci",
            scopes=scopes,
            integration=True,
        )
        client = APIClient(REMOTE_ADDR="203.0.113.7", HTTP_AUTHORIZATION=f"Bearer {integration}")
        response = client.put(surfaces_url("/mcp/policy"), READS_ONLY, format="json")
        assert response.status_code == status, response.content
    published = SurfacePolicyVersion.objects.count()
    assert published == 1

    settings.SINGLE_HOST = True
    settings.KESTREL_SERVER_TOKEN = ""
    agent = APIClient(
        REMOTE_ADDR="127.0.0.1",
        HTTP_AUTHORIZATION=f"Bearer {agent_token_create(org_slug='acme')}",
    )
    for client in (agent, APIClient(REMOTE_ADDR="127.0.0.1")):
        response = client.put(surfaces_url("/mcp/policy"), READS_ONLY, format="json")
        assert response.status_code == 403, response.content
    assert SurfacePolicyVersion.objects.count() == published


@pytest.mark.spec("POL-2")
def test_a_malformed_surface_policy_is_refused_at_its_path(world):
    document = {"capabilities": {"fs.read": {"paths": ["src/**", 7]}, "teleport": {}}}
    response = world["owner"].client().put(surfaces_url("/mcp/policy"), document, format="json")
    assert response.status_code == 400
    paths = {issue["path"] for issue in response.json()["error"]["details"]["issues"]}
    assert "capabilities.fs.read.paths[1]" in paths
    assert "capabilities.teleport" in paths
    assert not SurfacePolicyVersion.objects.exists()


def test_an_unknown_surface_is_a_404_naming_the_surfaces(world):
    owner = world["owner"].client()
    for response in (
        owner.get(surfaces_url("/fax/policy")),
        owner.put(surfaces_url("/fax/policy"), READS_ONLY, format="json"),
    ):
        assert response.status_code == 404
        error = response.json()["error"]
        assert error["code"] == "not_found"
        assert "the surfaces are api, console, mcp" in error["message"]


@pytest.mark.spec("POL-2", "TEN-1")
def test_another_organization_sees_and_changes_nothing(world):
    publish(world, "mcp", READS_ONLY)
    outsider = world["outsider"].client()
    assert outsider.get(surfaces_url()).status_code == 404
    assert outsider.get(surfaces_url("/mcp/policy")).status_code == 404
    put = outsider.put(surfaces_url("/mcp/policy"), NO_SHELL, format="json")
    assert put.status_code == 404
    own = outsider.get("/api/v1/orgs/globex/surfaces/mcp/policy").json()
    assert own["version"] is None, "acme's surface policy is acme's alone"
    assert SurfacePolicyVersion.objects.count() == 1
