"""Errors a newcomer meets on the tour say what to do next, with the codes scripts rely on.

Each message names what was wrong and what would be accepted: the header to send, the
choices there are, the arguments a tool takes, the fields a body takes, the object that is
missing (without internal field names), and the mode that removed a capability.
"""

from __future__ import annotations

import json

import pytest
from rest_framework import serializers
from rest_framework.test import APIClient

import kestrel_one.urls  # noqa: F401 - loads every endpoint module, so every serializer exists
from kestrel_one.api.serializers import StrictModelSerializer, StrictSerializer
from kestrel_one.threads.services import thread_create
from runners.contract.registry import TOOLS
from tests.factories import ProjectFactory

MODES = ["ask", "plan", "agent", "auto"]
INTERNALS = ("public_id", "pk", "does not exist", "Object with")


def project_url(world, project=None) -> str:
    return f"/api/v1/orgs/acme/projects/{(project or world.project).public_id}"


def thread_url(world, thread=None) -> str:
    thread = thread or world.thread
    return f"{project_url(world, thread.project)}/threads/{thread.public_id}"


def error_of(response, status: int, code: str) -> dict:
    assert response.status_code == status, response.content
    error = response.json()["error"]
    assert error["code"] == code, error
    return error


# --- 415 ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content_type", ["application/x-www-form-urlencoded", "text/plain", "multipart/form-data"]
)
def test_unsupported_media_type_says_to_send_json(world, content_type):
    response = (
        world["owner"]
        .client()
        .generic(
            "POST",
            "/api/v1/orgs/acme/environments",
            data='{"name": "dev"}',
            content_type=content_type,
        )
    )
    error = error_of(response, 415, "unsupported_media_type")
    assert "Content-Type: application/json" in error["message"]
    assert content_type in error["message"]


def test_the_curl_d_mistake_is_named(world):
    """`curl -d` without -H sends a form: the message says that is what happened."""
    response = (
        world["owner"]
        .client()
        .post(
            "/api/v1/orgs/acme/environments",
            data="name=dev",
            content_type="application/x-www-form-urlencoded",
        )
    )
    error = error_of(response, 415, "unsupported_media_type")
    assert "curl -d" in error["message"]


# --- choices -----------------------------------------------------------------------------


def _choice_cases(world):
    from kestrel_one.accounts.scopes import SCOPES
    from kestrel_one.webhooks.events import EVENT_TYPES

    threads = f"{project_url(world)}/threads"
    return [
        ("POST", threads, {"title": "t", "mode": "yolo"}, "mode", MODES),
        ("POST", "/api/v1/orgs/acme/tokens", {"name": "t", "scopes": ["yolo"]}, "scopes", SCOPES),
        (
            "POST",
            "/api/v1/orgs/acme/members",
            {"email": "new@acme.example.com", "role": "yolo"},
            "role",
            ["owner", "admin", "member", "viewer"],
        ),
        (
            "POST",
            "/api/v1/orgs/acme/webhooks",
            {"url": "https://hooks.example.com/k", "event_types": ["yolo"]},
            "event_types",
            EVENT_TYPES,
        ),
        ("GET", f"{project_url(world)}/effective-policy?mode=yolo", None, "mode", MODES),
        (
            "POST",
            f"{project_url(world)}/explain",
            {"tool": "fs.read", "args": {"path": "a"}, "mode": "yolo"},
            "mode",
            MODES,
        ),
        ("GET", f"{threads}?mode=yolo", None, "mode", MODES),
        ("GET", f"{thread_url(world)}/actions?state=yolo", None, "state", ["succeeded", "denied"]),
        ("GET", "/api/v1/orgs/acme/members?role=yolo", None, "role", ["owner", "viewer"]),
    ]


def test_a_choice_error_lists_the_choices(world):
    client = world["owner"].client()
    for method, path, body, field, choices in _choice_cases(world):
        if body is None:
            response = client.generic(method, path)
        else:
            response = client.generic(
                method, path, data=json.dumps(body), content_type="application/json"
            )
        error = error_of(response, 400, "invalid")
        assert field in str(error["details"]), (path, error)
        for choice in choices:
            assert choice in error["message"], (path, choice, error["message"])
            assert choice in str(error["details"]), (path, choice)


def _strict_serializers(cls=StrictSerializer):
    for sub in cls.__subclasses__():
        yield sub
        yield from _strict_serializers(sub)


def _choice_fields(field, path):
    if isinstance(field, serializers.ChoiceField):
        yield path, field
    elif isinstance(field, serializers.ListField | serializers.DictField):
        yield from _choice_fields(field.child, f"{path}[]")
    elif isinstance(field, serializers.Serializer):
        for name, child in field.fields.items():
            yield from _choice_fields(child, f"{path}.{name}")


