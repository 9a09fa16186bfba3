"""The OpenAI-compatible endpoint against the test upstream (real TLS, real sockets, the one
egress client), with the org credential released per call and the budget settled."""

from __future__ import annotations

import json

import pytest

from kestrel_one.accounts.principal import Principal, PrincipalKind, system_principal
from kestrel_one.audit.models import AuditRecord
from kestrel_one.gateway.models import BudgetWindow, ModelUsage, UsageState
from kestrel_one.gateway.services import budget_set, reservation_tokens
from kestrel_one.governance.selectors import effective_policy
from policies import Mode


def current_version(world) -> str:
    """The policy versions the member's token is judged under in the project now."""
    member = Principal(PrincipalKind.TOKEN, user=world.member.user, token=world.member.token)
    return effective_policy(project=world.project, principal=member, mode=Mode.AGENT).version


HELLO = [{"role": "user", "content": "Say hello to the launch team"}]


def post(world, body, actor=None, **extra):
    client = (actor or world.member).client()
    return client.post(world.url(), data=json.dumps(body), content_type="application/json", **extra)


def day_window(world):
    return BudgetWindow.objects.get(project=world.project, period="day")


def close_unread(response) -> None:
    """Close a streamed answer nobody read, as the server does when its client goes away
    (as Django's test client closes one: without closing the test's database connection)."""
    from django.core.signals import request_finished
    from django.db import close_old_connections

    request_finished.disconnect(close_old_connections)
    try:
        response.close()
    finally:
        request_finished.connect(close_old_connections)


def sse_events(response) -> list:
    text = b"".join(response.streaming_content).decode()
    events = [block[len("data: ") :] for block in text.split("\n\n") if block.startswith("data: ")]
    return [event if event == "[DONE]" else json.loads(event) for event in events]


@pytest.mark.spec("CRED-2")
def test_a_chat_completion_uses_the_org_credential_and_charges_the_reported_usage(
    gateway_world, upstream
):
    world = gateway_world
    response = post(world, {"model": "openai/gpt-4o-mini", "messages": HELLO, "max_tokens": 50})
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == "Hello from the Kestrel test upstream."
    sent = upstream.requests(host="openai", path="/v1/chat/completions")
    assert len(sent) == 1
    assert json.loads(sent[0]["body"])["max_tokens"] == 50
    usage = ModelUsage.objects.get(public_id=response["X-Kestrel-Usage"])
    assert usage.state == UsageState.SETTLED and usage.outcome == "succeeded"
    assert usage.surface == "endpoint" and usage.model == "gpt-4o-mini"
    assert (usage.input_tokens, usage.output_tokens) == (6, 6)
    assert usage.charged_tokens == 12
    assert usage.credential == world.credentials["openai"].public_id
    assert usage.request_sha256 and usage.response_sha256
    # Judged under the project's policy as it stands, and saying so.
    version = current_version(world)
    assert usage.policy_version == version and "+mode:agent" in version
    window = day_window(world)
    assert (window.used, window.reserved) == (12, 0)
    audit = AuditRecord.objects.get(organization=world.org, action="model.invoke")
    stored = json.dumps(audit.data)
    assert "launch team" not in stored and "Hello from" not in stored
    assert audit.data["usage"]["charged"] == 12 and audit.data["request_bytes"] > 0
    assert upstream.secret("openai") not in stored
    assert audit.data["policy_version"] == version


def test_an_anthropic_model_answers_in_the_openai_form(gateway_world, upstream):
    world = gateway_world
    messages = [{"role": "system", "content": "Be brief."}, *HELLO]
    response = post(world, {"model": "anthropic/claude-3-5-haiku-latest", "messages": messages})
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["model"] == "anthropic/claude-3-5-haiku-latest"
    assert body["choices"][0]["message"]["content"].startswith("Hello from")
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 6
    sent = json.loads(upstream.requests(host="anthropic", path="/v1/messages")[0]["body"])
    assert sent["system"] == "Be brief."
    assert [m["role"] for m in sent["messages"]] == ["user"]
    assert sent["max_tokens"] == 4096  # the default bound, always sent


