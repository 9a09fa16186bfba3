"""The policy console (SURF-2): drafts, their diff, widenings, capped projects, the preview
against recorded decisions, explain, and publishing, through the pages and the services."""

from __future__ import annotations

import json

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from kestrel_one.accounts.principal import system_principal
from kestrel_one.audit.models import AuditRecord
from kestrel_one.common.errors import ValidationFailed
from kestrel_one.console.sudo import SESSION_KEY, sudo_stamp
from kestrel_one.execution.policy_preview import decisions_preview
from kestrel_one.execution.services import action_request
from kestrel_one.governance import drafts
from kestrel_one.governance.models import PolicyDraft, PolicyVersion
from kestrel_one.governance.services import (
    DraftChanged,
    PolicyWidens,
    policy_draft_publish,
    policy_draft_save,
    policy_publish_project,
)
from kestrel_one.tenancy.models import Environment, Project
from policies import parse_policy

ACTOR = system_principal("tests")
# The shared world's environment grants fs.write on src/** and out/** only.
WIDENING = {
    "capabilities": {
        "fs.read": {"paths": ["**"]},
        "fs.write": {"paths": ["src/**", "etc/**"]},
    }
}
NARROWING = {"capabilities": {"fs.read": {"paths": ["src/**"]}}}


def env_url(world, suffix: str = "") -> str:
    return f"/console/acme/environments/{world.environment.public_id}/policy{suffix}"


def prj_url(world, suffix: str = "") -> str:
    return f"/console/acme/projects/{world.project.public_id}/policy{suffix}"


def signed_in(user, *, sudo: bool = True) -> Client:
    client = Client()
    client.force_login(user)
    session = client.session
    if sudo:
        sudo_stamp(type("Request", (), {"session": session})())
    else:
        session.pop(SESSION_KEY, None)
    session.save()
    return client


def save(client, url: str, document) -> object:
    text = document if isinstance(document, str) else json.dumps(document, indent=2)
    return client.post(url, {"document": text})


# Drafts: validated as publishing validates, errors at their exact path.


@pytest.mark.spec("SURF-2")
def test_a_draft_with_errors_is_refused_naming_each_path(world):
    bad = {
        "capabilities": {
            "fs.read": {"paths": ["src/**", "/etc/passwd", "src/**"]},
            "net.http": {"allow": ["https://api.github.com:443"], "bogus": 1},
        }
    }
    with pytest.raises(ValidationFailed) as caught:
        policy_draft_save(actor=ACTOR, owner=world.project, text=json.dumps(bad))
    paths = {issue["path"] for issue in caught.value.details["issues"]}
    assert {
        "capabilities.fs.read.paths[1]",
        "capabilities.fs.read.paths[2]",
        "capabilities.net.http.bogus",
    } <= paths
    assert not PolicyDraft.objects.exists()

    owner = signed_in(world["owner"].user)
    response = save(owner, prj_url(world), bad)
    assert response.status_code == 400
    html = response.content.decode()
    assert "<code>capabilities.fs.read.paths[1]</code>" in html
    assert "<code>capabilities.net.http.bogus</code>" in html
    # The person's text stays in the editor, so nothing they typed is lost.
    assert "/etc/passwd" in html and 'aria-invalid="true"' in html


def test_repeated_keys_in_the_draft_text_are_refused_at_their_path(world):
    text = '{"capabilities": {"fs.read": {"paths": ["a/**"]}, "fs.read": {"paths": ["b/**"]}}}'
    with pytest.raises(ValidationFailed) as caught:
        policy_draft_save(actor=ACTOR, owner=world.project, text=text)
    assert [i["path"] for i in caught.value.details["issues"]] == ["capabilities.fs.read"]


def test_invalid_json_is_refused_with_where_it_broke(world):
    owner = signed_in(world["owner"].user)
    response = save(owner, prj_url(world), '{"capabilities": {')
    assert response.status_code == 400
    assert "is not valid JSON" in response.content.decode()


def test_saving_a_draft_is_audited_and_replaces_the_previous_one(world):
    owner = signed_in(world["owner"].user)
    assert save(owner, prj_url(world), WIDENING).status_code == 303
    assert save(owner, prj_url(world), NARROWING).status_code == 303
    draft = PolicyDraft.objects.get(project=world.project)
    assert draft.document == parse_policy(NARROWING).to_document()
    records = AuditRecord.objects.filter(
        action="policy.draft_save", target_id=world.project.public_id
    )
    assert records.count() == 2
    assert records.order_by("pk").last().data["sha256"] == draft.sha256
    # Nothing was published by saving.
    assert world.project.policy_version is None
    assert not PolicyVersion.objects.filter(project=world.project).exists()