def test_every_choice_field_of_every_request_body_lists_its_choices():
    """The rule lives in StrictSerializer, so a new body's choice field is covered unasked."""
    found = 0
    for cls in _strict_serializers():
        if cls.__module__.startswith("tests.") or cls is StrictModelSerializer:
            continue
        for name, field in cls().fields.items():
            for path, choice in _choice_fields(field, f"{cls.__name__}.{name}"):
                found += 1
                message = choice.error_messages["invalid_choice"].format(input="yolo")
                for value in choice.choice_strings_to_values:
                    assert value in message, (path, value, message)
    assert found >= 5  # thread mode, member roles, token scopes, webhook event types


# --- unknown arguments and fields ---------------------------------------------------------


def test_an_unknown_tool_argument_lists_the_allowed_ones(world):
    client = world["owner"].client()
    body = {"tool": "fs.write", "args": {"path": "src/a.py", "content": "x", "mode": "w"}}
    for path in (f"{thread_url(world)}/actions", f"{project_url(world)}/explain"):
        error = error_of(client.post(path, body, format="json"), 400, "invalid")
        assert "unknown argument 'mode'; fs.write takes: content, path" in error["message"]
        assert error["details"] == {
            "args.mode": ["unknown argument 'mode'; fs.write takes: content, path"]
        }
    plan = client.post(
        f"{thread_url(world, world.plan_thread)}/plans",
        {"steps": [{"tool": "fs.write", "args": {"path": "src/a.py", "content": "x", "m": 1}}]},
        format="json",
    )
    assert "fs.write takes: content, path" in error_of(plan, 400, "invalid")["message"]


def test_an_unknown_body_field_lists_the_fields(world):
    client = world["owner"].client()
    actions = client.post(
        f"{thread_url(world)}/actions",
        {"tool": "fs.read", "args": {"path": "a"}, "colour": "red"},
        format="json",
    )
    error = error_of(actions, 400, "invalid")
    assert error["details"] == {
        "colour": ["Unknown field 'colour'; the fields are: args, plan_step, tool."]
    }
    assert "the fields are: args, plan_step, tool" in error["message"]
    environments = client.post(
        "/api/v1/orgs/acme/environments", {"name": "x", "id": "env_x"}, format="json"
    )
    (message,) = error_of(environments, 400, "invalid")["details"]["id"]
    assert "read-only" in message and "description, name" in message
    audit = client.get("/api/v1/orgs/acme/audit?colour=red")
    (message,) = error_of(audit, 400, "invalid")["details"]["colour"]
    assert "Unknown query parameter 'colour'" in message and "actor" in message


def test_an_unknown_tool_lists_the_tools_and_the_likeliest_one(world):
    response = (
        world["owner"]
        .client()
        .post(f"{thread_url(world)}/actions", {"tool": "fs.writ", "args": {}}, format="json")
    )
    error = error_of(response, 400, "invalid")
    assert "did you mean 'fs.write'?" in error["message"]
    assert all(name in error["message"] for name in TOOLS)
    assert "GET /api/v1/tools" in error["message"]
    assert error["details"] == {"tool": ["unknown"]}


# --- missing related objects --------------------------------------------------------------


def test_a_missing_environment_is_named_without_internal_fields(world):
    client = world["owner"].client()
    for given in ("env_01NOSUCHENVIRONMENT0000000", world.foreign_environment.public_id):
        response = client.post(
            "/api/v1/orgs/acme/projects", {"name": "p", "environment": given}, format="json"
        )
        error = error_of(response, 400, "invalid")
        expected = f"no environment {given} in this organization"
        assert error["details"] == {"environment": [expected]}
        assert expected in error["message"]
        assert not any(word in str(error) for word in INTERNALS), error
    not_an_id = client.post(
        "/api/v1/orgs/acme/projects", {"name": "p", "environment": 5}, format="json"
    )
    error = error_of(not_an_id, 400, "invalid")
    assert "env_" in error["message"]
    assert not any(word in str(error) for word in INTERNALS), error


def test_other_missing_references_in_a_body_are_named_too(world):
    client = world["owner"].client()
    member = client.post(
        "/api/v1/orgs/acme/members",
        {"email": "new@acme.example.com", "role": "member", "projects": ["prj_nope"]},
        format="json",
    )
    assert error_of(member, 400, "invalid")["details"] == {
        "projects[0]": ["no project prj_nope in this organization"]
    }
    step = client.post(
        f"{thread_url(world)}/actions",
        {"tool": "fs.read", "args": {"path": "a"}, "plan_step": {"plan": "pln_nope", "step": 0}},
        format="json",
    )
    assert "no plan pln_nope in this thread" in error_of(step, 400, "invalid")["message"]


# --- modes -------------------------------------------------------------------------------


