"""Hypothesis strategies for random valid policy documents, policies and requests.

Names are drawn from small pools on purpose: random policies then overlap often, so meets
are non-trivial and requests hit both granted and refused resources. Each choice is a
single draw from a precomputed list (every subset, every pattern): drawing item by item
made generation, not the engine, dominate the suite's run time.
"""

from __future__ import annotations

import itertools
from functools import cache

from hypothesis import strategies as st

from policies import CAPABILITY_NAMES, LIMIT_NAMES, Policy, Request, parse_policy
from policies.globs import PathSet, parse_pattern

SEGMENTS = ("src", "docs", "a", "b")
ORIGINS = (
    "https://api.github.com:443",
    "https://example.com:443",
    "https://example.com:8443",
    "http://example.com:80",
    "https://10.0.0.1:443",
)
MODELS = ("gpt-4o", "claude-3", "llama-3")
PROGRAMS = ("git", "make", "python", "sh")
# shell.exec env grants; requests also overlay LANG, which is always allowed.
ENV_NAMES = ("APP_MODE", "DEBUG", "LD_PRELOAD")
SERVERS = ("github", "jira")
TOOLS = ("search", "create", "delete")
ADAPTERS = ("s3", "slack")
OPERATIONS = ("get", "put", "list")
LIMIT_VALUES = {
    "timeout_s": (0.5, 30, 60, 300, 900),
    "memory_mb": (128, 512, 2048, 4096),
    "cpus": (0.5, 1, 2, 4),
    "pids": (16, 128, 256, 1024),
    "output_kb": (64, 256, 1024, 4096),
}

# Every pattern of up to three segments over SEGMENTS and '*', with or without a final '**'.
PATTERNS = tuple(
    "/".join((*segments, "**") if recursive else segments)
    for length in range(4)
    for segments in itertools.product((*SEGMENTS, "*"), repeat=length)
    for recursive in (False, True)
    if segments or recursive
)


@cache
def subsets(pool: tuple[str, ...], *, allow_empty: bool = False) -> st.SearchStrategy[list[str]]:
    """One draw picks a whole subset of ``pool`` (non-empty unless ``allow_empty``)."""
    chosen = [
        list(combination)
        for size in range(0 if allow_empty else 1, len(pool) + 1)
        for combination in itertools.combinations(pool, size)
    ]
    return st.sampled_from(chosen)


approvals = st.sampled_from((None, "never", "always"))
# Pattern sets as a document writes them: no pattern covered by another (the parser
# rejects redundant entries), in canonical or reversed order.
path_sets = st.lists(st.sampled_from(PATTERNS), min_size=1, max_size=4).map(
    lambda texts: PathSet(parse_pattern(text) for text in texts)
)
path_lists = st.tuples(path_sets, st.booleans()).map(
    lambda drawn: drawn[0].texts()[::-1] if drawn[1] else drawn[0].texts()
)
limit_documents = st.tuples(
    *(st.sampled_from((None, *values)) for values in LIMIT_VALUES.values())
).map(
    lambda values: {
        name: value for name, value in zip(LIMIT_NAMES, values, strict=True) if value is not None
    }
)


@st.composite
def mcp_servers(draw: st.DrawFn) -> dict:
    servers = {}
    for name in draw(subsets(SERVERS)):
        tools = draw(subsets(TOOLS))
        entry = {"tools": tools}
        dangerous = draw(subsets(tuple(tools), allow_empty=True))
        if dangerous:
            entry["dangerous"] = dangerous
        servers[name] = entry
    return servers


@st.composite
def capability_documents(draw: st.DrawFn, capability: str) -> dict:
    if capability in ("fs.read", "fs.write"):
        grant = {"paths": draw(path_lists)}
    elif capability == "shell.exec":
        grant = {"limits": draw(limit_documents)}
        commands = draw(st.none() | subsets(PROGRAMS))
        if commands is not None:
            grant["commands"] = commands
        env = draw(st.none() | subsets(ENV_NAMES))
        if env is not None:
            grant["env"] = env
    elif capability == "code.exec":
        grant = {"limits": draw(limit_documents)}
    elif capability == "net.http":
        grant = {"allow": draw(subsets(ORIGINS))}
        if any(origin.startswith("https://10.") for origin in grant["allow"]):
            grant["allow_ip_literals"] = True
    elif capability == "model.invoke":
        grant = {"models": draw(subsets(MODELS))}
    elif capability == "mcp.call":
        grant = {"servers": draw(mcp_servers())}
    else:
        adapters = draw(subsets(ADAPTERS))
        grant = {"adapters": {name: {"operations": draw(subsets(OPERATIONS))} for name in adapters}}
    approval = draw(approvals)
    if approval is not None:
        grant["approval"] = approval
    return grant


_CAPABILITY_DOCUMENTS = {name: capability_documents(name) for name in CAPABILITY_NAMES}


@st.composite
def policy_documents(draw: st.DrawFn) -> dict:
    names = draw(subsets(tuple(sorted(CAPABILITY_NAMES)), allow_empty=True))
    return {"capabilities": {name: draw(_CAPABILITY_DOCUMENTS[name]) for name in names}}


document_policies = policy_documents().map(parse_policy)
masks = subsets(tuple(sorted(CAPABILITY_NAMES)), allow_empty=True).map(Policy.allowing)
# Mostly documents, sometimes a full-width mask as surfaces, modes and scopes produce.
policies = st.one_of(document_policies, document_policies, document_policies, masks)

REQUEST_PATHS = (".", "src", "src/a", "src/a/b", "docs/b", "a/b", "b", "zz/src", "src/zz/a/b")
MALFORMED_PATHS = ("/etc", "a/../b", "a//b")
request_paths = st.lists(st.sampled_from(REQUEST_PATHS + MALFORMED_PATHS), max_size=3).map(tuple)
request_limits = st.dictionaries(
    st.sampled_from((*LIMIT_NAMES, "gpus")),
    st.sampled_from((0.25, 1, 30, 64, 100, 600, 2048, 5000, 0)),
    max_size=3,
)
REQUEST_URLS = (
    None,
    "https://api.github.com/repos",
    "https://example.com:8443/x",
    "http://example.com/",
    "https://evil.example/",
    "https://10.0.0.1/",
    "https://user@example.com/",
)


@st.composite
def requests(draw: st.DrawFn, capabilities: tuple[str, ...] | None = None) -> Request:
    capability = draw(st.sampled_from(capabilities or (*sorted(CAPABILITY_NAMES), "fs.delete")))
    return Request(
        capability=capability,
        paths=draw(request_paths),
        command=draw(st.sampled_from((None, *PROGRAMS, "rm"))),
        env_names=tuple(
            draw(subsets(("APP_MODE", "DEBUG", "LANG", "LD_PRELOAD"), allow_empty=True))
        ),
        url=draw(st.sampled_from(REQUEST_URLS)),
        mcp_server=draw(st.sampled_from((None, *SERVERS, "slack"))),
        mcp_tool=draw(st.sampled_from((None, *TOOLS))),
        mcp_dangerous=draw(st.booleans()),
        adapter=draw(st.sampled_from((None, *ADAPTERS))),
        operation=draw(st.sampled_from((None, *OPERATIONS))),
        model=draw(st.sampled_from((None, *MODELS, "mystery"))),
        limits=draw(request_limits) if capability in ("shell.exec", "code.exec") else {},
    )