@pytest.mark.parametrize("include_usage", [True, False])
def test_an_openai_stream_is_passed_on_and_settled_at_its_end(
    gateway_world, upstream, include_usage
):
    world = gateway_world
    body = {"model": "openai/gpt-4o-mini", "messages": HELLO, "stream": True, "max_tokens": 20}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    response = post(world, body)
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/event-stream")
    usage = ModelUsage.objects.get(public_id=response["X-Kestrel-Usage"])
    assert usage.state == UsageState.RESERVED  # nothing settles before the stream ends
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    text = "".join(
        choice["delta"].get("content") or "" for event in events[:-1] for choice in event["choices"]
    )
    assert text == "Hello from the Kestrel test upstream."
    usage_chunks = [e for e in events[:-1] if not e["choices"] and e.get("usage")]
    assert len(usage_chunks) == (1 if include_usage else 0)
    # The gateway asked for the usage chunk either way, and settled on it.
    sent = json.loads(upstream.requests(host="openai")[0]["body"])
    assert sent["stream_options"] == {"include_usage": True}
    usage.refresh_from_db()
    assert usage.state == UsageState.SETTLED and usage.outcome == "succeeded"
    assert usage.charged_tokens == 12
    assert (day_window(world).used, day_window(world).reserved) == (12, 0)


