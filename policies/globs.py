"""Workspace path patterns for fs.read and fs.write, and exact set algebra over them.

The pattern language is deliberately small so that every question the engine asks of it has
an exact answer: whether a path matches, whether one pattern set lies within another, and
what the intersection of two sets is. A pattern is a ``/``-separated list of segments:

* a literal name (``src``, ``README.md``) matches exactly that name;
* ``*`` matches exactly one segment, whatever its name;
* ``**``, allowed only as the last segment, matches zero or more further segments, so
  ``src/**`` matches ``src``, ``src/a`` and ``src/a/b``, and ``**`` alone matches every path
  including the workspace root.

Wildcards inside a name (``*.py``), ``?``, ``[...]`` and ``{...}`` are rejected rather than
guessed at, as are absolute paths, ``.`` and ``..`` segments, empty segments and backslashes.
Restricting ``**`` to the end is what keeps intersection exact: the intersection of two
patterns is again a single pattern (or nothing), so a meet never has to approximate.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

STAR = "*"
GLOBSTAR = "**"
# Characters that other glob dialects give a meaning; accepting them literally would let a
# pattern mean something different from what its author expected.
_GLOB_METACHARACTERS = re.compile(r"[*?\[\]{}]")
_CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f]")


def _segment_problem(segment: str) -> str | None:
    """Why ``segment`` cannot be a segment of a workspace path, or None when it can."""
    if segment == "":
        return "has an empty segment"
    if segment in (".", ".."):
        return f"has a '{segment}' segment"
    if _CONTROL_CHARACTER.search(segment):
        return "contains a control character"
    return None


def path_problem(path: str) -> str | None:
    """Why ``path`` is not a canonical workspace-relative path, or None when it is.

    ``"."`` names the workspace root. Anything that a runner would have to normalise first
    (``a//b``, ``./a``, ``a/``, ``/etc``) is refused so that the engine judges exactly the path
    the runner will touch.
    """
    if path == ".":
        return None
    if path == "":
        return "is empty"
    if path.startswith("/"):
        return "is absolute"
    if "\\" in path:
        return "contains a backslash"
    for segment in path.split("/"):
        problem = _segment_problem(segment)
        if problem:
            return problem
    return None


@dataclass(frozen=True, order=True)
class PathPattern:
    """One parsed pattern: fixed segments, optionally followed by a trailing ``**``."""

    # Literal names, or STAR for "any one segment".
    segments: tuple[str, ...]
    # True when the pattern ends in ``**``.
    recursive: bool

    def __str__(self) -> str:
        parts = [*self.segments, GLOBSTAR] if self.recursive else list(self.segments)
        return "/".join(parts)

    def contains(self, other: PathPattern) -> bool:
        """Whether every path ``other`` matches is also matched by this pattern."""
        if self.recursive:
            if len(other.segments) < len(self.segments):
                return False
        elif other.recursive or len(other.segments) != len(self.segments):
            return False
        return all(
            mine == STAR or mine == theirs
            for mine, theirs in zip(self.segments, other.segments, strict=False)
        )

    def intersect(self, other: PathPattern) -> PathPattern | None:
        """The pattern matching exactly the paths both match, or None when none does."""
        for fixed, partner in ((self, other), (other, self)):
            # A fixed-length pattern meets another only where the other reaches its length.
            if not fixed.recursive and (
                len(partner.segments) > len(fixed.segments)
                or (not partner.recursive and len(partner.segments) != len(fixed.segments))
            ):
                return None
        length = max(len(self.segments), len(other.segments))
        segments = []
        for index in range(length):
            mine = self.segments[index] if index < len(self.segments) else STAR
            theirs = other.segments[index] if index < len(other.segments) else STAR
            if mine == STAR:
                segments.append(theirs)
            elif theirs in (STAR, mine):
                segments.append(mine)
            else:
                return None
        return PathPattern(tuple(segments), self.recursive and other.recursive)


def parse_pattern(text: str) -> PathPattern:
    """Parse one pattern; raises ValueError with a message saying what is wrong."""
    if text == "":
        raise ValueError("is empty")
    if text.startswith("/"):
        raise ValueError("is absolute; patterns are relative to the workspace")
    if "\\" in text:
        raise ValueError("contains a backslash; the separator is '/'")
    segments = text.split("/")
    parsed: list[str] = []
    recursive = False
    for index, segment in enumerate(segments):
        problem = _segment_problem(segment)
        if problem:
            raise ValueError(problem)
        if segment == GLOBSTAR:
            if index != len(segments) - 1:
                raise ValueError("'**' is only allowed as the last segment")
            recursive = True
        elif segment == STAR:
            parsed.append(STAR)
        elif _GLOB_METACHARACTERS.search(segment):
            raise ValueError(
                f"segment '{segment}' is ambiguous: wildcards must be a whole segment "
                "('*' or a final '**'), and '?', '[', ']', '{', '}' are not allowed"
            )
        else:
            parsed.append(segment)
    return PathPattern(tuple(parsed), recursive)


class _Node:
    """One prefix of segments in a ``_Trie``; children are keyed by segment (``*`` included)."""

    __slots__ = ("children", "fixed", "recursive")

    def __init__(self) -> None:
        self.children: dict[str, _Node] = {}
        # The pattern whose segments are exactly this prefix, without and with a final '**'.
        self.fixed: PathPattern | None = None
        self.recursive: PathPattern | None = None


class _Trie:
    """Patterns indexed by their segments, so a question about one pattern visits only the
    prefixes that could answer it instead of every member (which made a set of n patterns
    cost n² to build). A walk follows, at each segment, the child of that literal name and
    the ``*`` child: at most the members that share a compatible prefix are ever touched.
    """

    __slots__ = ("root",)

    def __init__(self, patterns: Iterable[PathPattern]) -> None:
        self.root = _Node()
        for pattern in patterns:
            node = self.root
            for segment in pattern.segments:
                child = node.children.get(segment)
                if child is None:
                    child = node.children[segment] = _Node()
                node = child
            if pattern.recursive:
                node.recursive = pattern
            else:
                node.fixed = pattern

    def _step(self, frontier: list[_Node], segment: str) -> list[_Node]:
        """The nodes one segment further whose members can contain ``segment``: a literal
        is matched by itself and by ``*``; ``*`` only by ``*``."""
        following = []
        for node in frontier:
            if segment != STAR:
                child = node.children.get(segment)
                if child is not None:
                    following.append(child)
            child = node.children.get(STAR)
            if child is not None:
                following.append(child)
        return following

    def containing(self, pattern: PathPattern) -> Iterator[PathPattern]:
        """Every member that contains ``pattern`` (``pattern`` itself, if it is a member)."""
        frontier = [self.root]
        for segment in pattern.segments:
            # A recursive member that ends here contains everything below a compatible prefix.
            for node in frontier:
                if node.recursive is not None:
                    yield node.recursive
            frontier = self._step(frontier, segment)
            if not frontier:
                return
        for node in frontier:
            if node.recursive is not None:
                yield node.recursive
            if node.fixed is not None and not pattern.recursive:
                yield node.fixed

    def covers(self, pattern: PathPattern) -> bool:
        """Whether the members' union matches every path ``pattern`` matches (see
        ``PathSet.covers``)."""
        frontier = [self.root]
        for segment in pattern.segments:
            if any(node.recursive is not None for node in frontier):
                return True
            frontier = self._step(frontier, segment)
            if not frontier:
                return False
        if any(node.recursive is not None for node in frontier):
            return True
        if not pattern.recursive:
            return any(node.fixed is not None for node in frontier)
        # A recursive pattern no single member contains: every length from its own on must
        # be covered, a fixed member at that length or a recursive one ending at or before it.
        while True:
            if not any(node.fixed is not None for node in frontier):
                return False
            frontier = [
                child for node in frontier if (child := node.children.get(STAR)) is not None
            ]
            if not frontier:
                return False
            if any(node.recursive is not None for node in frontier):
                return True

    def matching(self, path: str) -> Iterator[PathPattern]:
        """Every member matching a workspace-relative path (``"."`` or ``""``: the root)."""
        segments = () if path in (".", "") else path.split("/")
        frontier = [self.root]
        for segment in segments:
            for node in frontier:
                if node.recursive is not None:
                    yield node.recursive
            if segment == "":
                # No segment pattern matches an empty name; only a '**' above it can.
                return
            frontier = self._step(frontier, segment)
            if not frontier:
                return
        for node in frontier:
            if node.recursive is not None:
                yield node.recursive
            if node.fixed is not None:
                yield node.fixed

    def intersecting(self, pattern: PathPattern) -> Iterator[PathPattern]:
        """Members whose intersection with ``pattern`` may be non-empty (a superset of
        those; ``PathPattern.intersect`` gives the exact answer)."""
        stack: list[tuple[_Node, int]] = [(self.root, 0)]
        length = len(pattern.segments)
        while stack:
            node, depth = stack.pop()
            if depth < length:
                if node.recursive is not None:
                    yield node.recursive
                segment = pattern.segments[depth]
                if segment == STAR:
                    stack.extend((child, depth + 1) for child in node.children.values())
                else:
                    for key in (segment, STAR):
                        child = node.children.get(key)
                        if child is not None:
                            stack.append((child, depth + 1))
                continue
            if node.recursive is not None:
                yield node.recursive
            if node.fixed is not None:
                yield node.fixed
            if pattern.recursive:
                # Below a recursive pattern's end every member can meet it.
                stack.extend((child, depth + 1) for child in node.children.values())


def _prune(patterns: Iterable[PathPattern]) -> tuple[PathPattern, ...]:
    """Drop patterns that another pattern of the set already covers; sort the rest.

    Containment between distinct patterns is a partial order, so this keeps exactly the
    maximal patterns; each is checked against the trie of all of them, not against each.
    """
    unique = set(patterns)
    index = _Trie(unique)
    kept = [
        pattern
        for pattern in unique
        if not any(other != pattern for other in index.containing(pattern))
    ]
    return tuple(sorted(kept, key=str))


def first_containers(patterns: Sequence[PathPattern]) -> list[int | None]:
    """For each pattern, the position of the first other one that contains it, or None.

    The parser's "already covered by" check: one trie walk per pattern, not a scan of all.
    """
    index = _Trie(patterns)
    position = {pattern: at for at, pattern in reversed(list(enumerate(patterns)))}
    found: list[int | None] = []
    for pattern in patterns:
        others = [position[other] for other in index.containing(pattern) if other != pattern]
        found.append(min(others) if others else None)
    return found


class PathSet:
    """A finite union of path patterns, compared by the set of paths it matches.

    Two sets are equal when they match the same paths, even if written differently:
    ``["src", "src/*/**"]`` equals ``["src/**"]``. The patterns are indexed in a trie once,
    when the set is built, so matching a path, covering a pattern and meeting another set
    each visit only the patterns that share a compatible prefix (docs/policy.md#performance).
    """

    __slots__ = ("_index", "_order", "_texts", "patterns")

    def __init__(self, patterns: Iterable[PathPattern], *, maximal: bool = False) -> None:
        """``maximal=True`` promises that no pattern is repeated or contained by another (the
        parser has checked it), which saves the pruning."""
        self.patterns: tuple[PathPattern, ...] = (
            tuple(sorted(patterns, key=str)) if maximal else _prune(patterns)
        )
        self._index = _Trie(self.patterns)
        self._texts = [str(pattern) for pattern in self.patterns]
        self._order = {pattern: position for position, pattern in enumerate(self.patterns)}

    def __bool__(self) -> bool:
        return bool(self.patterns)

    def __iter__(self) -> Iterator[PathPattern]:
        return iter(self.patterns)

    def __len__(self) -> int:
        return len(self.patterns)

    def __repr__(self) -> str:
        return f"PathSet({[str(pattern) for pattern in self.patterns]!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PathSet):
            return NotImplemented
        return self.patterns == other.patterns or (self.within(other) and other.within(self))

    def __hash__(self) -> int:
        # Must agree with the semantic __eq__, so it hashes only properties every equal set
        # shares: the shortest matched path and whether matched paths are unbounded in length.
        if not self.patterns:
            return hash(())
        shortest = min(len(pattern.segments) for pattern in self.patterns)
        return hash((shortest, any(pattern.recursive for pattern in self.patterns)))

    def texts(self) -> list[str]:
        """The patterns as text, sorted: the canonical document form."""
        return list(self._texts)

    def covers(self, pattern: PathPattern) -> bool:
        """Whether every path ``pattern`` matches is matched by some pattern of this set.

        Exact, not conservative. A fixed-length pattern is covered by a union only if one
        member covers it alone (give each ``*`` a name no member spells out: the resulting
        path must match one member, which therefore covers the whole pattern). A recursive
        pattern is checked length by length; beyond the longest member only recursive members
        can match and their verdict no longer depends on the length, so the check stops there.
        """
        return self._index.covers(pattern)

    def contains_alone(self, pattern: PathPattern) -> bool:
        """Whether one member on its own contains ``pattern``."""
        return next(self._index.containing(pattern), None) is not None

    def within(self, other: PathSet) -> bool:
        """Whether every path this set matches is matched by ``other``."""
        return all(other.covers(pattern) for pattern in self.patterns)

    def uncovered_by(self, other: PathSet) -> list[PathPattern]:
        """This set's patterns that reach paths ``other`` does not match."""
        return [pattern for pattern in self.patterns if not other.covers(pattern)]

    def intersect(self, other: PathSet) -> PathSet:
        """The set matching exactly the paths both sets match.

        The same set as pruning every pairwise intersection, without forming them all: a
        pattern that lies within one pattern of the other side is its own intersection with
        it, and every other intersection it takes part in lies within it, so it is kept as
        is; only the remaining patterns are met pairwise, each with the members of the other
        side's trie it can meet. A narrowing (each pattern within one of its ceiling's) and a
        meet with ``**`` are therefore linear.
        """
        mine = [pattern for pattern in self.patterns if other.contains_alone(pattern)]
        theirs = [pattern for pattern in other.patterns if self.contains_alone(pattern)]
        # No pattern of ``inside`` contains another: each side is pruned, and a pattern of
        # one side inside a pattern of the other that lies within the first side would be
        # inside a second pattern of its own side.
        inside = {*mine, *theirs}
        rest_of_mine = [pattern for pattern in self.patterns if pattern not in inside]
        rest_of_theirs = _Trie(pattern for pattern in other.patterns if pattern not in inside)
        meets = [
            met
            for pattern in rest_of_mine
            for partner in rest_of_theirs.intersecting(pattern)
            if (met := pattern.intersect(partner)) is not None
        ]
        if not meets:
            return PathSet(inside, maximal=True)
        return PathSet([*inside, *meets])

    def matches(self, path: str) -> bool:
        """Whether a canonical workspace-relative path (``"."`` for the root) matches."""
        return next(self._index.matching(path), None) is not None

    def first_match(self, path: str) -> PathPattern | None:
        """The first pattern (in canonical order) that matches ``path``, for explanations."""
        return min(self._index.matching(path), key=self._order.__getitem__, default=None)
