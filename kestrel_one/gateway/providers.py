"""The model providers as the gateway speaks to them (pure Python, no Django).

A model is named ``provider/model`` everywhere Kestrel One names one: in a policy's
``model.invoke`` ``models`` list, in the OpenAI-compatible endpoint's ``model`` field, in
usage records (``openai/gpt-4o-mini``, ``anthropic/claude-3-5-haiku-latest``). The provider
part picks the registry adapter and its one operation; the rest is the provider's own name.

Each provider call is the registry operation's exact request (``prepare_request``): this
module only turns one normalized ``ModelRequest`` into that operation's arguments, and reads
the provider's usage back from its answer, whole or streamed as server-sent events. For the
endpoint it also translates Anthropic's messages answers into OpenAI's chat-completion form.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kestrel_one.adapters.registry import get_operation
from kestrel_one.common.jsontext import json_loads

__all__ = [
    "PROVIDERS",
    "AnthropicStreamToOpenAI",
    "ModelRequest",
    "StreamReader",
    "UnknownModel",
    "anthropic_to_openai",
    "completion_text",
    "provider_args",
    "split_model_name",
    "usage_of",
]

# provider -> (registry adapter, operation).
PROVIDERS: dict[str, tuple[str, str]] = {
    "openai": ("openai", "chat.completions"),
    "anthropic": ("anthropic", "messages.create"),
}

_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


class UnknownModel(ValueError):
    """A model name that is not ``provider/model`` with a known provider."""


def split_model_name(name: Any) -> tuple[str, str]:
    """``("openai", "gpt-4o-mini")`` for ``"openai/gpt-4o-mini"``; UnknownModel otherwise."""
    text = name if isinstance(name, str) else ""
    provider, slash, model = text.partition("/")
    if not slash or provider not in PROVIDERS or not _MODEL_NAME.fullmatch(model):
        raise UnknownModel(
            f"name the model as provider/model, e.g. 'openai/gpt-4o-mini' or "
            f"'anthropic/claude-3-5-haiku-latest'; the providers are: {', '.join(PROVIDERS)}"
        )
    return provider, model


@dataclass(frozen=True)
class ModelRequest:
    """One chat call, the same for both providers: text messages with roles."""

    provider: str
    model: str
    messages: tuple[dict[str, str], ...]
    max_tokens: int
    temperature: float | None = None
    stream: bool = False

    @property
    def policy_name(self) -> str:
        return f"{self.provider}/{self.model}"

    @property
    def adapter(self) -> str:
        return PROVIDERS[self.provider][0]

    @property
    def operation(self) -> str:
        return PROVIDERS[self.provider][1]


def provider_args(request: ModelRequest) -> dict[str, Any]:
    """The registry operation's arguments for ``request``.

    OpenAI takes system messages in line; Anthropic takes them as one ``system`` text, so
    they are joined there in order. A stream asks OpenAI for its final usage chunk
    (``stream_options.include_usage``), which is what settles the budget."""
    args: dict[str, Any] = {"model": request.model, "max_tokens": request.max_tokens}
    if request.temperature is not None:
        args["temperature"] = request.temperature
    if request.stream:
        args["stream"] = True
    if request.provider == "openai":
        args["messages"] = [dict(m) for m in request.messages]
        if request.stream:
            args["stream_options"] = {"include_usage": True}
        return args
    system = [m["content"] for m in request.messages if m["role"] in ("system", "developer")]
    args["messages"] = [
        dict(m) for m in request.messages if m["role"] not in ("system", "developer")
    ]
    if system:
        args["system"] = "\n\n".join(system)
    return args


def operation_limits(request: ModelRequest) -> tuple[float, int]:
    """The operation's timeout and response size cap."""
    _, operation = get_operation(request.adapter, request.operation)
    return operation.timeout_s, operation.response_max_bytes


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def usage_of(provider: str, body: Any) -> tuple[int | None, int | None]:
    """(input tokens, output tokens) the provider reported in a whole answer."""
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return None, None
    if provider == "openai":
        return _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens"))
    return _count(usage.get("input_tokens")), _count(usage.get("output_tokens"))


def completion_text(provider: str, body: Any) -> str:
    """The text of a whole answer (what the thread's events keep)."""
    if not isinstance(body, dict):
        return ""
    if provider == "openai":
        choices = body.get("choices") or []
        message = choices[0].get("message") if choices and isinstance(choices[0], dict) else {}
        content = message.get("content") if isinstance(message, dict) else ""
        return content if isinstance(content, str) else ""
    blocks = body.get("content") or []
    return "".join(
        block.get("text", "")
        for block in blocks
        if isinstance(block, dict) and block.get("type") == "text"
    )


def _events(buffer: bytearray) -> Iterator[tuple[str, str, bytes]]:
    """Complete server-sent events taken off the front of ``buffer``: (event, data, the
    event's bytes with its blank-line end)."""
    while True:
        text = bytes(buffer)
        cut = min((i for i in (text.find(b"\n\n"), text.find(b"\r\n\r\n")) if i >= 0), default=-1)
        if cut < 0:
            return
        end = cut + (4 if text.startswith(b"\r\n\r\n", cut) else 2)
        raw = text[:end]
        del buffer[:end]
        event, data = "message", []
        for line in raw.decode("utf-8", "replace").splitlines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].lstrip(" "))
        yield event, "\n".join(data), raw


