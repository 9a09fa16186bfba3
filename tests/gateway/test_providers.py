"""The provider forms (pure): names, arguments, usage, streams, translation."""

from __future__ import annotations

import json

import pytest

from kestrel_one.adapters.registry import validate_operation_args
from kestrel_one.gateway.providers import (
    AnthropicStreamToOpenAI,
    ModelRequest,
    StreamReader,
    UnknownModel,
    anthropic_to_openai,
    provider_args,
    split_model_name,
    usage_of,
)

MESSAGES = (
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "developer", "content": "No emoji."},
)


def test_model_names_are_provider_slash_model():
    assert split_model_name("openai/gpt-4o-mini") == ("openai", "gpt-4o-mini")
    assert split_model_name("anthropic/claude-3-5-haiku-latest")[0] == "anthropic"
    for bad in ("gpt-4o", "google/gemini", "openai/", "openai/a b", None, "openai//x"):
        with pytest.raises(UnknownModel):
            split_model_name(bad)


def test_anthropic_takes_system_messages_as_one_system_text():
    request = ModelRequest("anthropic", "claude-3-5-haiku-latest", MESSAGES, 100, 0.5, True)
    args = provider_args(request)
    assert args["system"] == "Be brief.\n\nNo emoji."
    assert args["messages"] == [{"role": "user", "content": "Hi"}]
    assert args["stream"] is True and "stream_options" not in args
    validate_operation_args("anthropic", "messages.create", args)


def test_openai_streams_ask_for_their_usage():
    args = provider_args(ModelRequest("openai", "gpt-4o-mini", MESSAGES, 100, stream=True))
    assert args["stream_options"] == {"include_usage": True}
    assert len(args["messages"]) == 3
    validate_operation_args("openai", "chat.completions", args)


def test_usage_is_read_from_whole_answers():
    assert usage_of("openai", {"usage": {"prompt_tokens": 3, "completion_tokens": 4}}) == (3, 4)
    assert usage_of("anthropic", {"usage": {"input_tokens": 3, "output_tokens": 4}}) == (3, 4)
    assert usage_of("openai", {"usage": {"prompt_tokens": -1, "completion_tokens": True}}) == (
        None,
        None,
    )
    assert usage_of("openai", []) == (None, None)


def _sse(*events) -> bytes:
    return b"".join(
        (f"event: {name}\n" if name else "").encode()
        + b"data: "
        + json.dumps(data).encode()
        + b"\n\n"
        for name, data in events
    )


ANTHROPIC_STREAM = _sse(
    (
        "message_start",
        {
            "type": "message_start",
            "message": {"id": "msg_1", "usage": {"input_tokens": 7, "output_tokens": 1}},
        },
    ),
    (
        "content_block_delta",
        {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "Hel"}},
    ),
    (
        "content_block_delta",
        {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "lo"}},
    ),
    (
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn"},
            "usage": {"output_tokens": 2},
        },
    ),
    ("message_stop", {"type": "message_stop"}),
)


def test_a_stream_read_in_any_chunking_gives_the_same_usage():
    for size in (1, 7, 64, len(ANTHROPIC_STREAM)):
        reader = StreamReader("anthropic")
        for i in range(0, len(ANTHROPIC_STREAM), size):
            reader.feed(ANTHROPIC_STREAM[i : i + size])
        assert (reader.input_tokens, reader.output_tokens) == (7, 2)
        assert "".join(reader.text) == "Hello" and reader.finished


def test_an_anthropic_stream_becomes_openai_chunks():
    translator = AnthropicStreamToOpenAI(model="anthropic/x", include_usage=True)
    out = translator.feed(ANTHROPIC_STREAM) + translator.finish()
    events = [block[6:] for block in out.decode().split("\n\n") if block.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert (
        "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        == "Hello"
    )
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert chunks[-1]["usage"] == {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}


def test_an_openai_stream_leaves_out_the_usage_chunk_unless_asked():
    stream = (
        _sse(
            (None, {"choices": [{"delta": {"content": "Hi"}}], "usage": None}),
            (None, {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}),
        )
        + b"data: [DONE]\n\n"
    )
    reader = StreamReader("openai")
    out = reader.passed_on(stream, include_usage=False)
    assert b'"prompt_tokens"' not in out and out.endswith(b"data: [DONE]\n\n")
    assert (reader.input_tokens, reader.output_tokens) == (1, 1)
    assert StreamReader("openai").passed_on(stream, include_usage=True) == stream


def test_an_anthropic_answer_in_the_openai_form():
    body = {
        "id": "msg_1",
        "content": [{"type": "text", "text": "Hi"}],
        "stop_reason": "max_tokens",
        "usage": {"input_tokens": 2, "output_tokens": 1},
    }
    answer = anthropic_to_openai(body, model="anthropic/x")
    assert answer["choices"][0] == {
        "index": 0,
        "message": {"role": "assistant", "content": "Hi"},
        "finish_reason": "length",
    }
    assert answer["usage"]["total_tokens"] == 3
