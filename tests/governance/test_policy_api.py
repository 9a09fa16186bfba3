"""Publishing policies, narrowing, effective policy, explain and the tool inventory over HTTP."""

from __future__ import annotations

import pytest

from kestrel_one.audit.models import AuditRecord
from kestrel_one.governance import api as governance_api
from kestrel_one.governance.models import PolicyVersion
from runners.contract.registry import TOOLS


def env_url(world) -> str:
    return f"/api/v1/orgs/acme/environments/{world.environment.public_id}/policy"


def prj_url(world, suffix: str = "policy") -> str:
    return f"/api/v1/orgs/acme/projects/{world.project.public_id}/{suffix}"


def explain(client, world, tool: str, args: dict, mode: str = "agent") -> dict:
    response = client.post(
        prj_url(world, "explain"), {"tool": tool, "args": args, "mode": mode}, format="json"
    )
    assert response.status_code == 200, response.content
    return response.json()


@pytest.mark.spec("POL-2")
def test_project_widening_is_rejected_naming_every_widening(world):
    owner = world["owner"].client()
    document = {
        "capabilities": {
            "fs.write": {"paths": ["src/**", "etc/**"]},
            "net.http": {"allow": ["https://api.github.com:443", "https://evil.example.com:443"]},
            "mcp.call": {"servers": {"github": {"tools": ["search"]}}},
        }
    }
    response = owner.put(prj_url(world), document, format="json")
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "policy_widens"
    paths = {w["path"] for w in error["details"]["widenings"]}
    assert "capabilities.fs.write.paths[1]" in paths
    assert "capabilities.net.http.allow[1]" in paths
    assert any(p.startswith("capabilities.mcp.call") for p in paths)
    assert len(paths) == 3
    assert "etc/**" in error["message"]
    assert not PolicyVersion.objects.filter(project=world.project).exists()


@pytest.mark.spec("POL-2", "POL-6")
def test_project_can_narrow_and_versions_are_recorded(world):
    owner = world["owner"].client()
    narrow = {"capabilities": {"fs.read": {"paths": ["src/**"]}, "fs.write": {"paths": ["src/**"]}}}
    published = owner.put(prj_url(world), narrow, format="json")
    assert published.status_code == 200, published.content
    body = published.json()
    assert body["version"].startswith("pol_") and len(body["sha256"]) == 64
    again = owner.put(prj_url(world), narrow, format="json").json()
    assert again["version"] == body["version"], "publishing the same document makes no new version"
    record = AuditRecord.objects.filter(
        action="policy.publish", target_id=world.project.public_id
    ).get()
    assert record.data["sha256"] == body["sha256"] and record.data["previous_sha256"] is None

    decision = explain(owner, world, "fs.write", {"path": "src/app.py", "content": "x"})
    assert decision["decision"] == "allow"
    assert decision["versions"]["project"] == body["version"]
    assert body["version"] in decision["policy_version"]
    denied = explain(owner, world, "fs.write", {"path": "out/report.txt", "content": "x"})
    assert denied["decision"] == "deny"
    assert any("out/report.txt" in reason for reason in denied["reasons"])


@pytest.mark.spec("POL-6")
def test_policy_versions_are_immutable(world):
    version = PolicyVersion.objects.filter(environment=world.environment).get()
    version.document = {"capabilities": {}}
    with pytest.raises(ValueError, match="immutable"):
        version.save()