def test_a_denial_in_a_read_only_thread_says_the_mode_removed_the_capability(world):
    client = world["owner"].client()
    ask = thread_create(actor=world.agent, project=world.project, title="ask", mode="ask")
    cases = [
        (world.plan_thread, "shell.exec", {"argv": ["make"]}, "plan"),
        (world.plan_thread, "fs.write", {"path": "src/a.py", "content": "x"}, "plan"),
        (ask, "code.python", {"code": "print(1)"}, "ask"),
    ]
    for thread, tool, args, mode in cases:
        response = client.post(
            f"{thread_url(world, thread)}/actions", {"tool": tool, "args": args}, format="json"
        )
        assert response.status_code == 201, response.content
        action = response.json()
        assert action["state"] == "denied"
        (reason,) = action["decision"]["reasons"]
        capability = TOOLS[tool].capability
        assert reason.startswith(f"{capability} is not available in {mode} mode: ")
        assert f"{mode} mode allows reads only" in reason
        assert "not granted" not in reason
    explained = client.post(
        f"{project_url(world)}/explain",
        {"tool": "shell.exec", "args": {"argv": ["make"]}, "mode": "plan"},
        format="json",
    ).json()
    assert explained["decision"] == "deny"
    assert "not available in plan mode" in explained["reasons"][0]
    assert "propose it as a plan step" in explained["explanation"]


def test_a_denial_in_agent_mode_still_says_the_policy_lacks_it(world):
    # The scratch environment has no policy: nothing is granted there.
    project = ProjectFactory(
        organization=world.org, environment=world.empty_environment, name="bare"
    )
    explained = (
        world["owner"]
        .client()
        .post(
            f"{project_url(world, project)}/explain",
            {"tool": "shell.exec", "args": {"argv": ["make"]}, "mode": "agent"},
            format="json",
        )
        .json()
    )
    assert explained["reasons"] == ["shell.exec is not granted by the effective policy"]


# --- the rest of the tour -----------------------------------------------------------------


def test_no_token_says_which_headers_carry_one(api, db):
    error = error_of(api.get("/api/v1/orgs"), 401, "not_authenticated")
    assert "Authorization: Bearer TOKEN" in error["message"]
    assert "X-Kestrel-Token: TOKEN" in error["message"]


def test_a_wrong_authorization_scheme_says_to_use_bearer(world):
    client = APIClient(REMOTE_ADDR="203.0.113.7")
    client.credentials(HTTP_AUTHORIZATION=f"Token {world['owner'].plaintext}")
    error = error_of(client.get("/api/v1/orgs"), 401, "not_authenticated")
    assert "Authorization: Bearer TOKEN" in error["message"]


def test_malformed_json_says_where_and_what_to_send(world):
    response = (
        world["owner"]
        .client()
        .post("/api/v1/orgs/acme/environments", data="{name: 1}", content_type="application/json")
    )
    error = error_of(response, 400, "parse_error")
    assert "not valid JSON" in error["message"]
    assert "line 1 column 2" in error["message"]
    assert "JSON object" in error["message"]


def test_a_missing_body_names_the_required_fields(world):
    response = world["owner"].client().post(f"{thread_url(world)}/actions", format="json")
    error = error_of(response, 400, "invalid")
    assert error["message"] == "Missing required field(s): tool, args."
    assert set(error["details"]) == {"tool", "args"}


def test_a_body_that_is_not_an_object_says_so(world):
    response = (
        world["owner"]
        .client()
        .post(f"{thread_url(world)}/actions", data="[1, 2]", content_type="application/json")
    )
    error = error_of(response, 400, "invalid")
    assert error["message"] == "Expected a JSON object, but got list."


def test_the_message_names_each_field_and_its_problem(world):
    response = (
        world["owner"]
        .client()
        .post(
            "/api/v1/orgs/acme/members",
            {"email": "not-an-email", "role": "member"},
            format="json",
        )
    )
    error = error_of(response, 400, "invalid")
    assert error["message"] == "email: Enter a valid email address."


def test_a_404_says_where_to_look_and_is_one_body_for_every_404(world):
    """A wrong organization slug is the tour's likeliest 404; the body cannot say which part
    was wrong (a foreign object must look missing), so it says where to look."""
    client = world["owner"].client()
    wrong_org = client.get("/api/v1/orgs/acem/projects")
    missing = client.get(f"/api/v1/orgs/acme/projects/prj_{'0' * 26}")
    foreign = client.get(f"/api/v1/orgs/globex/projects/{world.foreign_project.public_id}")
    error = error_of(wrong_org, 404, "not_found")
    assert "GET /api/v1/orgs" in error["message"]
    assert wrong_org.content == missing.content == foreign.content


def test_a_method_the_route_lacks_names_the_ones_it_takes(world):
    client = world["owner"].client()
    projects = client.put("/api/v1/orgs/acme/projects", {}, format="json")
    assert error_of(projects, 405, "method_not_allowed")["message"] == (
        "PUT is not allowed here; this route takes: GET, HEAD, POST."
    )
    policy = client.patch(f"{project_url(world)}/policy", {}, format="json")
    assert (
        "this route takes: GET, HEAD, PUT."
        in error_of(policy, 405, "method_not_allowed")["message"]
    )
    health = client.post("/api/v1/health")
    assert "this route takes: GET, HEAD." in error_of(health, 405, "method_not_allowed")["message"]
