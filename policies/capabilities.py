"""The typed capabilities a policy grants, and the lattice operations on each kind.

Every grant answers four questions the same way for its kind: what it has in common with
another grant of the same capability (``meet``), where it grants more than a parent grant
(``widenings``), how it is written canonically (``to_document``), and whether it covers a
request (``judge``). A grant that would grant nothing is never built: ``meet`` returns None
instead, and the policy then simply lacks the capability, which is how denial is spelled.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from policies.globs import PathSet, parse_pattern, path_problem
from policies.limits import Limits
from policies.origins import Origin, origin_of_url
from policies.request import Request

APPROVAL_NEVER = "never"
APPROVAL_ALWAYS = "always"
APPROVALS = (APPROVAL_NEVER, APPROVAL_ALWAYS)  # from loosest to strictest

# Environment variables a shell call may always overlay: they say how output looks (locale,
# time zone, terminal, colour) and change nothing a process loads or runs. Every other name
# (LD_PRELOAD, PATH, PYTHONPATH, BASH_ENV, ENV, IFS, GCONV_PATH, NODE_OPTIONS, PERL5OPT, ...)
# needs the policy to grant it by name in shell.exec ``env``. Deliberately left out although
# they look harmless: PAGER, EDITOR, VISUAL, GIT_* (they name programs to run),
# PYTHONWARNINGS (a warning category is imported), TERMINFO and LOCPATH (files to load).
ALWAYS_ALLOWED_ENV_NAMES: frozenset[str] = frozenset(
    {
        "LANG",
        "LANGUAGE",
        "TZ",
        "TERM",
        "COLORTERM",
        "NO_COLOR",
        "FORCE_COLOR",
        "CLICOLOR",
        "CLICOLOR_FORCE",
        "COLUMNS",
        "LINES",
        "CI",
        "SOURCE_DATE_EPOCH",
        "PYTHONUNBUFFERED",
        "PYTHONDONTWRITEBYTECODE",
        "PYTHONHASHSEED",
        "PYTHONUTF8",
    }
)
# Locale categories (LC_ALL, LC_CTYPE, LC_MESSAGES, ...): names, never paths to load.
ALWAYS_ALLOWED_ENV_PREFIXES: tuple[str, ...] = ("LC_",)


def env_name_always_allowed(name: str) -> bool:
    """Whether a shell call may overlay ``name`` under any policy that grants shell.exec."""
    return name in ALWAYS_ALLOWED_ENV_NAMES or name.startswith(ALWAYS_ALLOWED_ENV_PREFIXES)


class Everything:
    """The unbounded set: every path, program, origin, model, server, tool or operation.

    Documents cannot write it (net.http, for one, must list origins exactly); it exists so
    that a mask (``Policy.allowing``) can keep a capability at full width, which makes a
    meet with the mask leave that capability exactly as the other side has it.
    """

    _instance: Everything | None = None

    def __new__(cls) -> Everything:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "EVERYTHING"

    def __reduce__(self) -> str:
        return "EVERYTHING"


EVERYTHING = Everything()
Names = frozenset[str] | Everything


@dataclass(frozen=True)
class Widening:
    """One place where a child policy grants more than its parent."""

    path: str
    message: str


class Location:
    """Where in the child's document a widening sits, so its path points at what was written.

    Indices come from the list as the author wrote it when the child was parsed from a
    document, and from the canonical (sorted) list otherwise.
    """

    def __init__(self, capability: str, path: str, raw: object, parent_label: str) -> None:
        self.capability = capability
        self.path = path
        self.raw = raw
        self.parent_label = parent_label

    def key(self, name: str) -> Location:
        raw = self.raw.get(name) if isinstance(self.raw, Mapping) else None
        return Location(self.capability, f"{self.path}.{name}", raw, self.parent_label)

    def item(self, value: str, canonical: Sequence[str]) -> str:
        index = self.raw.index(value) if isinstance(self.raw, list) and value in self.raw else None
        if index is None:
            index = list(canonical).index(value)
        return f"{self.path}[{index}]"

    def written(self) -> bool:
        """Whether the child's document states this field (rather than a default)."""
        return self.raw is not None


