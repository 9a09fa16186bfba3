"""A policy at the caps costs what its size says, and no more: the caps hold, the engine's
answers are those of the pairwise definitions, and its work grows linearly with the patterns.

The caps (``policies.DocumentLimits``) bound every list and the document's bytes; a document
over one is refused at the first cap it exceeds, naming the list, before it is read further.
The trie that replaced the pairwise scans is checked against those scans, kept here as the
reference, on generated pattern sets; and the work of parsing is counted (never timed).
"""

from __future__ import annotations

import itertools
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import (
    DEFAULT_DOCUMENT_LIMITS,
    DocumentLimits,
    PolicyError,
    PolicyTooLarge,
    globs,
    parse_policy,
    parse_policy_json,
)
from policies.globs import STAR, PathPattern, PathSet, parse_pattern

CAPS = DocumentLimits(
    bytes=4096,
    paths=3,
    origins=3,
    commands=3,
    env=3,
    models=3,
    servers=3,
    tools=3,
    adapters=3,
    operations=3,
)


def names(stem: str, count: int) -> list[str]:
    return [f"{stem}{index}" for index in range(count)]


def over(count: int) -> dict[str, tuple[dict, str]]:
    """For each cap: a document holding ``count`` items in that list, and the list's path."""
    shell = {"commands": ["git"]}
    return {
        "paths": ({"fs.read": {"paths": names("dir", count)}}, "capabilities.fs.read.paths"),
        "origins": (
            {"net.http": {"allow": [f"https://h{i}.example.com:443" for i in range(count)]}},
            "capabilities.net.http.allow",
        ),
        "commands": (
            {"shell.exec": {"commands": names("tool", count)}},
            "capabilities.shell.exec.commands",
        ),
        "env": (
            {"shell.exec": {**shell, "env": names("APP_", count)}},
            "capabilities.shell.exec.env",
        ),
        "models": (
            {"model.invoke": {"models": names("m", count)}},
            "capabilities.model.invoke.models",
        ),
        "servers": (
            {"mcp.call": {"servers": {f"s{i}": {"tools": ["t"]} for i in range(count)}}},
            "capabilities.mcp.call.servers",
        ),
        "tools": (
            {"mcp.call": {"servers": {"gh": {"tools": names("t", count)}}}},
            "capabilities.mcp.call.servers.gh.tools",
        ),
        "adapters": (
            {
                "adapter.invoke": {
                    "adapters": {f"a{i}": {"operations": ["get"]} for i in range(count)}
                }
            },
            "capabilities.adapter.invoke.adapters",
        ),
        "operations": (
            {"adapter.invoke": {"adapters": {"s3": {"operations": names("op", count)}}}},
            "capabilities.adapter.invoke.adapters.s3.operations",
        ),
    }


def test_every_list_of_the_document_has_a_cap():
    """Each DocumentLimits field but bytes caps one of the lists ``over`` builds."""
    assert set(over(1)) == {name for name in DocumentLimits.__dataclass_fields__} - {"bytes"}


@pytest.mark.spec("POL-1")
@pytest.mark.parametrize("cap", sorted(over(1)))
def test_a_list_at_its_cap_parses_and_one_more_item_is_refused_naming_the_list(cap):
    at_cap, _ = over(3)[cap]
    parse_policy({"capabilities": at_cap}, limits=CAPS)
    document, path = over(4)[cap]
    with pytest.raises(PolicyTooLarge) as refused:
        parse_policy({"capabilities": document}, limits=CAPS)
    assert (refused.value.path, refused.value.limit) == (path, cap)
    assert (refused.value.maximum, refused.value.actual) == (3, 4)
    assert isinstance(refused.value, PolicyError)
    assert str(refused.value) == f"{path}: has 4 items; at most 3 are allowed"
    # Published documents are read back without caps: lowering one never hides a version.
    parse_policy({"capabilities": document}, limits=None)


@pytest.mark.spec("POL-1")
def test_mcp_dangerous_lists_share_the_tools_cap():
    document = {"mcp.call": {"servers": {"gh": {"tools": ["a"], "dangerous": names("t", 4)}}}}
    with pytest.raises(PolicyTooLarge) as refused:
        parse_policy({"capabilities": document}, limits=CAPS)
    assert refused.value.path == "capabilities.mcp.call.servers.gh.dangerous"


@pytest.mark.spec("POL-1")
def test_the_document_bytes_are_capped_before_it_is_decoded():
    text = json.dumps({"capabilities": {"fs.read": {"paths": ["**"]}}, "description": "x" * 5000})
    with pytest.raises(PolicyTooLarge) as refused:
        parse_policy_json(text, limits=CAPS)
    assert (refused.value.path, refused.value.limit) == ("", "bytes")
    assert refused.value.actual == len(text.encode()) and refused.value.maximum == 4096
    # Not even valid JSON past the cap: the size is checked first.
    with pytest.raises(PolicyTooLarge):
        parse_policy_json(b"[" * 5000, limits=CAPS)


def test_a_deeply_nested_body_is_a_policy_error_not_a_crash():
    with pytest.raises(PolicyError, match="nests too deeply"):
        parse_policy_json("[" * 100_000, limits=None)


def test_the_default_caps_are_what_the_docs_promise():
    assert DEFAULT_DOCUMENT_LIMITS.bytes == 64 * 1024
    assert DEFAULT_DOCUMENT_LIMITS.paths == 256
    with pytest.raises(ValueError, match="positive"):
        DocumentLimits(paths=0)