def test_an_anthropic_stream_is_translated_into_openai_chunks(gateway_world, upstream):
    world = gateway_world
    response = post(
        world,
        {
            "model": "anthropic/claude-3-5-haiku-latest",
            "messages": HELLO,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert response.status_code == 200
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(e["object"] == "chat.completion.chunk" for e in chunks)
    text = "".join(c["delta"].get("content") or "" for e in chunks for c in e["choices"])
    assert text == "Hello from the Kestrel test upstream."
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    usage = ModelUsage.objects.get(public_id=response["X-Kestrel-Usage"])
    assert usage.state == UsageState.SETTLED
    assert usage.charged_tokens == chunks[-1]["usage"]["total_tokens"]


def test_a_stream_closed_by_the_client_before_reading_is_settled_at_once(gateway_world, upstream):
    world = gateway_world
    response = post(world, {"model": "openai/gpt-4o-mini", "messages": HELLO, "stream": True})
    assert response.status_code == 200
    usage = ModelUsage.objects.get(public_id=response["X-Kestrel-Usage"])
    close_unread(response)  # what the server does when the client goes away
    usage.refresh_from_db()
    assert usage.state == UsageState.SETTLED and usage.outcome == "failed"
    assert usage.charged_tokens == usage.reserved_tokens  # the provider may have done the work
    assert day_window(world).reserved == 0


def test_a_call_over_budget_is_refused_before_the_provider_is_called(gateway_world, upstream):
    world = gateway_world
    budget_set(
        actor=system_principal("tests"),
        project=world.project,
        tokens_per_day=100,
        tokens_per_month=None,
    )
    response = post(world, {"model": "openai/gpt-4o-mini", "messages": HELLO, "max_tokens": 500})
    assert response.status_code == 429
    error = response.json()["error"]
    assert error["code"] == "budget_exceeded"
    assert error["type"] == "insufficient_quota"
    assert error["details"]["period"] == "day"
    assert upstream.requests(host="openai") == []
    assert not ModelUsage.objects.filter(project=world.project).exists()
    refusal = AuditRecord.objects.get(organization=world.org, action="model.invoke")
    assert refusal.outcome == "refused" and refusal.data["period"] == "day"


def test_a_model_the_policy_does_not_name_is_denied(gateway_world, upstream):
    response = post(gateway_world, {"model": "openai/gpt-4o", "messages": HELLO})
    assert response.status_code == 403
    error = response.json()["error"]
    assert error["code"] == "model_denied"
    assert "openai/gpt-4o" in error["message"]
    assert error["type"] == "permission_error"
    assert upstream.requests() == []
    # The refusal, and its audit record, name the policy versions that refused it.
    version = current_version(gateway_world)
    assert error["details"] == {"policy_version": version}
    refused = AuditRecord.objects.get(organization=gateway_world.org, action="request.refused")
    assert refused.data["policy_version"] == version


def test_a_provider_error_releases_the_reservation_and_charges_nothing(gateway_world, upstream):
    world = gateway_world
    response = post(world, {"model": "openai/kestrel-upstream-error", "messages": HELLO})
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["code"] == "upstream_error"
    assert error["details"]["upstream_status"] == 500
    assert error["details"]["upstream_type"] == "server_error"
    usage = ModelUsage.objects.get(project=world.project)
    assert (usage.state, usage.outcome, usage.charged_tokens) == ("settled", "upstream_error", 0)
    assert (day_window(world).used, day_window(world).reserved) == (0, 0)


@pytest.mark.spec("CRED-6")
def test_a_provider_error_echoing_the_credential_passes_none_of_it_on(gateway_world, upstream):
    world = gateway_world
    response = post(world, {"model": "openai/kestrel-echo-credential", "messages": HELLO})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "upstream_error"
    secret = upstream.secret("openai")
    assert secret not in response.content.decode()
    usage = ModelUsage.objects.get(project=world.project)
    for record in AuditRecord.objects.filter(organization=world.org):
        assert secret not in json.dumps(record.data)
    assert secret not in json.dumps(
        {f.name: str(getattr(usage, f.name)) for f in ModelUsage._meta.fields}
    )


@pytest.mark.spec("CRED-6")
@pytest.mark.parametrize("stream", [False, True])
def test_a_provider_answer_echoing_the_credential_passes_none_of_it_on(
    gateway_world, upstream, stream
):
    """Adapters mask every form of the credential in every answer; the gateway passed a 2xx
    answer on byte for byte, so a provider that echoed the key gave it to the agent. Whole
    answers and streams are masked now, a stream even where the key is cut across two of
    the provider's writes; the answer is otherwise as it came."""
    world = gateway_world
    body = {"model": "openai/kestrel-echo-credential-ok", "messages": HELLO, "stream": stream}
    response = post(world, body)
    assert response.status_code == 200
    secret = upstream.secret("openai")
    if stream:
        events = sse_events(response)
        assert events[-1] == "[DONE]"
        answers = events[:-1]
        text = "".join(c["delta"].get("content") or "" for e in answers for c in e["choices"])
    else:
        answers = [response.json()]
        text = answers[0]["choices"][0]["message"]["content"]
    assert text == "Hello from the Kestrel test upstream."
    assert {answer["system_fingerprint"] for answer in answers} == {"[redacted]"}
    assert secret not in json.dumps(answers) and secret[:12] not in json.dumps(answers)


def test_a_timeout_after_sending_charges_the_whole_reservation(
    gateway_world, upstream, monkeypatch
):
    from kestrel_one.gateway import calls

    monkeypatch.setattr(calls, "operation_limits", lambda request: (1.0, 1024 * 1024))
    world = gateway_world
    response = post(world, {"model": "openai/kestrel-slow", "messages": HELLO, "max_tokens": 10})
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "upstream_timeout"
    usage = ModelUsage.objects.get(project=world.project)
    expected = reservation_tokens(messages=HELLO, max_tokens=10)
    assert (usage.state, usage.error_code, usage.charged_tokens) == ("settled", "timeout", expected)
    assert (day_window(world).used, day_window(world).reserved) == (expected, 0)


@pytest.mark.parametrize("extra, param", [({"tools": []}, "tools"), ({"n": 2}, "n")])
def test_a_field_the_endpoint_does_not_take_is_refused_naming_it(
    gateway_world, upstream, extra, param
):
    response = post(gateway_world, {"model": "openai/gpt-4o-mini", "messages": HELLO, **extra})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid"
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert upstream.requests() == []


@pytest.mark.parametrize("model", ["gpt-4o-mini", "mistral/large", "openai/", 7])
def test_a_model_not_named_provider_slash_model_is_refused(gateway_world, upstream, model):
    response = post(gateway_world, {"model": model, "messages": HELLO})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "model"


def test_anthropic_arguments_its_api_refuses_are_refused_before_sending(gateway_world, upstream):
    response = post(
        gateway_world,
        {"model": "anthropic/claude-3-5-haiku-latest", "messages": HELLO, "temperature": 1.5},
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "temperature"
    assert upstream.requests() == []


def test_without_an_org_credential_the_call_is_refused(gateway_world, upstream):
    from kestrel_one.credentials.services import credential_revoke

    world = gateway_world
    credential_revoke(actor=system_principal("tests"), credential=world.credentials["openai"])
    response = post(world, {"model": "openai/gpt-4o-mini", "messages": HELLO})
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "credential_missing"
    assert upstream.requests() == []


def test_the_endpoint_needs_a_kestrel_token(gateway_world, api, upstream):
    response = api.post(
        gateway_world.url(),
        data=json.dumps({"model": "openai/gpt-4o-mini", "messages": HELLO}),
        content_type="application/json",
    )
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"
    assert upstream.requests() == []


def test_a_viewer_cannot_call_models(gateway_world, upstream):
    from kestrel_one.accounts.scopes import Role
    from tests.conftest import make_person

    viewer = make_person(gateway_world.org, Role.VIEWER, name="viewer")
    response = post(gateway_world, {"model": "openai/gpt-4o-mini", "messages": HELLO}, viewer)
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "permission_denied"
    assert upstream.requests() == []


def test_the_budget_api_sets_and_shows_the_budget(gateway_world, upstream):
    world = gateway_world
    url = f"/api/v1/orgs/{world.org.slug}/projects/{world.project.public_id}/model/budget"
    shown = world.member.client().get(url).json()
    assert shown["source"] == "default" and shown["tokens_per_day"] is None
    refused = world.member.client().put(url, {"tokens_per_day": 10}, format="json")
    assert refused.status_code == 403
    changed = world.admin.client().put(
        url, {"tokens_per_day": 1000, "tokens_per_month": None}, format="json"
    )
    assert changed.status_code == 200, changed.content
    post(world, {"model": "openai/gpt-4o-mini", "messages": HELLO, "max_tokens": 50})
    shown = world.member.client().get(url).json()
    assert shown["source"] == "project"
    assert shown["day"] == {
        "starts_on": shown["day"]["starts_on"],
        "limit": 1000,
        "used": 12,
        "reserved": 0,
        "left": 988,
    }
    assert AuditRecord.objects.filter(organization=world.org, action="gateway.budget.set").exists()


def test_a_whole_answer_is_settled_when_the_server_closes_the_response(gateway_world, upstream):
    """Behind a WSGI server the client has the answer before the settlement is written;
    until then the reservation holds the call's bound."""
    from django.core.handlers.wsgi import WSGIHandler
    from django.core.signals import request_finished, request_started
    from django.db import close_old_connections
    from django.test import RequestFactory

    world = gateway_world
    body = json.dumps({"model": "openai/gpt-4o-mini", "messages": HELLO, "max_tokens": 50})
    environ = (
        RequestFactory(HTTP_AUTHORIZATION=f"Bearer {world.member.plaintext}")
        .post(world.url(), body, content_type="application/json", REMOTE_ADDR="203.0.113.7")
        .environ
    )
    status = []
    # As Django's test client does: the test's transaction keeps its database connection.
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        response = WSGIHandler()(environ, lambda line, headers, exc_info=None: status.append(line))
        answer = json.loads(b"".join(response))
        assert status[0].startswith("200")
        assert answer["usage"]["total_tokens"] == 12
        usage = ModelUsage.objects.get(public_id=response["X-Kestrel-Usage"])
        assert usage.state == UsageState.RESERVED
        assert day_window(world).reserved == usage.reserved_tokens
        response.close()
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)
    usage.refresh_from_db()
    assert (usage.state, usage.charged_tokens) == (UsageState.SETTLED, 12)
    assert (day_window(world).used, day_window(world).reserved) == (12, 0)


def test_the_usage_api_lists_the_projects_calls_without_content(gateway_world, upstream):
    world = gateway_world
    post(world, {"model": "openai/gpt-4o-mini", "messages": HELLO, "max_tokens": 50})
    post(world, {"model": "openai/gpt-4o", "messages": HELLO})  # denied: no record
    post(world, {"model": "anthropic/claude-3-5-haiku-latest", "messages": HELLO})
    url = f"/api/v1/orgs/{world.org.slug}/projects/{world.project.public_id}/model/usage"
    listed = world.member.client().get(url)
    assert listed.status_code == 200
    results = listed.json()["results"]
    assert [r["model"] for r in results] == [
        "anthropic/claude-3-5-haiku-latest",
        "openai/gpt-4o-mini",
    ]
    assert results[1]["usage"]["charged"] == 12 and results[1]["state"] == "settled"
    assert {r["policy_version"] for r in results} == {current_version(world)}
    assert "launch team" not in listed.content.decode()


@pytest.mark.spec("CRED-6")
def test_a_credential_spelled_in_json_escapes_is_masked_too(gateway_world, upstream):
    """JSON may spell any character as an escape: the bytes as sent then never hold the
    credential, yet the client that parses them reads it. What is passed on is masked
    once parsed as well."""
    world = gateway_world
    body = {"model": "openai/kestrel-echo-credential-escaped", "messages": HELLO}
    response = post(world, body)
    assert response.status_code == 200, response.content
    secret = upstream.secret("openai")
    answer = response.json()
    assert answer["system_fingerprint"] == "[redacted]"
    assert answer["choices"][0]["message"]["content"] == "Hello from the Kestrel test upstream."
    assert secret not in json.dumps(answer)


@pytest.mark.spec("CRED-6", "CRED-1")
def test_an_anthropic_stream_never_translates_an_escaped_credential_into_plain_text(
    gateway_world, upstream
):
    """The gateway decodes Anthropic's events to write OpenAI's: a credential the provider
    spelled in JSON escapes is plain text once decoded, so what the gateway writes is masked
    too."""
    world = gateway_world
    body = {
        "model": "anthropic/kestrel-echo-credential-escaped",
        "messages": HELLO,
        "stream": True,
    }
    response = post(world, body)
    assert response.status_code == 200, response.content
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    text = "".join(c["delta"].get("content") or "" for e in events[:-1] for c in e["choices"])
    assert text == "Hello from the Kestrel test upstream.[redacted]"  # the upstream did send it
    assert upstream.secret("anthropic") not in json.dumps(events)