# A message lists at most this many names or patterns: a reason must stay readable, and one
# per request must not cost as much as the list is long.
SHOWN_ITEMS = 10


def shown(items: Iterable[object], *, ordered: bool = False) -> str:
    """``items`` sorted, as a message lists them: ``['a', 'b']``, or the first
    ``SHOWN_ITEMS`` and how many more there are. ``ordered``: they are sorted strings."""
    texts = [str(item) for item in items] if ordered else sorted(map(str, items))
    if len(texts) <= SHOWN_ITEMS:
        return str(texts)
    return f"{str(texts[:SHOWN_ITEMS])[:-1]}, ... and {len(texts) - SHOWN_ITEMS} more]"


def stricter_approval(first: str, second: str) -> str:
    return max(first, second, key=APPROVALS.index)


def meet_names(first: Names, second: Names) -> Names:
    if isinstance(first, Everything):
        return second
    if isinstance(second, Everything):
        return first
    return first & second


def _extra_names(child: Names, parent: Names) -> list[str] | Everything | None:
    """Names the child has beyond the parent: a sorted list, EVERYTHING, or None if none."""
    if isinstance(parent, Everything):
        return None
    if isinstance(child, Everything):
        return EVERYTHING
    return sorted(child - parent) or None


def _names_document(names: Names, what: str) -> list[str]:
    if isinstance(names, Everything):
        raise ValueError(f"a grant of every {what} has no document form; meet it with a document")
    return sorted(names)


def _names_widenings(
    child: Names, parent: Names, where: Location, noun: str, scope: str
) -> list[Widening]:
    extra = _extra_names(child, parent)
    if extra is None:
        return []
    ceiling = shown(parent) if isinstance(parent, frozenset) else repr(parent)
    if isinstance(extra, Everything):
        message = (
            f"{where.capability} allows every {noun}{scope}; "
            f"the {where.parent_label}'s allows only {ceiling}"
        )
        return [Widening(where.path, message)]
    # Only a finite child has finite extras (an unbounded one returned above).
    canonical = sorted(child) if isinstance(child, frozenset) else []
    return [
        Widening(
            where.item(name, canonical),
            f"{where.capability} {noun} '{name}'{scope} is not in "
            f"the {where.parent_label}'s {ceiling}",
        )
        for name in extra
    ]


@dataclass(frozen=True)
class Grant:
    """What every capability grant has: whether a person must approve each use."""

    approval: str = APPROVAL_NEVER

    def _approval_widenings(self, parent: Grant, where: Location) -> list[Widening]:
        if APPROVALS.index(self.approval) >= APPROVALS.index(parent.approval):
            return []
        return [
            Widening(
                where.key("approval").path,
                f"{where.capability} approval '{self.approval}' is looser than the "
                f"{where.parent_label}'s '{parent.approval}'",
            )
        ]

    def meet(self, other: Any) -> Grant | None:
        raise NotImplementedError

    def widenings(self, parent: Any, where: Location) -> list[Widening]:
        raise NotImplementedError

    def to_document(self) -> dict[str, Any]:
        raise NotImplementedError

    def judge(self, capability: str, request: Request) -> tuple[list[str], list[str]]:
        """``(denials, grounds)``: why the grant refuses the request, or why it covers it."""
        raise NotImplementedError

    @property
    def limits(self) -> Limits | None:
        """The resource ceilings of this grant, for the capabilities that have any."""
        return None


@dataclass(frozen=True)
class PathGrant(Grant):
    """fs.read or fs.write: the workspace paths the capability may touch."""

    paths: PathSet = field(default_factory=lambda: PathSet(()))

    def meet(self, other: PathGrant) -> PathGrant | None:
        paths = self.paths.intersect(other.paths)
        if not paths:
            return None
        return PathGrant(stricter_approval(self.approval, other.approval), paths)

    def widenings(self, parent: PathGrant, where: Location) -> list[Widening]:
        found = self._approval_widenings(parent, where)
        at = where.key("paths")
        canonical = self.paths.texts()
        ceiling = shown(parent.paths.texts(), ordered=True)
        for pattern in self.paths.uncovered_by(parent.paths):
            found.append(
                Widening(
                    at.item(str(pattern), canonical),
                    f"{where.capability} path '{pattern}' is not within the "
                    f"{where.parent_label}'s {ceiling}",
                )
            )
        return found

    def to_document(self) -> dict[str, Any]:
        return {"approval": self.approval, "paths": self.paths.texts()}

    def judge(self, capability: str, request: Request) -> tuple[list[str], list[str]]:
        if not request.paths:
            return [f"the {capability} request names no path"], []
        denials: list[str] = []
        grounds: list[str] = []
        for path in request.paths:
            problem = path_problem(path)
            if problem:
                denials.append(f"path '{path}' is not a canonical workspace path: it {problem}")
            elif (match := self.paths.first_match(path)) is None:
                denials.append(
                    f"path '{path}' matches none of {shown(self.paths.texts(), ordered=True)}"
                )
            else:
                grounds.append(f"path '{path}' matches '{match}'")
        return denials, grounds