# The diff.


def test_the_diff_is_a_line_diff_of_the_canonical_pretty_documents():
    published = parse_policy(
        {"capabilities": {"fs.read": {"paths": ["**"]}, "code.exec": {}}}
    ).to_document()
    draft = parse_policy({"capabilities": {"fs.read": {"paths": ["src/**"]}}}).to_document()
    lines = drafts.policy_diff(published, draft)
    added = [line.text for line in lines if line.kind == "add"]
    deleted = [line.text for line in lines if line.kind == "del"]
    assert '+        "src/**"' in added
    assert '-        "**"' in deleted
    assert any('"code.exec"' in text for text in deleted)
    assert lines[0].kind == "hunk"
    assert drafts.policy_diff(published, published) == []
    # Against nothing published, every line is added.
    assert {line.kind for line in drafts.policy_diff(None, draft)} == {"hunk", "add"}


def test_the_editor_renders_the_diff_with_add_and_del_classes(world):
    owner = signed_in(world["owner"].user)
    save(owner, env_url(world), {"capabilities": {"fs.read": {"paths": ["docs/**"]}}})
    html = owner.get(env_url(world)).content.decode()
    assert '<span class="diff-line diff-add">+        &quot;docs/**&quot;</span>' in html
    assert '<span class="diff-line diff-del">-        &quot;**&quot;</span>' in html


# Widenings and capped projects.


@pytest.mark.spec("SURF-2", "POL-2")
def test_a_project_draft_names_every_widening_and_publishing_it_is_refused(world):
    owner = signed_in(world["owner"].user)
    save(owner, prj_url(world), WIDENING)
    draft = PolicyDraft.objects.get(project=world.project)
    project = Project.objects.select_related("environment__policy_version").get(pk=world.project.pk)
    found = drafts.project_draft_widenings(project, drafts.draft_policy(draft))
    assert [(w.path, "etc/**" in w.message) for w in found] == [
        ("capabilities.fs.write.paths[1]", True)
    ]
    page = owner.get(prj_url(world)).content.decode()
    assert "would widen its environment in 1 place" in page
    assert "<code>capabilities.fs.write.paths[1]</code>" in page

    # Publishing refuses exactly those, through the publish service.
    with pytest.raises(PolicyWidens) as caught:
        policy_publish_project(actor=ACTOR, project=world.project, document=WIDENING)
    assert [w["path"] for w in caught.value.details["widenings"]] == [w.path for w in found]
    response = owner.post(prj_url(world, "/publish"), {"draft_sha256": draft.sha256})
    assert response.status_code == 400
    refused = response.content.decode()
    assert "would widen its environment" in refused
    assert "<code>capabilities.fs.write.paths[1]</code>" in refused
    assert not PolicyVersion.objects.filter(project=world.project).exists()
    assert PolicyDraft.objects.filter(project=world.project).exists(), "the draft is kept"


@pytest.mark.spec("SURF-2", "POL-3")
def test_an_environment_draft_names_the_projects_it_would_cap(world):
    policy_publish_project(
        actor=ACTOR,
        project=world.project,
        document={"capabilities": {"fs.write": {"paths": ["src/**"]}}},
    )
    ceiling = parse_policy({"capabilities": {"fs.write": {"paths": ["src/app/**"]}}})
    projects = list(world.environment.projects.select_related("policy_version").order_by("name"))
    capped, inheriting = drafts.projects_capped(projects, ceiling)
    assert [entry.project for entry in capped] == [world.project]
    assert capped[0].widenings[0].path == "capabilities.fs.write.paths[0]"
    assert inheriting == [world.other_project]

    owner = signed_in(world["owner"].user)
    save(owner, env_url(world), ceiling.to_document())
    html = owner.get(env_url(world)).content.decode()
    assert "1 of the 2 projects you can see" in html
    assert f"/projects/{world.project.public_id}/policy" in html


# Publishing.


@pytest.mark.spec("SURF-2")
def test_publishing_a_draft_in_sudo_mode_makes_a_version_and_drops_the_draft(world):
    owner = signed_in(world["owner"].user)
    save(owner, prj_url(world), NARROWING)
    draft = PolicyDraft.objects.get(project=world.project)

    stale = signed_in(world["owner"].user, sudo=False)
    response = stale.post(prj_url(world, "/publish"), {"draft_sha256": draft.sha256})
    assert response.status_code == 303 and response["Location"].startswith("/console/sudo?")
    assert not PolicyVersion.objects.filter(project=world.project).exists()

    response = owner.post(prj_url(world, "/publish"), {"draft_sha256": draft.sha256})
    assert response.status_code == 303, response.content
    version = PolicyVersion.objects.get(project=world.project)
    assert version.sha256 == draft.sha256
    assert version.created_by == world["owner"].user.public_id
    assert not PolicyDraft.objects.filter(project=world.project).exists()
    page = owner.get(prj_url(world) + "?done=published").content.decode()
    assert version.public_id in page and world["owner"].user.email in page