@pytest.mark.spec("POL-3", "TEN-4")
def test_environment_narrowing_narrows_projects_at_once(world):
    owner = world["owner"].client()
    assert (
        owner.put(
            prj_url(world), {"capabilities": {"fs.write": {"paths": ["src/**"]}}}, format="json"
        ).status_code
        == 200
    )
    assert (
        explain(owner, world, "fs.write", {"path": "src/a.py", "content": ""})["decision"]
        == "allow"
    )

    narrower = {"capabilities": {"fs.read": {"paths": ["**"]}}}
    published = owner.put(env_url(world), narrower, format="json")
    assert published.status_code == 200
    exceeding = published.json()["projects_exceeding"]
    assert [e["project"] for e in exceeding] == [world.project.public_id]
    # Only the projects the caller may see: a member limited to another project, who reads
    # this policy with org:read, used to get this one's id and its policy's paths too.
    limited = world["limited"].client()
    assert limited.get(f"/api/v1/orgs/acme/projects/{world.project.public_id}").status_code == 404
    hidden = limited.get(env_url(world))
    assert hidden.status_code == 200 and hidden.json()["projects_exceeding"] == []

    # The very next request sees the narrower ceiling: no cache keeps fs.write alive.
    decision = explain(owner, world, "fs.write", {"path": "src/a.py", "content": ""})
    assert decision["decision"] == "deny"
    effective = owner.get(prj_url(world, "effective-policy")).json()
    assert "fs.write" not in effective["document"]["capabilities"]
    shown = owner.get(prj_url(world)).json()
    assert shown["exceeds_environment"] and shown["exceeds_environment"][0]["path"].startswith(
        "capabilities.fs.write"
    )


@pytest.mark.spec("POL-3")
def test_the_projects_an_environment_exceeds_are_named_to_a_bound(world, monkeypatch):
    owner = world["owner"].client()
    wide = {"capabilities": {"fs.write": {"paths": ["src/**"]}}}
    for project in (world.project, world.other_project):
        url = f"/api/v1/orgs/acme/projects/{project.public_id}/policy"
        assert owner.put(url, wide, format="json").status_code == 200
    monkeypatch.setattr(governance_api, "PROJECTS_EXCEEDING_MAX", 1)
    narrower = {"capabilities": {"fs.read": {"paths": ["**"]}}}
    published = owner.put(env_url(world), narrower, format="json").json()
    first = min(world.project.public_id, world.other_project.public_id)
    assert [e["project"] for e in published["projects_exceeding"]] == [first]
    assert published["projects_exceeding_more"] is True
    monkeypatch.setattr(governance_api, "PROJECTS_EXCEEDING_MAX", 2)
    read = owner.get(env_url(world)).json()
    assert len(read["projects_exceeding"]) == 2 and read["projects_exceeding_more"] is False


@pytest.mark.spec("POL-4")
@pytest.mark.parametrize("mode", ["ask", "plan", "auto"])
@pytest.mark.parametrize(
    "tool,args",
    [
        ("fs.write", {"path": "src/a.py", "content": "x"}),
        ("fs.delete", {"path": "src/a.py"}),
        ("shell.exec", {"argv": ["ls"]}),
        ("code.python", {"code": "print(1)"}),
    ],
)
def test_read_only_modes_never_allow_writes_or_execution(world, mode, tool, args):
    decision = explain(world["owner"].client(), world, tool, args, mode=mode)
    assert decision["decision"] == "deny", decision
    agent = explain(world["owner"].client(), world, tool, args, mode="agent")
    assert agent["decision"] in {"allow", "needs_approval"}, "agent mode keeps the policy"


@pytest.mark.spec("POL-4")
@pytest.mark.parametrize("mode", ["ask", "plan", "auto"])
def test_read_only_modes_keep_reads(world, mode):
    decision = explain(world["owner"].client(), world, "fs.read", {"path": "src/a.py"}, mode=mode)
    assert decision["decision"] == "allow"
    effective = (
        world["owner"].client().get(prj_url(world, "effective-policy") + f"?mode={mode}").json()
    )
    assert set(effective["document"]["capabilities"]) == {"fs.read", "net.http"}


def test_shell_needs_approval_and_explains_why(world):
    decision = explain(world["owner"].client(), world, "shell.exec", {"argv": ["make", "test"]})
    assert decision["decision"] == "needs_approval"
    assert decision["limits"]["timeout_s"] == 60
    assert "approval" in decision["explanation"]


def test_token_scope_takes_part(world):
    # A viewer's token cannot request actions (no projects:write): everything is denied.
    decision = explain(world["viewer"].client(), world, "fs.read", {"path": "README.md"})
    assert decision["decision"] == "deny"
    effective = world["viewer"].client().get(prj_url(world, "effective-policy")).json()
    assert effective["document"]["capabilities"] == {}