@dataclass(frozen=True)
class ShellGrant(Grant):
    """shell.exec: which programs may run (EVERYTHING when unrestricted), within ceilings,
    and which environment variables beyond ``ALWAYS_ALLOWED_ENV_NAMES`` a call may overlay
    (none unless the document names them; EVERYTHING only in a mask)."""

    commands: Names = EVERYTHING
    ceilings: Limits = field(default_factory=lambda: Limits.from_mapping({}))
    env: Names = frozenset()

    @property
    def limits(self) -> Limits:
        return self.ceilings

    def meet(self, other: ShellGrant) -> ShellGrant | None:
        commands = meet_names(self.commands, other.commands)
        if not commands:
            return None
        return ShellGrant(
            stricter_approval(self.approval, other.approval),
            commands,
            self.ceilings.meet(other.ceilings),
            meet_names(self.env, other.env),
        )

    def widenings(self, parent: ShellGrant, where: Location) -> list[Widening]:
        found = self._approval_widenings(parent, where)
        found += _names_widenings(
            self.commands, parent.commands, where.key("commands"), "program", ""
        )
        found += _names_widenings(
            self.env, parent.env, where.key("env"), "environment variable", ""
        )
        found += _limit_widenings(self.ceilings, parent.ceilings, where)
        return found

    def to_document(self) -> dict[str, Any]:
        document: dict[str, Any] = {"approval": self.approval, "limits": self.ceilings.as_dict()}
        if not isinstance(self.commands, Everything):
            document["commands"] = sorted(self.commands)
        # Left out when empty, so documents that grant no variable keep their form and hash.
        env = _names_document(self.env, "environment variable")
        if env:
            document["env"] = env
        return document

    def judge(self, capability: str, request: Request) -> tuple[list[str], list[str]]:
        if not request.command:
            return ["the shell.exec request names no program"], []
        denials = self._judge_env(request.env_names)
        grounds: list[str] = []
        if isinstance(self.commands, Everything):
            grounds = ["any program may run"]
        elif request.command not in self.commands:
            denials.insert(
                0,
                f"program '{request.command}' is not in the allowed commands "
                f"{shown(self.commands)}",
            )
        else:
            grounds = [f"program '{request.command}' is in the allowed commands"]
        if denials:
            return denials, []
        if request.env_names:
            grounds.append(
                f"environment variables {list(request.env_names)} may be set "
                "(always allowed, or granted by shell.exec env)"
            )
        return [], grounds

    def _judge_env(self, names: tuple[str, ...]) -> list[str]:
        if isinstance(self.env, Everything):
            return []
        refused = [
            name for name in names if not env_name_always_allowed(name) and name not in self.env
        ]
        if not refused:
            return []
        granted = f" (it grants {shown(self.env)})" if self.env else ""
        return [
            f"environment variable '{name}' may not be set: it is not one of the always "
            "allowed locale, time zone and terminal variables, and the policy's shell.exec "
            f"env does not grant it{granted}; a variable can change what a program loads or runs"
            for name in refused
        ]


