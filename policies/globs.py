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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

STAR = "*"
GLOBSTAR = "**"
# Characters that other glob dialects give a meaning; accepting them literally would let a
# pattern mean something different from what its author expected.
_GLOB_METACHARACTERS = frozenset("*?[]{}")


def _segment_problem(segment: str) -> str | None:
    """Why ``segment`` cannot be a segment of a workspace path, or None when it can."""
    if segment == "":
        return "has an empty segment"
    if segment in (".", ".."):
        return f"has a '{segment}' segment"
    if any(ord(char) < 32 or ord(char) == 127 for char in segment):
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

    def regex_source(self) -> str:
        """A regular expression matching the canonical paths this pattern matches."""
        parts = ["[^/]+" if segment == STAR else re.escape(segment) for segment in self.segments]
        body = "/".join(parts)
        if not self.recursive:
            return body
        # The workspace root is matched as the empty string (see PathSet.matches).
        return f"{body}(?:/.*)?" if body else ".*"


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
        elif _GLOB_METACHARACTERS.intersection(segment):
            raise ValueError(
                f"segment '{segment}' is ambiguous: wildcards must be a whole segment "
                "('*' or a final '**'), and '?', '[', ']', '{', '}' are not allowed"
            )
        else:
            parsed.append(segment)
    return PathPattern(tuple(parsed), recursive)


def _prune(patterns: Iterable[PathPattern]) -> tuple[PathPattern, ...]:
    """Drop patterns that another pattern of the set already covers; sort the rest."""
    unique = set(patterns)
    kept = [
        pattern
        for pattern in unique
        if not any(other != pattern and other.contains(pattern) for other in unique)
    ]
    return tuple(sorted(kept, key=str))


class PathSet:
    """A finite union of path patterns, compared by the set of paths it matches.

    Two sets are equal when they match the same paths, even if written differently:
    ``["src", "src/*/**"]`` equals ``["src/**"]``. The regular expression used by ``matches``
    is compiled once, when the set is built, so judging a request never recompiles it.
    """

    __slots__ = ("_each", "_regex", "patterns")

    def __init__(self, patterns: Iterable[PathPattern]) -> None:
        self.patterns: tuple[PathPattern, ...] = _prune(patterns)
        self._each = tuple(re.compile(p.regex_source(), re.DOTALL) for p in self.patterns)
        alternatives = "|".join(f"(?:{pattern.regex_source()})" for pattern in self.patterns)
        self._regex = re.compile(alternatives, re.DOTALL) if self.patterns else None

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
        return [str(pattern) for pattern in self.patterns]

    def covers(self, pattern: PathPattern) -> bool:
        """Whether every path ``pattern`` matches is matched by some pattern of this set.

        Exact, not conservative. A fixed-length pattern is covered by a union only if one
        member covers it alone (give each ``*`` a name no member spells out: the resulting
        path must match one member, which therefore covers the whole pattern). A recursive
        pattern is checked length by length; beyond the longest member only recursive members
        can match and their verdict no longer depends on the length, so the check stops there.
        """
        if any(member.contains(pattern) for member in self.patterns):
            return True
        if not pattern.recursive or not self.patterns:
            return False
        longest_member = max(len(member.segments) for member in self.patterns)
        last_length = max(len(pattern.segments), longest_member + 1)
        for length in range(len(pattern.segments), last_length + 1):
            fixed = PathPattern(
                pattern.segments + (STAR,) * (length - len(pattern.segments)), False
            )
            if not any(member.contains(fixed) for member in self.patterns):
                return False
        return True

    def within(self, other: PathSet) -> bool:
        """Whether every path this set matches is matched by ``other``."""
        return all(other.covers(pattern) for pattern in self.patterns)

    def uncovered_by(self, other: PathSet) -> list[PathPattern]:
        """This set's patterns that reach paths ``other`` does not match."""
        return [pattern for pattern in self.patterns if not other.covers(pattern)]

    def intersect(self, other: PathSet) -> PathSet:
        """The set matching exactly the paths both sets match."""
        meets = (mine.intersect(theirs) for mine in self.patterns for theirs in other.patterns)
        return PathSet(pattern for pattern in meets if pattern is not None)

    def matches(self, path: str) -> bool:
        """Whether a canonical workspace-relative path (``"."`` for the root) matches."""
        if self._regex is None:
            return False
        return self._regex.fullmatch("" if path == "." else path) is not None

    def first_match(self, path: str) -> PathPattern | None:
        """The first pattern (in canonical order) that matches ``path``, for explanations."""
        subject = "" if path == "." else path
        for pattern, regex in zip(self.patterns, self._each, strict=True):
            if regex.fullmatch(subject):
                return pattern
        return None
