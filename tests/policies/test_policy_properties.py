"""Lattice and monotonicity properties of the policy engine, checked on random policies.

Outcomes are ranked allow < needs_approval < deny (``OUTCOMES`` order). "decide is
monotone" means: when ``narrow`` narrows ``wide`` (no widenings), for every request the
narrow outcome ranks at or above the wide one. So if the narrower policy allows, the wider
allows; if the narrower needs approval, the wider allows or needs approval; and when both
let the request through, the narrower enforces limits at or below the wider's.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import meet, parse_policy, widenings
from policies.decide import OUTCOMES, decide

from .strategies import path_sets, policies, policy_documents, requests

MANY = settings(max_examples=1000, deadline=None)


def rank(policy, request) -> int:
    return OUTCOMES.index(decide(policy, request, version="v").outcome)


@pytest.mark.spec("POL-1", "POL-2")
@MANY
@given(policies, policies)
def test_meet_is_commutative(p, q):
    assert meet(p, q) == meet(q, p)


@pytest.mark.spec("POL-1", "POL-2")
@MANY
@given(policies, policies, policies)
def test_meet_is_associative(p, q, r):
    assert meet(meet(p, q), r) == meet(p, meet(q, r))


@pytest.mark.spec("POL-1", "POL-2")
@MANY
@given(policies)
def test_meet_is_idempotent(p):
    assert meet(p, p) == p


@pytest.mark.spec("POL-1", "POL-2")
@MANY
@given(policies, policies)
def test_meet_never_grants_more_than_either_side(p, q):
    both = meet(p, q)
    assert widenings(both, p) == []
    assert widenings(both, q) == []


@st.composite
def child_and_parent(draw):
    """Pairs where the child narrows about half the time, so both sides of the iff occur."""
    parent = draw(policies)
    child = draw(policies)
    if draw(st.booleans()):
        child = meet(child, parent)
    return child, parent


@pytest.mark.spec("POL-1", "POL-2")
@MANY
@given(child_and_parent())
def test_no_widenings_exactly_when_meet_leaves_child_unchanged(pair):
    child, parent = pair
    assert (widenings(child, parent) == []) == (meet(child, parent) == child)


@pytest.mark.spec("POL-1", "POL-2", "POL-6")
@MANY
@given(policies, policies, requests())
def test_decide_on_a_meet_is_the_stricter_of_both_decisions(p, q, request):
    """Exactness of meet, seen through decide; it implies monotonicity for meets."""
    assert rank(meet(p, q), request) == max(rank(p, request), rank(q, request))


@pytest.mark.spec("POL-1", "POL-2", "POL-6")
@MANY
@given(child_and_parent(), requests())
def test_decide_is_monotone(pair, request):
    narrow, wide = pair
    if widenings(narrow, wide):
        return
    narrow_decision = decide(narrow, request, version="narrow")
    wide_decision = decide(wide, request, version="wide")
    assert OUTCOMES.index(narrow_decision.outcome) >= OUTCOMES.index(wide_decision.outcome)
    if narrow_decision.outcome != "deny":
        for name, value in narrow_decision.limits.items():
            assert value <= wide_decision.limits[name]


@pytest.mark.spec("POL-1", "POL-6")
@MANY
@given(policy_documents(), st.randoms(use_true_random=False))
def test_document_round_trip_is_exact_and_order_free(document, random):
    policy = parse_policy(document)
    canonical = policy.to_document()
    assert parse_policy(canonical) == policy
    assert parse_policy(canonical).to_document() == canonical
    shuffled = {"capabilities": {}}
    for name, grant in reversed(list(document["capabilities"].items())):
        grant = dict(grant)
        for key, value in grant.items():
            if isinstance(value, list):
                grant[key] = random.sample(value, len(value))
        shuffled["capabilities"][name] = grant
    assert parse_policy(shuffled) == policy
    assert parse_policy(shuffled).sha256() == policy.sha256()


# A universe of paths longer than every generated pattern (at most 3 segments), including a name
# ("zz") no pattern spells, so it can witness any difference between two pattern sets.
UNIVERSE = ["."] + [
    "/".join(parts)
    for length in range(1, 5)
    for parts in itertools.product(("src", "docs", "a", "b", "zz"), repeat=length)
]


@pytest.mark.spec("POL-1")
@settings(max_examples=1000, deadline=None)
@given(path_sets, path_sets)
def test_path_set_algebra_agrees_with_matching(first, second):
    both = first.intersect(second)
    for path in UNIVERSE:
        assert both.matches(path) == (first.matches(path) and second.matches(path))
    witnessed = any(first.matches(path) and not second.matches(path) for path in UNIVERSE)
    assert first.within(second) == (not witnessed)