# --- the trie agrees with the pairwise definitions ----------------------------------------

SEGMENTS = ("a", "b", "c", STAR)


def _reference_prune(patterns):
    unique = set(patterns)
    kept = [p for p in unique if not any(o != p and o.contains(p) for o in unique)]
    return tuple(sorted(kept, key=str))


def _reference_covers(members, pattern):
    """The pairwise definition the engine used before the trie (exact, see PathSet.covers)."""
    if any(member.contains(pattern) for member in members):
        return True
    if not pattern.recursive or not members:
        return False
    longest = max(len(member.segments) for member in members)
    for length in range(len(pattern.segments), max(len(pattern.segments), longest + 1) + 1):
        fixed = PathPattern(pattern.segments + (STAR,) * (length - len(pattern.segments)), False)
        if not any(member.contains(fixed) for member in members):
            return False
    return True


def _reference_matches(members, path):
    def source(pattern):
        body = "/".join("[^/]+" if s == STAR else re.escape(s) for s in pattern.segments)
        if not pattern.recursive:
            return body
        return f"{body}(?:/.*)?" if body else ".*"

    subject = "" if path == "." else path
    return [m for m in members if re.fullmatch(source(m), subject, re.DOTALL)]


patterns = st.builds(
    PathPattern, st.lists(st.sampled_from(SEGMENTS), max_size=4).map(tuple), st.booleans()
).filter(lambda pattern: pattern.segments or pattern.recursive)
pattern_lists = st.lists(patterns, max_size=12)
PATHS = ["."] + [
    "/".join(parts)
    for length in range(1, 6)
    for parts in itertools.product(("a", "b", "c", "zz"), repeat=length)
    if length < 4 or parts[0] == "a"
]


@pytest.mark.spec("POL-1")
@settings(max_examples=400, deadline=None)
@given(pattern_lists, pattern_lists)
def test_prune_covers_intersect_and_match_agree_with_the_pairwise_reference(first, second):
    mine, theirs = PathSet(first), PathSet(second)
    assert mine.patterns == _reference_prune(first)
    assert theirs.patterns == _reference_prune(second)
    for pattern in [*first, *second]:
        assert mine.covers(pattern) == _reference_covers(mine.patterns, pattern), pattern
    pairwise = _reference_prune(
        met for a in mine.patterns for b in theirs.patterns if (met := a.intersect(b)) is not None
    )
    assert mine.intersect(theirs).patterns == pairwise
    assert theirs.intersect(mine).patterns == pairwise
    for path in PATHS:
        matching = _reference_matches(mine.patterns, path)
        assert mine.matches(path) == bool(matching), path
        assert mine.first_match(path) == (matching[0] if matching else None), path
    containers = globs.first_containers(list(dict.fromkeys(first)))
    for pattern, container in zip(dict.fromkeys(first), containers, strict=True):
        others = [
            i for i, o in enumerate(dict.fromkeys(first)) if o != pattern and o.contains(pattern)
        ]
        assert container == (others[0] if others else None)


# --- work grows linearly ----------------------------------------------------------------


def _document(count: int) -> dict:
    """``count`` path patterns as real grants hold them, in both path capabilities."""
    paths = []
    for index in range(count):
        paths.append((f"src/pkg{index}/**", f"src/*/mod{index}/**", f"docs/f{index}.md")[index % 3])
    return {"capabilities": {"fs.read": {"paths": paths}, "fs.write": {"paths": paths}}}


def _work(monkeypatch, run) -> int:
    """Pattern comparisons and trie steps ``run`` makes (whichever the engine has)."""
    counted = [0]

    def counting(function):
        def wrapper(*args, **kwargs):
            counted[0] += 1
            return function(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(PathPattern, "contains", counting(PathPattern.contains))
    monkeypatch.setattr(PathPattern, "intersect", counting(PathPattern.intersect))
    trie = getattr(globs, "_Trie", None)
    if trie is not None:
        monkeypatch.setattr(trie, "_step", counting(trie._step))
    run()
    monkeypatch.undo()
    return counted[0]


@pytest.mark.spec("POL-1")
def test_parsing_meeting_and_checking_do_work_linear_in_the_patterns(monkeypatch):
    """Four times the patterns, at most about four times the work (it was sixteen)."""
    from policies import meet, widenings

    def work(count: int) -> int:
        environment = parse_policy(_document(count), limits=None)
        narrower = {"capabilities": {}}
        for name, grant in _document(count)["capabilities"].items():
            narrower["capabilities"][name] = {
                "paths": [
                    p.replace("**", "x/**") if p.endswith("**") else p for p in grant["paths"]
                ]
            }
        project = parse_policy(narrower, limits=None)
        return _work(
            monkeypatch,
            lambda: (
                parse_policy(_document(count), limits=None),
                widenings(project, environment),
                meet(environment, project),
            ),
        )

    small, large = work(200), work(800)
    assert small > 0
    assert large <= 5 * small, (small, large)


def test_patterns_parse_the_same_after_the_rewrite():
    assert str(parse_pattern("src/*/a/**")) == "src/*/a/**"
    assert PathSet([parse_pattern("src"), parse_pattern("src/*/**")]) == PathSet(
        [parse_pattern("src/**")]
    )
