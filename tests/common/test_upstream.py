"""The test upstream answers as the providers document, checks their credential headers and
logs what it received (the other suites count upstream requests with it)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from kestrel_one.adapters.registry import get_adapter, prepare_request
from kestrel_one.common.egress import egress_request, egress_stream
from tests.upstream import iter_sse


def _call(upstream, adapter: str, operation: str, args: dict, *, secret: str | None = None):
    """The request the registry prepares, with the credential as the adapter presents it."""
    prepared = prepare_request(adapter, operation, args)
    presentation = get_adapter(adapter).presentation
    headers = dict(prepared.headers)
    headers[presentation.header] = presentation.header_value(
        upstream.secret(adapter) if secret is None else secret
    )
    answer = egress_request(
        method=prepared.method,
        url=prepared.url,
        headers=headers,
        body=prepared.body,
        timeout_s=10,
        max_bytes=1 << 20,
    )
    return answer.status, json.loads(answer.body)


def test_github_lists_issues_and_creates_a_comment(upstream):
    status, issues = _call(
        upstream, "github", "issues.list", {"owner": "octo", "repo": "hello", "state": "open"}
    )
    assert status == 200 and [i["number"] for i in issues] == [3, 1]
    status, comment = _call(
        upstream,
        "github",
        "issue_comment.create",
        {"owner": "octo", "repo": "hello", "issue_number": 7, "body": "LGTM"},
    )
    assert status == 201 and comment["body"] == "LGTM"
    assert comment["issue_url"].endswith("/repos/octo/hello/issues/7")
    assert len(upstream.requests(host="github", path="/repos/octo/hello/issues/7/comments")) == 1


def test_slack_posts_a_message(upstream):
    status, answer = _call(
        upstream, "slack", "chat.postMessage", {"channel": "#general", "text": "deployed"}
    )
    assert status == 200 and answer["ok"] is True and answer["message"]["text"] == "deployed"


@pytest.mark.parametrize(
    ("adapter", "operation", "args"),
    [
        ("github", "issues.list", {"owner": "octo", "repo": "hello"}),
        ("slack", "chat.postMessage", {"channel": "C1", "text": "x"}),
        (
            "openai",
            "chat.completions",
            {"model": "m", "messages": [{"role": "user", "content": "x"}]},
        ),
        (
            "anthropic",
            "messages.create",
            {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]},
        ),
    ],
)
def test_a_wrong_credential_is_401_with_the_providers_error_body(
    upstream, adapter, operation, args
):
    status, body = _call(upstream, adapter, operation, args, secret="wrong-secret-value")
    assert status == 401
    assert "wrong-secret-value" not in json.dumps(body)  # OpenAI masks the middle of a key
    upstream.expect(adapter, "wrong-secret-value")
    status, _ = _call(upstream, adapter, operation, args, secret="wrong-secret-value")
    assert status == 200


def test_model_answers_carry_deterministic_usage(upstream):
    messages = [{"role": "user", "content": "one two three"}]
    status, completion = _call(
        upstream, "openai", "chat.completions", {"model": "gpt-4o-mini", "messages": messages}
    )
    assert status == 200
    assert completion["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    assert completion["choices"][0]["message"]["content"] == "Hello from the Kestrel test upstream."
    status, message = _call(
        upstream,
        "anthropic",
        "messages.create",
        {"model": "claude-x", "max_tokens": 2, "messages": messages, "system": "be brief"},
    )
    assert status == 200
    assert message["usage"] == {"input_tokens": 5, "output_tokens": 2}
    assert (message["stop_reason"], message["content"][0]["text"]) == ("max_tokens", "Hello from")


def test_anthropic_streams_its_documented_events(upstream):
    prepared = prepare_request(
        "anthropic",
        "messages.create",
        {
            "model": "claude-x",
            "max_tokens": 100,
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
        },
    )
    headers = {**prepared.headers, "x-api-key": upstream.secret("anthropic")}
    with egress_stream(
        method="POST",
        url=prepared.url,
        headers=headers,
        body=prepared.body,
        timeout_s=10,
        max_bytes=1 << 20,
    ) as stream:
        events = list(iter_sse(stream.chunks()))
    names = [event["event"] for event in events]
    assert names[0] == "message_start" and names[-1] == "message_stop"
    text = "".join(
        json.loads(e["data"])["delta"]["text"]
        for e in events
        if e["event"] == "content_block_delta"
    )
    assert text == "Hello from the Kestrel test upstream."
    (delta,) = [json.loads(e["data"]) for e in events if e["event"] == "message_delta"]
    assert delta["usage"] == {"output_tokens": 6}


def test_an_openai_stream_has_usage_only_when_asked(upstream):
    prepared = prepare_request(
        "openai",
        "chat.completions",
        {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]},
    )
    headers = {**prepared.headers, "Authorization": f"Bearer {upstream.secret('openai')}"}
    with egress_stream(
        method="POST",
        url=prepared.url,
        headers=headers,
        body=prepared.body,
        timeout_s=10,
        max_bytes=1 << 20,
    ) as stream:
        events = [e["data"] for e in iter_sse(stream.chunks())]
    assert events[-1] == "[DONE]"
    assert all("usage" not in json.loads(data) for data in events[:-1])


def test_the_log_counts_only_this_tests_requests(upstream):
    assert upstream.requests() == []
    egress_request(
        method="GET",
        url="https://slack.com/landed",
        headers={},
        body=None,
        timeout_s=5,
        max_bytes=100,
    )
    (record,) = upstream.requests(host="slack", method="get")
    assert record["path"] == "/landed" and record["headers"]["host"] == "slack.com"
    assert upstream.env()["KESTREL_EGRESS_HOST_OVERRIDES"] == upstream.overrides


def test_a_client_that_connects_and_never_speaks_holds_up_nobody(upstream):
    with socket.create_connection(("127.0.0.1", upstream.port)):
        answer = egress_request(
            method="GET",
            url="https://api.openai.com/landed",
            headers={},
            body=None,
            timeout_s=10,
            max_bytes=100,
        )
    assert answer.status == 200


def test_a_worker_subprocess_reaches_the_upstream_with_its_env(upstream):
    """What a Celery worker started by a test gets: the settings from ``env()`` alone."""
    script = (
        "import django; django.setup();"
        "from kestrel_one.common.egress import egress_request;"
        "a = egress_request(method='GET', url='https://slack.com/landed', headers={},"
        " body=None, timeout_s=10, max_bytes=100); print(a.status)"
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith("KESTREL_EGRESS_")}
    env = {**base, "DJANGO_SETTINGS_MODULE": "kestrel_one.settings_test", **upstream.env()}
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.stdout.strip() == "200", result.stderr[-2000:]
    assert len(upstream.requests(host="slack.com", path="/landed")) == 1