@dataclass(frozen=True)
class CodeGrant(Grant):
    """code.exec: running code in the sandbox, within ceilings."""

    ceilings: Limits = field(default_factory=lambda: Limits.from_mapping({}))

    @property
    def limits(self) -> Limits:
        return self.ceilings

    def meet(self, other: CodeGrant) -> CodeGrant:
        return CodeGrant(
            stricter_approval(self.approval, other.approval), self.ceilings.meet(other.ceilings)
        )

    def widenings(self, parent: CodeGrant, where: Location) -> list[Widening]:
        return self._approval_widenings(parent, where) + _limit_widenings(
            self.ceilings, parent.ceilings, where
        )

    def to_document(self) -> dict[str, Any]:
        return {"approval": self.approval, "limits": self.ceilings.as_dict()}

    def judge(self, capability: str, request: Request) -> tuple[list[str], list[str]]:
        return [], ["code.exec is granted"]


def _limit_widenings(child: Limits, parent: Limits, where: Location) -> list[Widening]:
    found = []
    limits_at = where.key("limits")
    for name in child.exceeding(parent):
        at = limits_at.key(name)
        source = "" if at.written() else " (the platform default, as the document leaves it out)"
        found.append(
            Widening(
                at.path,
                f"{where.capability} {name} ceiling {getattr(child, name)}{source} is above the "
                f"{where.parent_label}'s {getattr(parent, name)}",
            )
        )
    return found


@dataclass(frozen=True)
class HttpGrant(Grant):
    """net.http: the exact origins requests may reach."""

    allow: frozenset[Origin] | Everything = EVERYTHING

    def meet(self, other: HttpGrant) -> HttpGrant | None:
        if isinstance(self.allow, Everything):
            allow = other.allow
        elif isinstance(other.allow, Everything):
            allow = self.allow
        else:
            allow = self.allow & other.allow
        if not allow:
            return None
        return HttpGrant(stricter_approval(self.approval, other.approval), allow)

    def widenings(self, parent: HttpGrant, where: Location) -> list[Widening]:
        child = (
            self.allow if isinstance(self.allow, Everything) else frozenset(map(str, self.allow))
        )
        ceiling = (
            parent.allow
            if isinstance(parent.allow, Everything)
            else frozenset(map(str, parent.allow))
        )
        return self._approval_widenings(parent, where) + _names_widenings(
            child, ceiling, where.key("allow"), "origin", ""
        )

    def to_document(self) -> dict[str, Any]:
        if isinstance(self.allow, Everything):
            raise ValueError(
                "a grant of every origin has no document form; meet it with a document"
            )
        document: dict[str, Any] = {
            "approval": self.approval,
            "allow": sorted(map(str, self.allow)),
        }
        if any(origin.is_ip_literal for origin in self.allow):
            document["allow_ip_literals"] = True
        return document

    def judge(self, capability: str, request: Request) -> tuple[list[str], list[str]]:
        if not request.url:
            return ["the net.http request names no URL"], []
        try:
            origin = origin_of_url(request.url)
        except ValueError as error:
            return [str(error)], []
        if isinstance(self.allow, Everything) or origin in self.allow:
            return [], [f"origin '{origin}' is allowed"]
        return [f"origin '{origin}' is not in the allow list {shown(self.allow)}"], []


@dataclass(frozen=True)
class ModelGrant(Grant):
    """model.invoke: the models that may be called."""

    models: Names = EVERYTHING

    def meet(self, other: ModelGrant) -> ModelGrant | None:
        models = meet_names(self.models, other.models)
        if not models:
            return None
        return ModelGrant(stricter_approval(self.approval, other.approval), models)

    def widenings(self, parent: ModelGrant, where: Location) -> list[Widening]:
        return self._approval_widenings(parent, where) + _names_widenings(
            self.models, parent.models, where.key("models"), "model", ""
        )

    def to_document(self) -> dict[str, Any]:
        return {"approval": self.approval, "models": _names_document(self.models, "model")}

    def judge(self, capability: str, request: Request) -> tuple[list[str], list[str]]:
        if not request.model:
            return ["the model.invoke request names no model"], []
        if isinstance(self.models, Everything) or request.model in self.models:
            return [], [f"model '{request.model}' is allowed"]
        return [f"model '{request.model}' is not in the allowed models {shown(self.models)}"], []


@dataclass(frozen=True)
class ServerTools:
    """The tools of one MCP server a grant covers, and which dangerous ones are opted in."""

    tools: frozenset[str]
    # Tools the server marks dangerous run only if listed here too (POL-8); always ⊆ tools.
    dangerous: frozenset[str] = frozenset()