def test_a_draft_saved_again_since_the_page_was_loaded_is_not_published(world):
    policy_draft_save(actor=ACTOR, owner=world.project, text=json.dumps(NARROWING))
    with pytest.raises(DraftChanged):
        policy_draft_publish(actor=ACTOR, owner=world.project, expected_sha256="0" * 64)
    owner = signed_in(world["owner"].user)
    response = owner.post(prj_url(world, "/publish"), {"draft_sha256": "0" * 64})
    assert response.status_code == 409
    assert "saved again since you loaded this page" in response.content.decode()
    assert not PolicyVersion.objects.filter(project=world.project).exists()


def test_a_viewer_reads_the_policy_page_without_write_forms(world):
    policy_draft_save(actor=ACTOR, owner=world.project, text=json.dumps(NARROWING))
    viewer = signed_in(world["viewer"].user)
    html = viewer.get(prj_url(world)).content.decode()
    main = html.split("</header>", 1)[1]
    assert 'method="post"' not in main
    assert "What the draft grants" in main
    assert viewer.post(prj_url(world), {"document": "{}"}).status_code == 403


# Preview against history.


def recorded_reads(world, paths) -> list:
    return [
        action_request(actor=world.agent, thread=world.thread, tool="fs.read", args={"path": p})
        for p in paths
    ]


@pytest.mark.spec("SURF-2")
def test_the_preview_lists_the_decisions_a_narrowing_draft_would_change(world):
    inside, outside = recorded_reads(world, ["src/main.py", "docs/guide.md"])
    assert inside.decision["outcome"] == outside.decision["outcome"] == "allow"
    preview = decisions_preview(
        principal=system_principal("tests"),
        organization=world.org,
        days=14,
        limit=100,
        project=world.project,
        project_draft=parse_policy(NARROWING),
    )
    changed = {change.action.public_id: change for change in preview.changed}
    assert outside.public_id in changed and inside.public_id not in changed
    assert (changed[outside.public_id].recorded, changed[outside.public_id].draft) == (
        "allow",
        "deny",
    )
    # The recorded README read is denied too, and the shell call needing approval is now
    # denied (the draft has no shell.exec).
    assert world.finished_action.public_id in changed
    assert changed[world.action.public_id].recorded == "needs_approval"
    assert preview.changed_count == len(changed) == 3
    assert preview.considered == 4 and not preview.truncated

    owner = signed_in(world["owner"].user)
    save(owner, prj_url(world), NARROWING)
    html = owner.get(prj_url(world, "/preview")).content.decode()
    assert "<strong>3</strong> of 4 recorded decisions" in html
    assert outside.public_id in html and inside.public_id not in html


def test_the_preview_is_bounded_by_the_setting_and_by_the_window(world, settings):
    recorded_reads(world, ["docs/a.md", "docs/b.md"])
    settings.KESTREL_POLICY_PREVIEW_MAX_ACTIONS = 2
    owner = signed_in(world["owner"].user)
    save(owner, prj_url(world), NARROWING)
    html = owner.get(prj_url(world, "/preview")).content.decode()
    assert "Only the newest 2 actions were replayed" in html
    preview = decisions_preview(
        principal=system_principal("tests"),
        organization=world.org,
        days=14,
        limit=2,
        project=world.project,
        project_draft=parse_policy(NARROWING),
    )
    assert preview.considered == 2 and preview.truncated


def test_an_environment_draft_preview_replays_its_projects_with_their_own_policies(world):
    recorded_reads(world, ["out/report.txt"])
    # The environment keeps reads of everything but the draft grants only src/**.
    ceiling = {"capabilities": {"fs.read": {"paths": ["src/**"]}}}
    preview = decisions_preview(
        principal=system_principal("tests"),
        organization=world.org,
        days=14,
        limit=100,
        environment=world.environment,
        environment_draft=parse_policy(ceiling),
    )
    tools = sorted(change.action.tool for change in preview.changed)
    assert tools == ["fs.read", "fs.read", "shell.exec"]


