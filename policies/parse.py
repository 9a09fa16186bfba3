"""Strict parsing of policy documents.

Nothing is guessed: unknown keys, wrong types, duplicates, redundant or ambiguous patterns
and out-of-range numbers are all errors, and every one found is reported with its exact
path (``capabilities.net.http.allow[2]``). Capability names contain dots, so a path is
``capabilities.<capability>.<field>...``; list items carry ``[index]`` as written.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeGuard

from policies.capabilities import (
    APPROVAL_NEVER,
    APPROVALS,
    EVERYTHING,
    GRANT_KINDS,
    AdapterGrant,
    CodeGrant,
    Grant,
    HttpGrant,
    McpGrant,
    ModelGrant,
    Names,
    PathGrant,
    ServerTools,
    ShellGrant,
    env_name_always_allowed,
)
from policies.caps import DEFAULT_DOCUMENT_LIMITS, DocumentLimits
from policies.errors import PolicyError, PolicyIssue, PolicyTooLarge
from policies.globs import PathSet, first_containers, parse_pattern
from policies.limits import LIMIT_NAMES, Limits, limit_value_problem
from policies.origins import parse_origin
from policies.policy import Policy

# Names that appear in documents. Programs are bare names matched against argv[0] exactly,
# so a path-qualified argv[0] never matches (no "/" allowed here).
_PROGRAM = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]{0,127}")
_MODEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}")
_SERVER_OR_ADAPTER = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
_TOOL_OR_OPERATION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
# The names shell.exec's ``env`` argument accepts.
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_MAX_DESCRIPTION = 2000
# JSON's "\ud800" escapes decode to lone surrogates, which no UTF-8 document can hold: the
# canonical form (and so the content hash) could not be written.
_SURROGATE = re.compile("[\ud800-\udfff]")
_NOT_UNICODE = "contains a lone surrogate, which is not valid Unicode"


class _DuplicateKeys(dict[str, Any]):
    """A JSON object that repeated some keys; the parser reports them at their path."""

    duplicates: tuple[str, ...] = ()


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = _DuplicateKeys(pairs)
    seen: set[str] = set()
    duplicates = []
    for key, _ in pairs:
        if key in seen:
            duplicates.append(key)
        seen.add(key)
    if duplicates:
        result.duplicates = tuple(duplicates)
    return result


def parse_policy_json(
    text: str | bytes, *, limits: DocumentLimits | None = DEFAULT_DOCUMENT_LIMITS
) -> Policy:
    """Parse a policy from JSON text, also rejecting keys an object repeats.

    Prefer this over ``json.loads`` + ``parse_policy`` when the raw body is at hand: a plain
    JSON decoder silently keeps the last of two equal keys. ``limits`` caps the text's bytes
    (checked before decoding) and every list (``PolicyTooLarge``); None lifts the caps.
    """
    if limits is not None:
        size = len(text) if isinstance(text, bytes) else len(text.encode("utf-8", "surrogatepass"))
        if size > limits.bytes:
            raise PolicyTooLarge("", limit="bytes", maximum=limits.bytes, actual=size)
    try:
        data = json.loads(text, object_pairs_hook=_json_object)
    except ValueError as error:
        raise PolicyError([PolicyIssue("", f"is not valid JSON: {error}")]) from None
    except RecursionError:
        raise PolicyError([PolicyIssue("", "nests too deeply to be a policy")]) from None
    return parse_policy(data, limits=limits)


def parse_policy(
    data: object, *, limits: DocumentLimits | None = DEFAULT_DOCUMENT_LIMITS
) -> Policy:
    """Parse a JSON-like policy document strictly; raises PolicyError listing every issue.

    ``limits`` caps every list (``PolicyTooLarge`` at the first one over its cap, before its
    items are read); None lifts the caps, for documents that were checked when published.
    """
    unwritable = _lone_surrogate(data, "")
    if unwritable is not None:
        raise PolicyError([PolicyIssue(unwritable, _NOT_UNICODE)])
    issues: list[PolicyIssue] = []
    reader = _Reader(issues, limits)
    grants: dict[str, Grant] = {}
    description = None
    if reader.mapping(data, "", required=("capabilities",), optional=("description",)):
        if "description" in data:
            description = reader.string(data["description"], "description", limit=_MAX_DESCRIPTION)
        capabilities = data.get("capabilities")
        if "capabilities" in data and reader.mapping(capabilities, "capabilities"):
            for name, raw in capabilities.items():
                path = f"capabilities.{name}"
                parse = _PARSERS.get(name)
                if parse is None:
                    reader.issue(path, f"unknown capability; known: {sorted(GRANT_KINDS)}")
                    continue
                grant = parse(reader, raw, path)
                if grant is not None:
                    grants[name] = grant
    if issues:
        raise PolicyError(issues)
    # No issue: the document was an object.
    return Policy(
        grants, description=description, source=data if isinstance(data, Mapping) else None
    )


def _shown_key(key: str) -> str:
    return key.encode("utf-8", "backslashreplace").decode("utf-8")


def _lone_surrogate(value: object, path: str) -> str | None:
    """The path of the first string or key holding a lone surrogate, or None.

    Checked before anything else, because every message would echo it: keys are shown
    escaped (``\\ud800``) so the answer itself can be written.
    """
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    if isinstance(value, Mapping):
        for key, item in value.items():
            at = f"{path}.{_shown_key(key)}" if path else _shown_key(key)
            if isinstance(key, str) and _SURROGATE.search(key):
                return at
            found = _lone_surrogate(item, at)
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = _lone_surrogate(item, f"{path}[{index}]")
            if found is not None:
                return found
    return None


class _Reader:
    """Type checks that record an issue at a path instead of raising, so all are collected."""

    def __init__(self, issues: list[PolicyIssue], limits: DocumentLimits | None) -> None:
        self.issues = issues
        self.caps = limits

    def bounded(self, value: Mapping[Any, Any] | list[Any], path: str, cap: str) -> None:
        """Raise ``PolicyTooLarge`` if ``value`` holds more items than the ``cap`` allows."""
        if self.caps is None:
            return
        maximum = getattr(self.caps, cap)
        if len(value) > maximum:
            raise PolicyTooLarge(path, limit=cap, maximum=maximum, actual=len(value))

    def issue(self, path: str, message: str) -> None:
        self.issues.append(PolicyIssue(path, message))

    def mapping(
        self,
        value: object,
        path: str,
        *,
        required: tuple[str, ...] = (),
        optional: tuple[str, ...] | None = None,
    ) -> TypeGuard[Mapping[Any, Any]]:
        """Whether ``value`` is an object; with ``optional`` given, its keys are checked too."""
        if not isinstance(value, Mapping):
            self.issue(path, f"must be an object, not {_type_name(value)}")
            return False
        prefix = f"{path}." if path else ""
        for key in getattr(value, "duplicates", ()):
            self.issue(f"{prefix}{key}", "duplicate key")
        for key in value:
            if not isinstance(key, str):
                self.issue(path, f"has a non-string key {key!r}")
            elif optional is not None and key not in required and key not in optional:
                allowed = sorted((*required, *optional))
                self.issue(f"{prefix}{key}", f"unknown key; allowed keys: {allowed}")
        for key in required:
            if key not in value:
                self.issue(f"{prefix}{key}", "is required")
        return True

    def string(self, value: object, path: str, *, limit: int) -> str | None:
        if not isinstance(value, str):
            self.issue(path, f"must be a string, not {_type_name(value)}")
            return None
        if len(value) > limit:
            self.issue(path, f"must be at most {limit} characters")
            return None
        return value

    def approval(self, grant: Mapping[str, Any], path: str) -> str:
        value = grant.get("approval", APPROVAL_NEVER)
        if value not in APPROVALS or not isinstance(value, str):
            self.issue(f"{path}.approval", f"must be one of {list(APPROVALS)}")
        return value if value in APPROVALS else APPROVAL_NEVER

    def items(
        self, value: object, path: str, convert: Callable[[str], Any], *, cap: str
    ) -> list[tuple[int, str, Any]] | None:
        """A non-empty list of strings, each converted; issues for every bad or repeated item.

        Returns ``(index, text, converted)`` for the good items, or None if the list itself
        is unusable. ``convert`` raises ValueError with a message for a bad item.
        """
        if not isinstance(value, list):
            self.issue(path, f"must be a list, not {_type_name(value)}")
            return None
        if not value:
            self.issue(path, "must not be empty; leave the capability out to deny it")
            return None
        self.bounded(value, path, cap)
        good: list[tuple[int, str, Any]] = []
        first_index: dict[Any, int] = {}
        for index, item in enumerate(value):
            if not isinstance(item, str):
                self.issue(f"{path}[{index}]", f"must be a string, not {_type_name(item)}")
                continue
            try:
                converted = convert(item)
            except ValueError as error:
                self.issue(f"{path}[{index}]", f"'{item}': {error}")
                continue
            first = first_index.setdefault(converted, index)
            if first != index:
                self.issue(f"{path}[{index}]", f"'{item}' repeats [{first}]")
                continue
            good.append((index, item, converted))
        return good

    def name_items(
        self, value: object, path: str, pattern: re.Pattern[str], what: str, *, cap: str
    ) -> list[tuple[int, str, Any]] | None:
        """``items`` for a list of names: ``(index, name, name)`` for each valid one."""

        def convert(text: str) -> str:
            if not pattern.fullmatch(text):
                raise ValueError(f"not a valid {what} name")
            return text

        return self.items(value, path, convert, cap=cap)

    def names(
        self, value: object, path: str, pattern: re.Pattern[str], what: str, *, cap: str
    ) -> frozenset[str] | None:
        items = self.name_items(value, path, pattern, what, cap=cap)
        return None if items is None else frozenset(text for _, text, _ in items)

    def limits(self, grant: Mapping[str, Any], path: str) -> Limits:
        raw = grant.get("limits", {})
        at = f"{path}.limits"
        values: dict[str, float] = {}
        if self.mapping(raw, at, optional=LIMIT_NAMES):
            for name, value in raw.items():
                if name not in LIMIT_NAMES:
                    continue
                problem = limit_value_problem(name, value)
                if problem:
                    self.issue(f"{at}.{name}", problem)
                else:
                    values[name] = value
        return Limits.from_mapping(values)


def _type_name(value: object) -> str:
    names = {type(None): "null", bool: "a boolean", str: "a string", list: "a list"}
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return "a number"
    return names.get(type(value), type(value).__name__)


def _paths(reader: _Reader, raw: object, path: str) -> PathGrant | None:
    if not reader.mapping(raw, path, required=("paths",), optional=("approval",)):
        return None
    approval = reader.approval(raw, path)
    at = f"{path}.paths"
    items = (
        reader.items(raw.get("paths"), at, parse_pattern, cap="paths") if "paths" in raw else None
    )
    if not items:
        return None
    # A pattern another one already covers says nothing; more likely a mistake than intent.
    patterns = [pattern for _, _, pattern in items]
    covered = False
    for (index, _, pattern), container in zip(items, first_containers(patterns), strict=True):
        if container is not None:
            covered = True
            other_index, _, other = items[container]
            reader.issue(
                f"{at}[{index}]", f"'{pattern}' is already covered by '{other}' at [{other_index}]"
            )
    return None if covered else PathGrant(approval, PathSet(patterns, maximal=True))


def _env_name(text: str) -> str:
    if not _ENV_NAME.fullmatch(text):
        raise ValueError("not a valid environment variable name (letters, digits, '_')")
    if env_name_always_allowed(text):
        raise ValueError("is always allowed; leave it out")
    return text


def _shell(reader: _Reader, raw: object, path: str) -> ShellGrant | None:
    if not reader.mapping(raw, path, optional=("approval", "commands", "env", "limits")):
        return None
    commands: Names | None = EVERYTHING
    if "commands" in raw:
        commands = reader.names(
            raw["commands"], f"{path}.commands", _PROGRAM, "program", cap="commands"
        )
    env: frozenset[str] | None = frozenset()
    if "env" in raw:
        items = reader.items(raw["env"], f"{path}.env", _env_name, cap="env")
        env = None if items is None else frozenset(text for _, text, _ in items)
    approval, limits = reader.approval(raw, path), reader.limits(raw, path)
    if commands is None or env is None:
        return None
    return ShellGrant(approval, commands, limits, env)


def _code(reader: _Reader, raw: object, path: str) -> CodeGrant | None:
    if not reader.mapping(raw, path, optional=("approval", "limits")):
        return None
    return CodeGrant(reader.approval(raw, path), reader.limits(raw, path))


def _http(reader: _Reader, raw: object, path: str) -> HttpGrant | None:
    if not reader.mapping(
        raw, path, required=("allow",), optional=("allow_ip_literals", "approval")
    ):
        return None
    approval = reader.approval(raw, path)
    allow_ip_literals = raw.get("allow_ip_literals", False)
    if not isinstance(allow_ip_literals, bool):
        reader.issue(f"{path}.allow_ip_literals", "must be true or false")
        allow_ip_literals = False
    if "allow" not in raw:
        return None
    items = reader.items(
        raw["allow"],
        f"{path}.allow",
        lambda text: parse_origin(text, allow_ip_literals=allow_ip_literals),
        cap="origins",
    )
    if not items:
        return None
    return HttpGrant(approval, frozenset(origin for _, _, origin in items))


def _models(reader: _Reader, raw: object, path: str) -> ModelGrant | None:
    if not reader.mapping(raw, path, required=("models",), optional=("approval",)):
        return None
    approval = reader.approval(raw, path)
    models = (
        reader.names(raw.get("models"), f"{path}.models", _MODEL, "model", cap="models")
        if "models" in raw
        else None
    )
    return None if not models else ModelGrant(approval, models)


def _keyed(
    reader: _Reader,
    raw: object,
    path: str,
    what: str,
    parse_entry: Callable[[object, str], Any],
    *,
    cap: str,
) -> tuple[tuple[str, Any], ...] | None:
    """A non-empty ``{name: entry}`` object of servers or adapters, sorted by name."""
    if not reader.mapping(raw, path):
        return None
    if not raw:
        reader.issue(path, "must not be empty; leave the capability out to deny it")
        return None
    reader.bounded(raw, path, cap)
    entries = []
    for name, entry in raw.items():
        at = f"{path}.{name}"
        if not isinstance(name, str):
            continue
        if not _SERVER_OR_ADAPTER.fullmatch(name):
            reader.issue(
                at, f"'{name}' is not a valid {what} name (lower case letters, digits, '-', '_')"
            )
            continue
        parsed = parse_entry(entry, at)
        if parsed is not None:
            entries.append((name, parsed))
    return tuple(sorted(entries))


def _mcp(reader: _Reader, raw: object, path: str) -> McpGrant | None:
    if not reader.mapping(raw, path, required=("servers",), optional=("approval",)):
        return None
    approval = reader.approval(raw, path)

    def server(entry: object, at: str) -> ServerTools | None:
        if not reader.mapping(entry, at, required=("tools",), optional=("dangerous",)):
            return None
        tools = (
            reader.names(entry.get("tools"), f"{at}.tools", _TOOL_OR_OPERATION, "tool", cap="tools")
            if "tools" in entry
            else None
        )
        dangerous: frozenset[str] = frozenset()
        if "dangerous" in entry:
            # Only the items that are valid names are checked against the tools: the others
            # have their issue already, and may be anything JSON holds (a list, an object).
            opted = reader.name_items(
                entry["dangerous"], f"{at}.dangerous", _TOOL_OR_OPERATION, "tool", cap="tools"
            )
            dangerous = frozenset(name for _, name, _ in opted or ())
            for index, name, _ in opted or ():
                if tools is not None and name not in tools:
                    reader.issue(
                        f"{at}.dangerous[{index}]", f"'{name}' is not one of this server's tools"
                    )
        return ServerTools(tools, dangerous) if tools else None

    servers = (
        _keyed(reader, raw.get("servers"), f"{path}.servers", "server", server, cap="servers")
        if "servers" in raw
        else None
    )
    return McpGrant(approval, servers) if servers else None


def _adapters(reader: _Reader, raw: object, path: str) -> AdapterGrant | None:
    if not reader.mapping(raw, path, required=("adapters",), optional=("approval",)):
        return None
    approval = reader.approval(raw, path)

    def adapter(entry: object, at: str) -> frozenset[str] | None:
        if not reader.mapping(entry, at, required=("operations",), optional=()):
            return None
        if "operations" not in entry:
            return None
        return reader.names(
            entry["operations"],
            f"{at}.operations",
            _TOOL_OR_OPERATION,
            "operation",
            cap="operations",
        )

    adapters = (
        _keyed(reader, raw.get("adapters"), f"{path}.adapters", "adapter", adapter, cap="adapters")
        if "adapters" in raw
        else None
    )
    return AdapterGrant(approval, adapters) if adapters else None


_Parser = Callable[[_Reader, object, str], Grant | None]
# One parser per kind of grant; which capability has which kind is GRANT_KINDS' alone, so a
# new capability of a known kind needs nothing here, and one of a new kind fails at import.
_PARSER_FOR_KIND: Mapping[type[Grant], _Parser] = {
    PathGrant: _paths,
    ShellGrant: _shell,
    CodeGrant: _code,
    HttpGrant: _http,
    ModelGrant: _models,
    McpGrant: _mcp,
    AdapterGrant: _adapters,
}
_PARSERS: Mapping[str, _Parser] = {
    name: _PARSER_FOR_KIND[kind] for name, kind in GRANT_KINDS.items()
}