def _meet_keyed(first: Any, second: Any, meet_values: Any) -> Any:
    """Meet ``{name: value}`` tables (or EVERYTHING): shared names kept, values met."""
    if isinstance(first, Everything):
        return second
    if isinstance(second, Everything):
        return first
    theirs = dict(second)
    met = ((name, meet_values(value, theirs[name])) for name, value in first if name in theirs)
    return tuple((name, value) for name, value in met if value is not None)


def _meet_server_tools(first: ServerTools, second: ServerTools) -> ServerTools | None:
    tools = first.tools & second.tools
    return ServerTools(tools, first.dangerous & second.dangerous & tools) if tools else None


def _meet_operations(first: frozenset[str], second: frozenset[str]) -> frozenset[str] | None:
    return (first & second) or None


_PLATFORM_CEILINGS = Limits.from_mapping({})


@dataclass(frozen=True)
class McpGrant(Grant):
    """mcp.call: per server, the tools that may be called (``(name, ServerTools)`` pairs)."""

    servers: tuple[tuple[str, ServerTools], ...] | Everything = EVERYTHING
    _by_name: Mapping[str, ServerTools] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        by_name = {} if isinstance(self.servers, Everything) else dict(self.servers)
        object.__setattr__(self, "_by_name", by_name)

    @property
    def limits(self) -> Limits:
        """The platform's default ceilings, which no document states for mcp.call (a server's
        container has its own, in its profile): a call's ``timeout_s`` may shorten the call,
        never lengthen it past them."""
        return _PLATFORM_CEILINGS

    def meet(self, other: McpGrant) -> McpGrant | None:
        servers = _meet_keyed(self.servers, other.servers, _meet_server_tools)
        if not servers:
            return None
        return McpGrant(stricter_approval(self.approval, other.approval), servers)

    def widenings(self, parent: McpGrant, where: Location) -> list[Widening]:
        found = self._approval_widenings(parent, where)
        at = where.key("servers")
        if isinstance(parent.servers, Everything):
            return found
        if isinstance(self.servers, Everything):
            message = (
                f"mcp.call allows every server; "
                f"the {where.parent_label}'s allows only {shown(parent._by_name)}"
            )
            return [*found, Widening(at.path, message)]
        for name, tools in self.servers:
            server_at = at.key(name)
            ceiling = parent._by_name.get(name)
            if ceiling is None:
                found.append(
                    Widening(
                        server_at.path,
                        f"mcp.call server '{name}' is not granted by the {where.parent_label}",
                    )
                )
                continue
            scope = f" on server '{name}'"
            found += _names_widenings(
                tools.tools, ceiling.tools, server_at.key("tools"), "tool", scope
            )
            found += _names_widenings(
                tools.dangerous,
                ceiling.dangerous,
                server_at.key("dangerous"),
                "dangerous opt-in",
                scope,
            )
        return found

    def to_document(self) -> dict[str, Any]:
        if isinstance(self.servers, Everything):
            raise ValueError(
                "a grant of every MCP server has no document form; meet it with a document"
            )
        servers = {}
        for name, tools in self.servers:
            servers[name] = {"tools": sorted(tools.tools)}
            if tools.dangerous:
                servers[name]["dangerous"] = sorted(tools.dangerous)
        return {"approval": self.approval, "servers": servers}

    def judge(self, capability: str, request: Request) -> tuple[list[str], list[str]]:
        server, tool = request.mcp_server, request.mcp_tool
        if not server or not tool:
            return ["the mcp.call request does not name both a server and a tool"], []
        if isinstance(self.servers, Everything):
            return [], [f"every MCP tool is allowed, including '{tool}' on '{server}'"]
        granted = self._by_name.get(server)
        if granted is None:
            return [
                f"MCP server '{server}' is not in the allowed servers {shown(self._by_name)}"
            ], []
        if tool not in granted.tools:
            return [
                f"tool '{tool}' is not in server '{server}''s allowed tools {shown(granted.tools)}"
            ], []
        if request.mcp_dangerous and tool not in granted.dangerous:
            return [
                f"tool '{tool}' on '{server}' is marked dangerous and has no explicit opt-in"
            ], []
        opted_in = " (dangerous, explicitly opted in)" if request.mcp_dangerous else ""
        return [], [f"tool '{tool}' on server '{server}' is allowed{opted_in}"]