@dataclass
class StreamReader:
    """Reads a provider's server-sent events as they pass: the usage it reports, the text
    it streamed, and whether it reached its end."""

    provider: str
    input_tokens: int | None = None
    output_tokens: int | None = None
    text: list[str] = field(default_factory=list)
    finished: bool = False
    _buffer: bytearray = field(default_factory=bytearray)

    def feed(self, chunk: bytes) -> list[tuple[str, Any, bytes]]:
        """Read ``chunk``; the complete events in it: (event, data parsed or ``None`` when it
        is not JSON, the event's bytes)."""
        self._buffer += chunk
        parsed: list[tuple[str, Any, bytes]] = []
        for event, data, raw in _events(self._buffer):
            if data.strip() == "[DONE]":
                self.finished = True
                parsed.append((event, None, raw))
                continue
            try:
                payload = json_loads(data) if data else None
            except ValueError:
                payload = None
            if payload is not None:
                self._read(event, payload)
            parsed.append((event, payload, raw))
        return parsed

    def passed_on(self, chunk: bytes, *, include_usage: bool) -> bytes:
        """The OpenAI events in ``chunk`` to send on as they came, read on the way; without
        ``include_usage`` the usage chunk the gateway asked for for itself is left out."""
        out = []
        for _, payload, raw in self.feed(chunk):
            if (
                not include_usage
                and isinstance(payload, dict)
                and not payload.get("choices")
                and payload.get("usage") is not None
            ):
                continue
            out.append(raw)
        return b"".join(out)

    def _read(self, event: str, payload: Any) -> None:
        if not isinstance(payload, dict):
            return
        if self.provider == "openai":
            usage = payload.get("usage")
            if isinstance(usage, dict):
                self.input_tokens = _count(usage.get("prompt_tokens"))
                self.output_tokens = _count(usage.get("completion_tokens"))
            for choice in payload.get("choices") or []:
                delta = choice.get("delta") if isinstance(choice, dict) else None
                if isinstance(delta, dict) and isinstance(delta.get("content"), str):
                    self.text.append(delta["content"])
            return
        kind = payload.get("type", event)
        if kind == "message_start":
            message = payload.get("message")
            usage = message.get("usage") if isinstance(message, dict) else None
            if isinstance(usage, dict):
                self.input_tokens = _count(usage.get("input_tokens"))
                self.output_tokens = _count(usage.get("output_tokens"))
        elif kind == "message_delta":
            usage = payload.get("usage")
            if isinstance(usage, dict):
                # Cumulative counts; newer API versions repeat the input count here too.
                if _count(usage.get("input_tokens")) is not None:
                    self.input_tokens = usage["input_tokens"]
                if _count(usage.get("output_tokens")) is not None:
                    self.output_tokens = usage["output_tokens"]
        elif kind == "content_block_delta":
            delta = payload.get("delta")
            if isinstance(delta, dict) and isinstance(delta.get("text"), str):
                self.text.append(delta["text"])
        elif kind == "message_stop":
            self.finished = True


_FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
}


def anthropic_to_openai(body: Any, *, model: str) -> dict[str, Any]:
    """An Anthropic messages answer in OpenAI's chat-completion form."""
    body = body if isinstance(body, dict) else {}
    input_tokens, output_tokens = usage_of("anthropic", body)
    return {
        "id": str(body.get("id", ""))[:100],
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": completion_text("anthropic", body)},
                "finish_reason": _FINISH_REASONS.get(str(body.get("stop_reason")), "stop"),
            }
        ],
        "usage": {
            "prompt_tokens": input_tokens or 0,
            "completion_tokens": output_tokens or 0,
            "total_tokens": (input_tokens or 0) + (output_tokens or 0),
        },
    }


@dataclass
class AnthropicStreamToOpenAI:
    """Turns Anthropic's stream events into OpenAI ``chat.completion.chunk`` events, ending
    with a usage chunk (when asked) and ``data: [DONE]``."""

    model: str
    include_usage: bool
    reader: StreamReader = field(default_factory=lambda: StreamReader("anthropic"))
    _id: str = ""
    _created: int = field(default_factory=lambda: int(time.time()))
    _done: bool = False

    def _chunk(self, delta: dict, finish_reason: str | None = None, usage=None) -> bytes:
        payload: dict[str, Any] = {
            "id": self._id,
            "object": "chat.completion.chunk",
            "created": self._created,
            "model": self.model,
            "choices": []
            if usage
            else [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
        }
        if usage is not None:
            payload["usage"] = usage
        return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

    def feed(self, chunk: bytes) -> bytes:
        out = []
        for event, payload, _ in self.reader.feed(chunk):
            if not isinstance(payload, dict):
                continue
            kind = payload.get("type", event)
            if kind == "message_start":
                message = payload.get("message") or {}
                self._id = str(message.get("id", ""))[:100] if isinstance(message, dict) else ""
                out.append(self._chunk({"role": "assistant", "content": ""}))
            elif kind == "content_block_delta":
                delta = payload.get("delta") or {}
                if isinstance(delta, dict) and isinstance(delta.get("text"), str):
                    out.append(self._chunk({"content": delta["text"]}))
            elif kind == "message_delta":
                delta = payload.get("delta") or {}
                reason = delta.get("stop_reason") if isinstance(delta, dict) else None
                out.append(self._chunk({}, _FINISH_REASONS.get(str(reason), "stop")))
            elif kind == "message_stop":
                out.append(self.finish())
        return b"".join(out)

    def finish(self) -> bytes:
        if self._done:
            return b""
        self._done = True
        tail = b""
        if self.include_usage:
            prompt, completion = self.reader.input_tokens or 0, self.reader.output_tokens or 0
            tail = self._chunk(
                {},
                usage={
                    "prompt_tokens": prompt,
                    "completion_tokens": completion,
                    "total_tokens": prompt + completion,
                },
            )
        return tail + b"data: [DONE]\n\n"
