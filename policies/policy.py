"""The policy value, and the two operations narrowing is built on: ``meet`` and ``widenings``.

A ``Policy`` maps capability names to grants; a capability it lacks is denied. Policies are
immutable and compare by what they grant, so list order, duplicates in spelling and the
optional description never make two equivalent policies differ.

``meet`` is the intersection: it is what combines Environment, Project, surface, mode and
token scope into the effective policy. ``widenings`` says where a child grants more than a
parent; it is empty exactly when ``meet(child, parent) == child``, i.e. when the child
narrows (the property tests in ``tests/policies`` check this).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

from policies.capabilities import GRANT_KINDS, Grant, Location, Widening, full_width


class Policy:
    """An immutable set of capability grants."""

    __slots__ = ("_grants", "_hash", "_source", "description")

    def __init__(
        self,
        grants: Mapping[str, Grant],
        *,
        description: str | None = None,
        source: Mapping[str, Any] | None = None,
    ) -> None:
        for capability, grant in grants.items():
            kind = GRANT_KINDS.get(capability)
            if kind is None or type(grant) is not kind:
                raise TypeError(f"{capability!r} cannot hold a {type(grant).__name__}")
        self._grants: Mapping[str, Grant] = MappingProxyType(dict(sorted(grants.items())))
        # Free text for people; it grants nothing, so equality and hashing ignore it.
        self.description = description
        # The document this policy was parsed from, so widenings can point at the list
        # positions its author wrote; None for computed policies.
        self._source = source
        self._hash = hash(frozenset(self._grants.items()))

    @classmethod
    def allowing(cls, capabilities: Iterable[str]) -> Policy:
        """A mask: the named capabilities at full width, every other one denied.

        Meeting a policy with a mask keeps exactly the named capabilities as the policy has
        them. Surfaces, modes and token scopes are masks. A mask grants every origin, model
        and server, which no document can write, so ``to_document`` refuses it.
        """
        names = set(capabilities)
        unknown = names - GRANT_KINDS.keys()
        if unknown:
            raise ValueError(f"unknown capabilities {sorted(unknown)}")
        return cls({name: full_width(name) for name in names})

    @classmethod
    def deny_all(cls) -> Policy:
        """The policy granting nothing."""
        return cls({})

    @property
    def grants(self) -> Mapping[str, Grant]:
        return self._grants

    @property
    def capabilities(self) -> frozenset[str]:
        return frozenset(self._grants)

    def grant(self, capability: str) -> Grant | None:
        return self._grants.get(capability)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Policy):
            return NotImplemented
        return self._hash == other._hash and self._grants == other._grants

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"Policy({dict(self._grants)!r})"

    def to_document(self) -> dict[str, Any]:
        """The canonical document: every field explicit, lists sorted, defaults filled in.

        ``parse_policy(p.to_document()) == p`` for every policy with a document form.
        """
        document: dict[str, Any] = {
            "capabilities": {name: grant.to_document() for name, grant in self._grants.items()}
        }
        if self.description is not None:
            document["description"] = self.description
        return document

    def canonical_json(self) -> str:
        """The canonical document as JSON: sorted keys, no whitespace, UTF-8 kept."""
        return json.dumps(
            self.to_document(), sort_keys=True, separators=(",", ":"), ensure_ascii=False
        )

    def sha256(self) -> str:
        """Hex SHA-256 of ``canonical_json()``: the content hash of a policy version."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()


def meet(first: Policy, second: Policy) -> Policy:
    """The policy granting exactly what both grant (capability by capability)."""
    grants = {}
    for capability, grant in first.grants.items():
        other = second.grant(capability)
        if other is None:
            continue
        met = grant.meet(other)
        if met is not None:
            grants[capability] = met
    return Policy(grants)


def meet_all(first: Policy, *others: Policy) -> Policy:
    """``meet`` of several policies, e.g. Environment ∩ Project ∩ surface ∩ mode ∩ scope."""
    result = first
    for other in others:
        result = meet(result, other)
    return result


def widenings(child: Policy, parent: Policy, *, parent_label: str = "parent") -> list[Widening]:
    """Every place where ``child`` grants more than ``parent``; empty when the child narrows.

    ``parent_label`` names the parent in messages ("environment" gives "... is not within
    the environment's ['src/**']"). Paths point into the child's document as written.
    """
    found: list[Widening] = []
    source_capabilities = (child._source or {}).get("capabilities")
    for capability, grant in child.grants.items():
        raw = (
            source_capabilities.get(capability)
            if isinstance(source_capabilities, Mapping)
            else None
        )
        where = Location(capability, f"capabilities.{capability}", raw, parent_label)
        ceiling = parent.grant(capability)
        if ceiling is None:
            found.append(Widening(where.path, f"{capability} is not granted by the {parent_label}"))
            continue
        found += grant.widenings(ceiling, where)
    return found
