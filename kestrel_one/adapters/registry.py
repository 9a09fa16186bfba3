"""The trusted host adapters: a static registry, in code, like the tools (CRED-2, CRED-4).

Each adapter names the kind of credential it takes and how that credential is presented;
each of its operations owns one exact HTTPS resource: a method, a host, a port and a path
template whose parameters are typed, plus the argument schema, the effect (``read`` or
``external``), a response size cap and a timeout. Nothing registers an adapter at run time:
an adapter, operation, credential kind or effect that is not written here can only ever
meet ``UnknownAdapter`` or ``UnknownOperation``.

Pure Python (no Django): the control tier builds requests from it, the API and console list
it, and the policy engine's ``adapter.invoke`` grants name its adapters and operations.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any
from urllib.parse import quote, urlencode

import jsonschema
import jsonschema.exceptions

__all__ = [
    "ADAPTERS",
    "CREDENTIAL_KINDS",
    "Adapter",
    "Effect",
    "InvalidOperationArguments",
    "Operation",
    "PathParam",
    "PreparedRequest",
    "Presentation",
    "UnknownAdapter",
    "UnknownOperation",
    "get_adapter",
    "get_operation",
    "prepare_request",
    "validate_operation_args",
]


class Effect(StrEnum):
    """What an operation does to the world outside: ``read`` changes nothing there;
    ``external`` does (a comment posted, a message sent) and needs a person's approval
    bound to the exact action and an idempotency key (CRED-5)."""

    READ = "read"
    EXTERNAL = "external"


class UnknownAdapter(LookupError):
    """No adapter of that name is registered."""


class UnknownOperation(LookupError):
    """The adapter has no operation of that name."""


class InvalidOperationArguments(ValueError):
    """An operation's arguments do not match its schema; ``field`` names the offender."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


@dataclass(frozen=True)
class Presentation:
    """How the credential travels: one request header, its value ``form`` with ``{secret}``
    where the secret goes (``Bearer {secret}``)."""

    header: str
    form: str

    def header_value(self, secret: str) -> str:
        return self.form.replace("{secret}", secret)


@dataclass(frozen=True)
class PathParam:
    """A typed path parameter: a string matching ``pattern`` whole, or a positive integer."""

    name: str
    type: str  # "string" | "integer"
    pattern: str = ""
    maximum: int = 2**31 - 1

    def schema(self) -> dict[str, Any]:
        if self.type == "integer":
            return {"type": "integer", "minimum": 1, "maximum": self.maximum}
        return {"type": "string", "pattern": self.pattern}


@dataclass(frozen=True)
class Operation:
    """One exact HTTPS resource an adapter may reach, and what its arguments are.

    ``path`` is a template (``/repos/{owner}/{repo}/issues``) whose every ``{name}`` is a
    ``PathParam``; ``query`` and ``body`` name the arguments that go into the query string
    and the JSON body. Every argument is in exactly one of the three. ``headers`` are fixed
    request headers (an API version, ``Accept``); ``idempotency_header`` is the provider's
    own idempotency header, when it has one.
    """

    name: str
    summary: str
    method: str
    host: str
    path: str
    effect: Effect
    path_params: tuple[PathParam, ...] = ()
    query: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    body: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    required: tuple[str, ...] = ()
    port: int = 443
    headers: Mapping[str, str] = field(default_factory=dict)
    response_max_bytes: int = 1024 * 1024
    timeout_s: float = 30.0
    idempotency_header: str | None = None
    # The provider can answer as a stream of server-sent events (``"stream": true``).
    streams: bool = False

    def input_schema(self) -> dict[str, Any]:
        properties: dict[str, Any] = {param.name: param.schema() for param in self.path_params}
        properties.update(copy.deepcopy(dict(self.query)))
        properties.update(copy.deepcopy(dict(self.body)))
        required = sorted({param.name for param in self.path_params} | set(self.required))
        return {
            "type": "object",
            "properties": properties,
            "required": required,
            "additionalProperties": False,
        }

    def resource(self) -> str:
        """The resource as people read it: ``POST https://api.github.com/repos/{owner}/...``."""
        port = "" if self.port == 443 else f":{self.port}"
        return f"{self.method} https://{self.host}{port}{self.path}"