def test_the_preview_shows_redacted_arguments_only(world):
    secret = "sk-live-canary-9f8e7d6c5b4a39281706"
    action = action_request(
        actor=world.agent,
        thread=world.thread,
        tool="shell.exec",
        args={"argv": ["make", "deploy"], "env": {"API_KEY": secret}},
    )
    assert action.sealed_args, "awaiting approval: the exact arguments are kept sealed"
    owner = signed_in(world["owner"].user)
    save(owner, prj_url(world), NARROWING)
    html = owner.get(prj_url(world, "/preview")).content.decode()
    assert action.public_id in html
    assert secret not in html


def test_the_preview_leaves_out_projects_the_person_cannot_see(world):
    limited = signed_in(world["limited"].user)
    save(signed_in(world["owner"].user), env_url(world), NARROWING)
    html = limited.get(env_url(world, "/preview")).content.decode()
    assert world.finished_action.public_id not in html  # it is in launchpad, not theirs
    assert "of 0 recorded decisions" in html


# Explain.


@pytest.mark.spec("SURF-2", "POL-6")
def test_explain_judges_a_call_under_the_published_policy_and_under_the_draft(world):
    owner = signed_in(world["owner"].user)
    save(owner, prj_url(world), NARROWING)
    query = {"tool": "fs.read", "args": json.dumps({"path": "docs/x.md"}), "mode": "agent"}
    html = owner.get(prj_url(world, "/explain"), query).content.decode()
    published, draft = html.split("Under the draft", 1)
    assert (
        "Allowed" in published and "path &#x27;docs/x.md&#x27; matches &#x27;**&#x27;" in published
    )
    assert "Denied" in draft and "matches none of" in draft
    assert "prj:draft" in draft

    fragment = owner.get(prj_url(world, "/explain"), query, HTTP_HX_REQUEST="true")
    assert fragment.status_code == 200 and "<html" not in fragment.content.decode()
    # Same judgement as the API's explain of a call from the console (the console judges on
    # its own surface).
    api = (
        world["owner"]
        .client()
        .post(
            f"/api/v1/orgs/acme/projects/{world.project.public_id}/explain",
            {
                "tool": "fs.read",
                "args": {"path": "docs/x.md"},
                "mode": "agent",
                "surface": "console",
            },
            format="json",
        )
    )
    assert api.json()["decision"] == "allow" and api.json()["policy_version"] in published


def test_explain_in_ask_mode_names_the_mode(world):
    owner = signed_in(world["owner"].user)
    query = {"tool": "fs.write", "args": json.dumps({"path": "src/a", "content": "x"})}
    html = owner.get(prj_url(world, "/explain"), {**query, "mode": "ask"}).content.decode()
    assert "not available in ask mode" in html


def test_explain_errors_name_the_field(world):
    owner = signed_in(world["owner"].user)
    bad_json = owner.get(prj_url(world, "/explain"), {"tool": "fs.read", "args": "{"})
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.content.decode()
    unknown = owner.get(prj_url(world, "/explain"), {"tool": "fs.reed", "args": "{}"})
    assert unknown.status_code == 400 and "did you mean" in unknown.content.decode()


def test_explain_on_an_environment_page_takes_one_of_its_projects(world):
    owner = signed_in(world["owner"].user)
    save(owner, env_url(world), NARROWING)
    query = {"tool": "fs.read", "args": json.dumps({"path": "docs/x.md"}), "mode": "agent"}
    inherit = owner.get(env_url(world, "/explain"), query).content.decode()
    assert "env:draft" in inherit and "Denied" in inherit.split("Under the draft", 1)[1]
    chosen = owner.get(
        env_url(world, "/explain"), {**query, "project": world.project.public_id}
    ).content.decode()
    assert "Allowed" in chosen.split("Under the draft", 1)[0]
    foreign = owner.get(
        env_url(world, "/explain"), {**query, "project": world.foreign_project.public_id}
    )
    assert foreign.status_code == 400
    assert "globex" not in foreign.content.decode()


# Query counts.


def test_the_policy_page_query_count_does_not_grow_with_history(world):
    owner = signed_in(world["owner"].user)
    save(owner, prj_url(world), NARROWING)
    owner.get(prj_url(world))  # warm caches (content types, sessions)

    def count() -> int:
        with CaptureQueriesContext(connection) as queries:
            assert owner.get(prj_url(world)).status_code == 200
        return len(queries)

    policy_publish_project(actor=ACTOR, project=world.project, document=NARROWING)
    few = count()
    for index in range(12):
        document = {"capabilities": {"fs.read": {"paths": [f"src/{index}/**"]}}}
        policy_publish_project(actor=ACTOR, project=world.project, document=document)
    many = count()
    assert many == few, (few, many)
    html = owner.get(prj_url(world)).content.decode()
    assert html.count("<tr><td><code>pol_") == 13


