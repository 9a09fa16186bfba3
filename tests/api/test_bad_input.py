"""Bad input is a 400 naming the field, never a server error: the one request parser (repeated
keys, NUL, lone surrogates), the tool schemas (prefixItems) and the path rules."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kestrel_one.accounts.principal import system_principal
from kestrel_one.threads.services import thread_create
from runners.contract.arguments import MAX_ARG_CHARS
from runners.contract.registry import TOOLS

pytestmark = pytest.mark.spec("API-6")


@pytest.fixture
def broker(monkeypatch):
    monkeypatch.setattr("kestrel_one.celery.app.send_task", lambda *a, **k: None)


@pytest.fixture
def urls(world):
    thread = thread_create(
        actor=system_principal("tests"), project=world.project, title="bad input", mode="agent"
    )
    project = f"/api/v1/orgs/acme/projects/{world.project.public_id}"
    return {
        "actions": f"{project}/threads/{thread.public_id}/actions",
        "explain": f"{project}/explain",
    }


def post_raw(client, url: str, body: Any | str):
    """Send ``body`` as ASCII JSON text (a lone surrogate travels as its ``\\u`` escape)."""
    text = body if isinstance(body, str) else json.dumps(body, ensure_ascii=True)
    return client.post(url, text, content_type="application/json")


def assert_refused(response, field: str, words: str):
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert field in error["details"], error
    assert words in error["message"], error


@pytest.mark.parametrize("endpoint", ["actions", "explain"])
def test_a_lone_surrogate_is_a_400_naming_the_field(world, broker, urls, endpoint):
    body = {"tool": "fs.write", "args": {"path": "src/a.py", "content": "ok \ud800 no"}}
    response = post_raw(world["owner"].client(), urls[endpoint], body)
    assert_refused(response, "args.content", "surrogate")


@pytest.mark.parametrize("endpoint", ["actions", "explain"])
def test_a_repeated_key_in_an_action_body_is_a_400_naming_it(world, broker, urls, endpoint):
    body = '{"tool": "fs.read", "args": {"path": "src/a.py", "path": "secrets/key"}}'
    response = post_raw(world["owner"].client(), urls[endpoint], body)
    assert_refused(response, "args.path", "given twice")


def test_every_endpoint_reads_bodies_with_the_one_parser(world):
    """A repeated key in a thread body, and NUL in a token name, are refused the same way."""
    owner = world["owner"].client()
    threads = f"/api/v1/orgs/acme/projects/{world.project.public_id}/threads"
    assert_refused(post_raw(owner, threads, '{"title": "a", "title": "b"}'), "title", "twice")
    nul = post_raw(owner, "/api/v1/orgs/acme/tokens", {"name": "a\x00b", "scopes": ["org:read"]})
    assert_refused(nul, "name", "NUL")


@pytest.mark.parametrize(
    ("argv0", "words"), [("l\x00s", "NUL"), ("x" * (MAX_ARG_CHARS + 1), "long")]
)
def test_argv_0_meets_every_argument_rule(world, broker, urls, argv0, words):
    body = {"tool": "shell.exec", "args": {"argv": [argv0, "-l"]}}
    response = post_raw(world["owner"].client(), urls["explain"], body)
    assert response.status_code == 400, response.content
    assert "args.argv[0]" in response.json()["error"]["details"]
    assert words in response.json()["error"]["message"]


def test_a_path_name_over_255_bytes_is_a_400(world, broker, urls):
    name = "é" * 128  # 128 characters, 256 bytes of UTF-8
    body = {"tool": "fs.write", "args": {"path": f"src/{name}", "content": "x"}}
    response = post_raw(world["owner"].client(), urls["actions"], body)
    assert_refused(response, "args.path", "255 bytes")


def test_a_policy_body_repeating_a_key_is_refused_by_the_same_parser(world):
    body = '{"capabilities": {"fs.read": {"paths": ["src/**"]}, "fs.read": {"paths": ["**"]}}}'
    url = f"/api/v1/orgs/acme/projects/{world.project.public_id}/policy"
    response = world["owner"].client().put(url, body, content_type="application/json")
    assert_refused(response, "capabilities.fs.read", "given twice")


# Property: generated strings in every string slot of every registered tool's arguments.
PIECES = st.one_of(
    st.text(max_size=12),
    st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),  # lone surrogates
    st.sampled_from(["\x00", "é", "名", "🦅", "\u202e", "\ufeff", "/", "..", "*"]),
    st.integers(min_value=200, max_value=MAX_ARG_CHARS + 10).map(lambda n: "x" * n),
)
STRINGS = st.lists(PIECES, max_size=4).map("".join)


def _example_value(schema: dict) -> Any:
    """A value that passes ``schema`` for the simple shapes the tools use."""
    kind = schema.get("type")
    if kind == "string":
        return "0" * 64 if schema.get("pattern") == "^[0-9a-f]{64}$" else "a"
    if kind == "array":
        return [_example_value(schema.get("items", {"type": "string"}))]
    if kind == "object":
        return {}
    if kind == "integer":
        return schema.get("minimum", 1)
    return True


def _slots(tool) -> list[tuple[str, str]]:
    """(tool, where) for each place a string goes in the tool's arguments, and a key."""
    slots = [(tool.name, "<key>")]
    for name, schema in tool.input_schema["properties"].items():
        kind = schema.get("type")
        if kind == "string":
            slots.append((tool.name, name))
        elif kind == "array":
            slots += [(tool.name, f"{name}[0]"), (tool.name, f"{name}[1]")]
        elif kind == "object":
            slots += [(tool.name, f"{name}.<value>"), (tool.name, f"{name}.<key>")]
    return slots


SLOTS = [slot for tool in TOOLS.values() for slot in _slots(tool)]


def _args_with(tool_name: str, where: str, text: str) -> dict:
    tool = TOOLS[tool_name]
    properties = tool.input_schema["properties"]
    required = list(tool.input_schema.get("required", []))
    alternatives = [alt["required"] for alt in tool.input_schema.get("oneOf", [])]
    name = where.split("[")[0].split(".")[0]
    if alternatives:
        required += next((alt for alt in alternatives if name in alt), alternatives[0])
    args = {key: _example_value(properties[key]) for key in required}
    if where == "<key>":
        args[text] = "v"
    elif where.endswith("[0]"):
        args[name] = [text]
    elif where.endswith("[1]"):
        args[name] = [_example_value(properties[name]["items"]), text]
    elif where.endswith(".<value>"):
        args[name] = {"NAME": text}
    elif where.endswith(".<key>"):
        args[name] = {text: "v"}
    else:
        args[name] = text
    return args


def test_every_registered_tool_has_a_string_slot_or_a_key():
    assert {tool for tool, _ in SLOTS} == set(TOOLS)


@pytest.mark.parametrize(("tool", "where"), SLOTS, ids=[f"{t}:{w}" for t, w in SLOTS])
@settings(
    max_examples=4,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(text=STRINGS)
@example(text="\ud800")
@example(text="a\x00b")
@example(text="x" * (MAX_ARG_CHARS + 1))
def test_generated_strings_are_a_400_or_a_decision(world, broker, urls, tool, where, text):
    client = world["owner"].client()
    body = {"tool": tool, "args": _args_with(tool, where, text)}
    for endpoint, decided in (("actions", 201), ("explain", 200)):
        response = post_raw(client, urls[endpoint], body)
        assert response.status_code in {400, decided}, (endpoint, response.content[:500])
        if response.status_code == 400:
            assert response.json()["error"]["details"], response.content[:500]