@dataclass(frozen=True)
class Adapter:
    """A trusted host adapter: the credential kind it takes, how it presents it, and its
    operations."""

    name: str
    summary: str
    credential_kind: str
    presentation: Presentation
    operations: Mapping[str, Operation]
    # A model provider: only the model gateway calls it (model.invoke and the chat-completions
    # endpoint), under the project's model list and token budget; adapter.invoke refuses it.
    model_provider: bool = False


@dataclass(frozen=True)
class PreparedRequest:
    """The exact request an operation makes, without its credential (added at send time)."""

    method: str
    url: str
    headers: Mapping[str, str]
    body: bytes | None


# A GitHub owner (user or organization) and repository name, as GitHub allows them.
_GITHUB_OWNER = r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,38})$"
_GITHUB_REPO = r"^(?!\.{1,2}$)[A-Za-z0-9._-]{1,100}$"
_GITHUB_HEADERS = MappingProxyType(
    {"Accept": "application/vnd.github+json", "X-GitHub-Api-Version": "2022-11-28"}
)
_TEXT = {"type": "string", "minLength": 1, "maxLength": 65536}

# Chat messages: OpenAI's chat-completions form and Anthropic's messages form share it for
# text content (a role and a string); content parts are not taken yet.
_MESSAGES = {
    "type": "array",
    "minItems": 1,
    "maxItems": 1000,
    "items": {
        "type": "object",
        "properties": {
            "role": {"type": "string", "enum": ["system", "developer", "user", "assistant"]},
            "content": {"type": "string", "maxLength": 1_000_000},
        },
        "required": ["role", "content"],
        "additionalProperties": False,
    },
}
_MODEL = {"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$"}

GITHUB = Adapter(
    name="github",
    summary="GitHub's REST API, with a personal access token or an app installation token.",
    credential_kind="github_token",
    presentation=Presentation(header="Authorization", form="Bearer {secret}"),
    operations=MappingProxyType(
        {
            "issues.list": Operation(
                name="issues.list",
                summary="List a repository's issues.",
                method="GET",
                host="api.github.com",
                path="/repos/{owner}/{repo}/issues",
                effect=Effect.READ,
                path_params=(
                    PathParam("owner", "string", _GITHUB_OWNER),
                    PathParam("repo", "string", _GITHUB_REPO),
                ),
                query={
                    "state": {"type": "string", "enum": ["open", "closed", "all"]},
                    "per_page": {"type": "integer", "minimum": 1, "maximum": 100},
                    "page": {"type": "integer", "minimum": 1, "maximum": 10000},
                },
                headers=_GITHUB_HEADERS,
            ),
            "issue_comment.create": Operation(
                name="issue_comment.create",
                summary="Comment on an issue or pull request.",
                method="POST",
                host="api.github.com",
                path="/repos/{owner}/{repo}/issues/{issue_number}/comments",
                effect=Effect.EXTERNAL,
                path_params=(
                    PathParam("owner", "string", _GITHUB_OWNER),
                    PathParam("repo", "string", _GITHUB_REPO),
                    PathParam("issue_number", "integer"),
                ),
                body={"body": _TEXT},
                required=("body",),
                headers=_GITHUB_HEADERS,
            ),
        }
    ),
)

SLACK = Adapter(
    name="slack",
    summary="Slack's Web API, with a bot token.",
    credential_kind="slack_bot_token",
    presentation=Presentation(header="Authorization", form="Bearer {secret}"),
    operations=MappingProxyType(
        {
            "chat.postMessage": Operation(
                name="chat.postMessage",
                summary="Post a message to a channel.",
                method="POST",
                host="slack.com",
                path="/api/chat.postMessage",
                effect=Effect.EXTERNAL,
                body={
                    "channel": {"type": "string", "pattern": r"^[A-Za-z0-9#_-]{1,80}$"},
                    "text": {"type": "string", "minLength": 1, "maxLength": 40000},
                    "thread_ts": {"type": "string", "pattern": r"^[0-9]{1,12}\.[0-9]{1,8}$"},
                },
                required=("channel", "text"),
            ),
        }
    ),
)