def test_the_index_lists_environments_and_projects_with_their_versions(world):
    html = signed_in(world["viewer"].user).get("/console/acme/policy").content.decode()
    environment = Environment.objects.select_related("policy_version").get(pk=world.environment.pk)
    assert environment.policy_version.public_id in html
    assert "inherits the environment" in html
    assert "launchpad" in html and "hangar" in html
    limited = signed_in(world["limited"].user).get("/console/acme/policy").content.decode()
    assert "hangar" in limited and "launchpad" not in limited


def queries_for(client, url: str) -> int:
    with CaptureQueriesContext(connection) as queries:
        assert client.get(url).status_code == 200
    return len(queries)


def test_the_preview_query_count_does_not_grow_with_the_recorded_actions(world):
    owner = signed_in(world["owner"].user)
    save(owner, prj_url(world), NARROWING)
    owner.get(prj_url(world, "/preview"))
    few = queries_for(owner, prj_url(world, "/preview"))
    recorded_reads(world, [f"docs/{index}.md" for index in range(15)])
    many = queries_for(owner, prj_url(world, "/preview"))
    assert many == few, (few, many)
    assert (
        "<strong>17</strong> of 17 recorded decisions"
        in owner.get(prj_url(world, "/preview")).content.decode()
    )


def test_the_index_query_count_does_not_grow_with_the_projects(world):
    from tests.factories import ProjectFactory

    viewer = signed_in(world["viewer"].user)
    viewer.get("/console/acme/policy")
    few = queries_for(viewer, "/console/acme/policy")
    for index in range(10):
        project = ProjectFactory(
            organization=world.org, environment=world.environment, name=f"extra-{index}"
        )
        policy_publish_project(actor=ACTOR, project=project, document=NARROWING)
    many = queries_for(viewer, "/console/acme/policy")
    assert many == few, (few, many)


def test_a_draft_over_a_cap_names_the_list_and_the_setting(world):
    document = {"capabilities": {"fs.read": {"paths": [f"d{index}/**" for index in range(300)]}}}
    response = save(signed_in(world["owner"].user), prj_url(world), document)
    assert response.status_code == 400
    html = response.content.decode()
    assert "<code>capabilities.fs.read.paths</code>" in html
    assert "KESTREL_POLICY_MAX_PATHS" in html


def test_the_readable_view_names_what_each_capability_grants():
    policy = parse_policy(
        {
            "capabilities": {
                "fs.write": {"paths": ["src/**"], "approval": "always"},
                "shell.exec": {"commands": ["make"], "env": ["GH"], "limits": {"timeout_s": 30}},
                "net.http": {"allow": ["https://api.github.com:443"]},
                "mcp.call": {
                    "servers": {"github": {"tools": ["search", "merge"], "dangerous": ["merge"]}}
                },
            }
        }
    )
    views = {view.capability: view for view in drafts.grants_view(policy)}
    assert views["fs.write"].approval == "always"
    assert ("Paths", ["src/**"]) in views["fs.write"].fields
    shell = views["shell.exec"]
    assert ("Commands", ["make"]) in shell.fields
    assert ("Environment variables", ["GH"]) in shell.fields
    assert ("timeout_s", 30) in shell.limits and ("memory_mb", 2048) in shell.limits
    assert shell.modes.startswith("agent mode only")
    assert ("Hosts (origins)", ["https://api.github.com:443"]) in views["net.http"].fields
    assert views["net.http"].modes.startswith("every mode")
    assert ("MCP server github: tools", ["merge", "search", "merge (dangerous, opted in)"]) in (
        views["mcp.call"].fields
    )
    assert drafts.denied_capabilities(policy) == [
        "adapter.invoke",
        "code.exec",
        "fs.read",
        "model.invoke",
    ]


def test_the_preview_also_lists_decisions_a_draft_would_loosen(world):
    from tests.conftest import ENVIRONMENT_POLICY

    looser = json.loads(json.dumps(ENVIRONMENT_POLICY))
    looser["capabilities"]["shell.exec"]["approval"] = "never"
    preview = decisions_preview(
        principal=system_principal("tests"),
        organization=world.org,
        days=14,
        limit=100,
        environment=world.environment,
        environment_draft=parse_policy(looser),
    )
    assert [(c.action.public_id, c.recorded, c.draft) for c in preview.changed] == [
        (world.action.public_id, "needs_approval", "allow")
    ]