@dataclass(frozen=True)
class AdapterGrant(Grant):
    """adapter.invoke: per host adapter, the operations that may be invoked."""

    adapters: tuple[tuple[str, frozenset[str]], ...] | Everything = EVERYTHING
    _by_name: Mapping[str, frozenset[str]] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        by_name = {} if isinstance(self.adapters, Everything) else dict(self.adapters)
        object.__setattr__(self, "_by_name", by_name)

    def meet(self, other: AdapterGrant) -> AdapterGrant | None:
        adapters = _meet_keyed(self.adapters, other.adapters, _meet_operations)
        if not adapters:
            return None
        return AdapterGrant(stricter_approval(self.approval, other.approval), adapters)

    def widenings(self, parent: AdapterGrant, where: Location) -> list[Widening]:
        found = self._approval_widenings(parent, where)
        at = where.key("adapters")
        if isinstance(parent.adapters, Everything):
            return found
        if isinstance(self.adapters, Everything):
            message = (
                f"adapter.invoke allows every adapter; "
                f"the {where.parent_label}'s allows only {shown(parent._by_name)}"
            )
            return [*found, Widening(at.path, message)]
        for name, operations in self.adapters:
            adapter_at = at.key(name)
            ceiling = parent._by_name.get(name)
            if ceiling is None:
                found.append(
                    Widening(
                        adapter_at.path,
                        f"adapter.invoke adapter '{name}' is not granted by "
                        f"the {where.parent_label}",
                    )
                )
                continue
            found += _names_widenings(
                operations,
                ceiling,
                adapter_at.key("operations"),
                "operation",
                f" of adapter '{name}'",
            )
        return found

    def to_document(self) -> dict[str, Any]:
        if isinstance(self.adapters, Everything):
            raise ValueError(
                "a grant of every adapter has no document form; meet it with a document"
            )
        adapters = {name: {"operations": sorted(operations)} for name, operations in self.adapters}
        return {"approval": self.approval, "adapters": adapters}

    def judge(self, capability: str, request: Request) -> tuple[list[str], list[str]]:
        adapter, operation = request.adapter, request.operation
        if not adapter or not operation:
            return ["the adapter.invoke request does not name both an adapter and an operation"], []
        if isinstance(self.adapters, Everything):
            return [], [f"every adapter operation is allowed, including '{adapter}.{operation}'"]
        granted = self._by_name.get(adapter)
        if granted is None:
            return [
                f"adapter '{adapter}' is not in the allowed adapters {shown(self._by_name)}"
            ], []
        if operation not in granted:
            return [
                f"operation '{operation}' is not in adapter '{adapter}''s allowed operations "
                f"{shown(granted)}"
            ], []
        return [], [f"operation '{operation}' of adapter '{adapter}' is allowed"]


# Every capability the engine knows, with the kind of grant that spells it.
GRANT_KINDS: Mapping[str, type[Grant]] = {
    "fs.read": PathGrant,
    "fs.write": PathGrant,
    "shell.exec": ShellGrant,
    "code.exec": CodeGrant,
    "net.http": HttpGrant,
    "model.invoke": ModelGrant,
    "mcp.call": McpGrant,
    "adapter.invoke": AdapterGrant,
}
CAPABILITY_NAMES: frozenset[str] = frozenset(GRANT_KINDS)
LIMITED_CAPABILITIES = frozenset(
    name for name, kind in GRANT_KINDS.items() if kind in (ShellGrant, CodeGrant)
)


def full_width(capability: str) -> Grant:
    """The widest grant of ``capability``: a meet with it leaves the other side unchanged."""
    kind = GRANT_KINDS[capability]
    if kind is PathGrant:
        return PathGrant(APPROVAL_NEVER, PathSet([parse_pattern("**")]))
    if kind is ShellGrant:
        return ShellGrant(APPROVAL_NEVER, ceilings=Limits.widest(), env=EVERYTHING)
    if kind is CodeGrant:
        return CodeGrant(APPROVAL_NEVER, ceilings=Limits.widest())
    return kind(APPROVAL_NEVER)