OPENAI = Adapter(
    name="openai",
    summary="An OpenAI-compatible chat-completions API (the model gateway's provider).",
    credential_kind="openai_api_key",
    model_provider=True,
    presentation=Presentation(header="Authorization", form="Bearer {secret}"),
    operations=MappingProxyType(
        {
            "chat.completions": Operation(
                name="chat.completions",
                summary="Create a chat completion.",
                method="POST",
                host="api.openai.com",
                path="/v1/chat/completions",
                effect=Effect.READ,
                body={
                    "model": _MODEL,
                    "messages": _MESSAGES,
                    "max_tokens": {"type": "integer", "minimum": 1, "maximum": 1_000_000},
                    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
                    "stream": {"type": "boolean"},
                    # Asks for the final usage chunk of a stream (the gateway settles on it).
                    "stream_options": {
                        "type": "object",
                        "properties": {"include_usage": {"type": "boolean"}},
                        "additionalProperties": False,
                    },
                },
                required=("model", "messages"),
                response_max_bytes=8 * 1024 * 1024,
                timeout_s=120.0,
                streams=True,
            ),
        }
    ),
)

ANTHROPIC = Adapter(
    name="anthropic",
    summary="Anthropic's messages API (the model gateway's provider).",
    credential_kind="anthropic_api_key",
    model_provider=True,
    presentation=Presentation(header="x-api-key", form="{secret}"),
    operations=MappingProxyType(
        {
            "messages.create": Operation(
                name="messages.create",
                summary="Create a message.",
                method="POST",
                host="api.anthropic.com",
                path="/v1/messages",
                effect=Effect.READ,
                body={
                    "model": _MODEL,
                    "messages": _MESSAGES,
                    "system": {"type": "string", "maxLength": 1_000_000},
                    "max_tokens": {"type": "integer", "minimum": 1, "maximum": 1_000_000},
                    "temperature": {"type": "number", "minimum": 0, "maximum": 1},
                    "stream": {"type": "boolean"},
                },
                required=("model", "messages", "max_tokens"),
                headers=MappingProxyType({"anthropic-version": "2023-06-01"}),
                response_max_bytes=8 * 1024 * 1024,
                timeout_s=120.0,
                streams=True,
            ),
        }
    ),
)

ADAPTERS: Mapping[str, Adapter] = MappingProxyType(
    {adapter.name: adapter for adapter in (GITHUB, SLACK, OPENAI, ANTHROPIC)}
)
CREDENTIAL_KINDS: frozenset[str] = frozenset(a.credential_kind for a in ADAPTERS.values())

_PLACEHOLDER = re.compile(r"\{([a-z_]+)\}")
_IDENTIFIER = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE"})
_HOST = re.compile(r"^(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z]{2,63}$")


def registry_check(
    adapters: Mapping[str, Adapter],
) -> dict[tuple[str, str], jsonschema.Draft202012Validator]:
    """Every adapter and operation is well formed, or importing this module fails: a known
    credential presentation, an effect that is an ``Effect``, a plain method and host, every
    template placeholder typed, every argument in one place, schemas valid."""
    validators = {}
    for name, adapter in adapters.items():
        if name != adapter.name or not _IDENTIFIER.match(adapter.credential_kind):
            raise TypeError(f"{name}: name or credential kind is wrong")
        if "{secret}" not in adapter.presentation.form:
            raise TypeError(f"{name}: the presentation does not carry the secret")
        for key, operation in adapter.operations.items():
            where = f"{adapter.name}.{key}"
            if key != operation.name or not isinstance(operation.effect, Effect):
                raise TypeError(f"{where}: name or effect is wrong")
            if operation.method not in _METHODS or not _HOST.match(operation.host):
                raise TypeError(f"{where}: method or host is wrong")
            placeholders = _PLACEHOLDER.findall(operation.path)
            params = [param.name for param in operation.path_params]
            if placeholders != params or not operation.path.startswith("/"):
                raise TypeError(f"{where}: path placeholders {placeholders} != params {params}")
            names = params + list(operation.query) + list(operation.body)
            if len(names) != len(set(names)) or not set(operation.required) <= set(names):
                raise TypeError(f"{where}: an argument is in two places or required unknown")
            schema = operation.input_schema()
            jsonschema.Draft202012Validator.check_schema(schema)
            validators[adapter.name, key] = jsonschema.Draft202012Validator(schema)
    return validators