def test_requested_limit_above_ceiling_is_denied(world):
    decision = explain(
        world["owner"].client(), world, "shell.exec", {"argv": ["ls"], "timeout_s": 120}
    )
    assert decision["decision"] == "deny"
    assert any("timeout_s" in reason for reason in decision["reasons"])


@pytest.mark.parametrize(
    "body,field",
    [
        ({"tool": "root.shell", "args": {}}, "tool"),
        ({"tool": "fs.read", "args": {}}, "args.path"),
        ({"tool": "fs.read", "args": {"path": "../etc/passwd"}}, "args.path"),
        ({"tool": "shell.exec", "args": {"argv": []}}, "args.argv"),
        ({"tool": "fs.read", "args": {"path": "a"}, "mode": "god"}, "mode"),
        ({"tool": "fs.read", "args": {"path": "a"}, "grant": "all"}, "grant"),
    ],
)
def test_explain_refuses_bad_input_naming_the_field(world, body, field):
    response = world["owner"].client().post(prj_url(world, "explain"), body, format="json")
    assert response.status_code == 400
    assert field in response.json()["error"]["details"]


def test_malformed_policy_names_the_exact_path(world):
    document = {
        "capabilities": {
            "net.http": {"allow": ["https://a.example.com:443", "https://*.example.com:443"]}
        }
    }
    response = world["owner"].client().put(env_url(world), document, format="json")
    assert response.status_code == 400
    issues = response.json()["error"]["details"]["issues"]
    assert [i["path"] for i in issues] == ["capabilities.net.http.allow[1]"]


def test_a_dangerous_opt_in_that_is_no_name_is_a_400_at_its_path(world):
    """Not a 500: an opt-in list may hold anything JSON does, and the parser reports each
    item that is no name at its place instead of comparing it with the server's tools."""
    document = {
        "capabilities": {
            "mcp.call": {"servers": {"github": {"tools": ["a"], "dangerous": ["a", ["b"]]}}}
        }
    }
    response = world["owner"].client().put(env_url(world), document, format="json")
    assert response.status_code == 400, response.content
    issues = response.json()["error"]["details"]["issues"]
    assert [i["path"] for i in issues] == ["capabilities.mcp.call.servers.github.dangerous[1]"]


def test_environment_without_policy_grants_nothing(world):
    response = (
        world["owner"]
        .client()
        .get(f"/api/v1/orgs/acme/environments/{world.empty_environment.public_id}/policy")
    )
    assert response.json()["version"] is None
    assert response.json()["document"] == {"capabilities": {}}


@pytest.mark.spec("POL-7", "EXT-1")
def test_inventory_lists_every_registered_tool_with_capability_and_schema(world):
    response = world["viewer"].client().get("/api/v1/tools")
    assert response.status_code == 200
    tools = {t["name"]: t for t in response.json()["tools"]}
    assert set(tools) == set(TOOLS)
    assert {"shell.exec", "fs.read", "fs.write", "fs.list", "fs.delete", "code.python"} <= set(
        tools
    )
    for name, spec in TOOLS.items():
        assert tools[name]["capability"] == spec.capability
        assert tools[name]["input_schema"]["additionalProperties"] is False
    assert tools["fs.delete"]["capability"] == "fs.write"
    assert tools["code.python"]["capability"] == "code.exec"


@pytest.mark.spec("EXT-1")
def test_tools_cannot_be_added_at_run_time():
    with pytest.raises(TypeError):
        TOOLS["evil.tool"] = TOOLS["fs.read"]


def test_repeated_keys_in_a_policy_body_are_refused(world):
    body = '{"capabilities": {"fs.read": {"paths": ["src/**"]}, "fs.read": {"paths": ["**"]}}}'
    response = world["owner"].client().put(env_url(world), body, content_type="application/json")
    assert response.status_code == 400
    # The API's one parser refuses it, naming the key, as for every other body.
    assert response.json()["error"]["details"] == {
        "capabilities.fs.read": ["is given twice; a JSON object may name each key once"]
    }
