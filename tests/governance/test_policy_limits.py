"""Policy documents are capped at the API, and shell.exec's env overlay is judged by name.

A document over a cap (its bytes, or any list in it) is refused on both PUT routes with
``400 policy_too_large`` naming the field, the limit and the setting that holds it, before
the engine does any work proportional to the oversized part. The env overlay attack
(``LD_PRELOAD`` under a policy allowing only ``ls``) is denied when requested and explained.
"""

from __future__ import annotations

import pytest

from kestrel_one.execution.models import Action
from kestrel_one.governance.models import PolicyVersion

ATTACK = {"argv": ["ls"], "env": {"LD_PRELOAD": "/workspace/evil.so"}}
ONLY_LS = {"capabilities": {"shell.exec": {"commands": ["ls"]}}}


def env_url(world) -> str:
    return f"/api/v1/orgs/acme/environments/{world.environment.public_id}/policy"


def prj_url(world, suffix: str = "policy") -> str:
    return f"/api/v1/orgs/acme/projects/{world.project.public_id}/{suffix}"


def paths(count: int) -> dict:
    return {"capabilities": {"fs.read": {"paths": [f"dir{i}/**" for i in range(count)]}}}


def refused_as_too_large(response) -> dict:
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["code"] == "policy_too_large", error
    return error


@pytest.fixture
def broker(monkeypatch):
    sent = []
    monkeypatch.setattr("kestrel_one.celery.app.send_task", lambda *a, **k: sent.append(a))
    return sent


@pytest.mark.spec("POL-1")
def test_an_environment_policy_over_the_paths_cap_is_refused_naming_field_and_limit(world):
    owner = world["owner"].client()
    before = PolicyVersion.objects.filter(environment=world.environment).count()
    assert owner.put(env_url(world), paths(256), format="json").status_code == 200
    error = refused_as_too_large(owner.put(env_url(world), paths(257), format="json"))
    assert error["details"] == {
        "field": "capabilities.fs.read.paths",
        "limit": 256,
        "actual": 257,
        "setting": "KESTREL_POLICY_MAX_PATHS",
    }
    assert "capabilities.fs.read.paths has 257 items; at most 256" in error["message"]
    assert "KESTREL_POLICY_MAX_PATHS" in error["message"]
    assert PolicyVersion.objects.filter(environment=world.environment).count() == before + 1


@pytest.mark.spec("POL-1")
def test_a_project_policy_over_a_cap_is_refused_too(world, settings):
    settings.KESTREL_POLICY_LIMITS = {**settings.KESTREL_POLICY_LIMITS, "commands": 2}
    owner = world["owner"].client()
    document = {"capabilities": {"shell.exec": {"commands": ["git", "make", "ls"]}}}
    error = refused_as_too_large(owner.put(prj_url(world), document, format="json"))
    assert error["details"]["field"] == "capabilities.shell.exec.commands"
    assert error["details"]["setting"] == "KESTREL_POLICY_MAX_COMMANDS"
    assert error["details"]["limit"] == 2
    assert not PolicyVersion.objects.filter(project=world.project).exists()


@pytest.mark.spec("POL-1")
@pytest.mark.parametrize("url", [env_url, prj_url])
def test_the_document_bytes_are_capped_on_both_routes(world, settings, url):
    settings.KESTREL_POLICY_LIMITS = {**settings.KESTREL_POLICY_LIMITS, "bytes": 1024}
    document = {"capabilities": {"fs.read": {"paths": ["src/**"]}}, "description": "x" * 1200}
    error = refused_as_too_large(world["owner"].client().put(url(world), document, format="json"))
    assert error["details"]["field"] == "(document)"
    assert error["details"]["setting"] == "KESTREL_POLICY_MAX_BYTES"
    assert error["details"]["limit"] == 1024 and error["details"]["actual"] > 1024
    assert "bytes" in error["message"]


def publish_environment(world, document: dict) -> None:
    response = world["owner"].client().put(env_url(world), document, format="json")
    assert response.status_code == 200, response.content


@pytest.mark.spec("POL-1", "POL-6")
def test_the_env_overlay_attack_is_denied_and_explained_naming_the_variable(world, broker):
    publish_environment(world, ONLY_LS)
    owner = world["owner"].client()
    explained = owner.post(
        prj_url(world, "explain"), {"tool": "shell.exec", "args": ATTACK}, format="json"
    ).json()
    assert explained["decision"] == "deny"
    assert any("'LD_PRELOAD'" in reason for reason in explained["reasons"])
    plain = owner.post(
        prj_url(world, "explain"),
        {"tool": "shell.exec", "args": {"argv": ["ls"], "env": {"LANG": "C"}}},
        format="json",
    ).json()
    assert plain["decision"] == "allow", plain

    threads = f"/api/v1/orgs/acme/projects/{world.project.public_id}/threads"
    thread = owner.post(threads, {"title": "t", "mode": "agent"}, format="json").json()["id"]
    response = owner.post(
        f"{threads}/{thread}/actions", {"tool": "shell.exec", "args": ATTACK}, format="json"
    )
    assert response.status_code == 201, response.content
    assert response.json()["state"] == "denied"
    assert broker == [], "nothing was sent to a runner"
    assert Action.objects.get(public_id=response.json()["id"]).state == "denied"


@pytest.mark.spec("POL-2")
def test_a_project_cannot_grant_a_variable_its_environment_does_not(world):
    publish_environment(
        world, {"capabilities": {"shell.exec": {"commands": ["ls"], "env": ["APP_MODE"]}}}
    )
    owner = world["owner"].client()
    widening = {"capabilities": {"shell.exec": {"commands": ["ls"], "env": ["LD_PRELOAD"]}}}
    response = owner.put(prj_url(world), widening, format="json")
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "policy_widens"
    assert [w["path"] for w in error["details"]["widenings"]] == ["capabilities.shell.exec.env[0]"]
    assert "LD_PRELOAD" in error["message"]
    narrowing = {"capabilities": {"shell.exec": {"commands": ["ls"], "env": ["APP_MODE"]}}}
    assert owner.put(prj_url(world), narrowing, format="json").status_code == 200
    granted = owner.post(
        prj_url(world, "explain"),
        {"tool": "shell.exec", "args": {"argv": ["ls"], "env": {"APP_MODE": "1"}}},
        format="json",
    ).json()
    assert granted["decision"] == "allow", granted


@pytest.mark.parametrize(
    "body,path",
    [
        (
            b'{"capabilities": {"fs.read": {"paths": ["a\\ud800/**"]}}}',
            "capabilities.fs.read.paths[0]",
        ),
        (b'{"capabilities": {}, "description": "\\udc00"}', "description"),
        (b'{"capabilities": {"\\ud800": {}}}', "capabilities.<key>"),
    ],
)
def test_a_lone_surrogate_in_a_policy_is_a_400_naming_where_not_a_500(world, body, path):
    """A JSON escape can spell half a surrogate pair, which no UTF-8 document can hold: the
    canonical form could not be hashed (it was a 500). The one body parser refuses it,
    naming where (a key is named by its parent)."""
    response = (
        world["owner"]
        .client()
        .generic("PUT", env_url(world), data=body, content_type="application/json")
    )
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["code"] == "invalid"
    assert path in error["details"]
    assert "surrogate" in error["message"]