_VALIDATORS = registry_check(ADAPTERS)


def get_adapter(name: Any) -> Adapter:
    """The registered adapter called ``name``; anything else raises ``UnknownAdapter``."""
    try:
        return ADAPTERS[name]
    except (KeyError, TypeError):
        raise UnknownAdapter(
            f"unknown adapter {str(name)[:64]!r}; the adapters are: {', '.join(sorted(ADAPTERS))}"
        ) from None


def get_operation(adapter_name: Any, operation_name: Any) -> tuple[Adapter, Operation]:
    """The adapter and its operation; ``UnknownAdapter`` or ``UnknownOperation`` otherwise."""
    adapter = get_adapter(adapter_name)
    try:
        return adapter, adapter.operations[operation_name]
    except (KeyError, TypeError):
        raise UnknownOperation(
            f"adapter {adapter.name!r} has no operation {str(operation_name)[:64]!r}; its "
            f"operations are: {', '.join(sorted(adapter.operations))}"
        ) from None


def validate_operation_args(adapter_name: str, operation_name: str, args: Any) -> dict[str, Any]:
    """Check ``args`` against the operation's schema; a plain copy, or the offending field."""
    adapter, operation = get_operation(adapter_name, operation_name)
    validator = _VALIDATORS[adapter.name, operation.name]
    error = jsonschema.exceptions.best_match(validator.iter_errors(args))
    if error is not None:
        field_name = "args.args" + "".join(
            f"[{part}]" if isinstance(part, int) else f".{part}" for part in error.absolute_path
        )
        if error.validator == "required":
            missing = [key for key in error.validator_value if key not in error.instance]
            return _raise(f"{field_name}.{missing[0]}", "is required")
        if error.validator == "additionalProperties":
            allowed = sorted(operation.input_schema()["properties"])
            unexpected = sorted(str(k) for k in error.instance if k not in allowed)[0][:64]
            return _raise(
                f"{field_name}.{unexpected}",
                f"unknown argument; {adapter.name} {operation.name} takes: {', '.join(allowed)}",
            )
        return _raise(field_name, error.message[:300])
    return copy.deepcopy(args)


def _raise(field_name: str, reason: str) -> dict[str, Any]:
    raise InvalidOperationArguments(field_name, reason)


def prepare_request(adapter_name: str, operation_name: str, args: Any) -> PreparedRequest:
    """The exact request for already validated ``args``: the path parameters percent-encoded
    into the template (a ``/`` in a value cannot reach another resource), the query and the
    JSON body from their arguments, the operation's fixed headers. No credential."""
    _, operation = get_operation(adapter_name, operation_name)
    args = validate_operation_args(adapter_name, operation_name, args)
    path = operation.path
    for param in operation.path_params:
        path = path.replace("{" + param.name + "}", quote(str(args[param.name]), safe=""))
    query = {name: args[name] for name in operation.query if name in args}
    port = "" if operation.port == 443 else f":{operation.port}"
    url = f"https://{operation.host}{port}{path}"
    if query:
        url += "?" + urlencode(sorted(query.items()))
    headers = dict(operation.headers)
    body = None
    body_args = {name: args[name] for name in operation.body if name in args}
    if operation.method != "GET":
        body = json.dumps(body_args, separators=(",", ":"), sort_keys=True).encode()
        headers["Content-Type"] = "application/json; charset=utf-8"
    return PreparedRequest(method=operation.method, url=url, headers=headers, body=body)
