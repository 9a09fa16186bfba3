"""Reading policy: the stored versions and the effective policy of one request.

Effective policy = Environment ∩ Project ∩ surface ∩ mode ∩ token scope, computed from the
current versions on every call. Parsed documents are cached by content hash only: a version
is immutable, so the cache can never keep an old width alive (POL-3).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache

from django.db import connection

from kestrel_one.common.errors import ValidationFailed
from kestrel_one.governance.models import PolicyVersion
from kestrel_one.tenancy.models import Environment, Project
from policies import (
    CAPABILITY_NAMES,
    Mode,
    Policy,
    meet_all,
    mode_mask,
    parse_policy,
    widenings,
)

# Each surface a request can come through masks what it may use. The API is the only
# surface so far; the console and MCP surfaces will bring masks of their own.
SURFACE_MASKS: dict[str, Policy] = {
    "api": Policy.allowing(CAPABILITY_NAMES),
    "console": Policy.allowing(CAPABILITY_NAMES),
    "mcp": Policy.allowing(CAPABILITY_NAMES),
}

EMPTY_POLICY = Policy.deny_all()


# Parsed versions, by (version id, content hash); a version never changes, so the cache can
# never keep an old width alive.
_PARSED: OrderedDict[tuple[str, str], Policy] = OrderedDict()
_PARSED_LOCK = threading.Lock()
PARSED_CACHE_SIZE = 1024


def policy_of(version: PolicyVersion | None) -> Policy | None:
    if version is None:
        return None
    key = (version.public_id, version.sha256)
    with _PARSED_LOCK:
        policy = _PARSED.get(key)
        if policy is not None:
            _PARSED.move_to_end(key)
            return policy
    # Stored versions were held to the caps when they were published; lowering a cap later
    # must not make a published version unreadable, so none is applied here.
    policy = parse_policy(json.loads(json.dumps(version.document)), limits=None)
    with _PARSED_LOCK:
        _PARSED[key] = policy
        while len(_PARSED) > PARSED_CACHE_SIZE:
            _PARSED.popitem(last=False)
    return policy


def environment_ceiling(environment) -> Policy:
    """The environment's current policy; an environment without one grants nothing."""
    return policy_of(environment.policy_version) or EMPTY_POLICY


def project_exceeds(project) -> list:
    """Where the project's stored policy is now wider than its environment's ceiling."""
    own = policy_of(project.policy_version)
    if own is None:
        return []
    return widenings(own, environment_ceiling(project.environment), parent_label="environment")


def token_mask(principal, organization) -> Policy:
    """What the caller's token scope lets a request use: executing tools needs projects:write."""
    scopes = principal.scopes_in(organization)
    if "projects:write" in scopes:
        return Policy.allowing(CAPABILITY_NAMES)
    return EMPTY_POLICY


def parse_mode(value: str | None, *, field: str = "mode") -> Mode:
    try:
        return Mode(value or Mode.AGENT.value)
    except ValueError:
        allowed = ", ".join(m.value for m in Mode)
        raise ValidationFailed(
            f"Unknown mode {value!r}; use one of {allowed}.", details={field: [f"one of {allowed}"]}
        ) from None


def version_label(*, environment_version, project_version, mode: Mode, surface: str) -> str:
    """The identity decisions record: both versions, the mode and the surface."""
    return (
        f"env:{environment_version or 'none'}+prj:{project_version or 'inherit'}"
        f"+mode:{mode}+surface:{surface}"
    )


@dataclass(frozen=True)
class EffectivePolicy:
    """The policy one request may use, and the versions it was computed from."""

    policy: Policy
    mode: Mode
    surface: str
    environment_version: str | None
    project_version: str | None

    @property
    def version(self) -> str:
        return version_label(
            environment_version=self.environment_version,
            project_version=self.project_version,
            mode=self.mode,
            surface=self.surface,
        )

    def describe(self) -> dict:
        return {
            "mode": self.mode.value,
            "surface": self.surface,
            "versions": {
                "environment": self.environment_version,
                "project": self.project_version,
            },
            "version": self.version,
            "document": self.policy.to_document(),
            "sha256": self.policy.sha256(),
        }


def _current_versions(project) -> tuple[PolicyVersion | None, PolicyVersion | None]:
    """The environment's and the project's current versions, read from the database on every
    call, never from the caller's (possibly stale) objects."""
    env_version_id, prj_version_id = (
        Project.objects.filter(pk=project.pk)
        .values_list("environment__policy_version_id", "policy_version_id")
        .get()
    )
    versions = PolicyVersion.objects.in_bulk([v for v in (env_version_id, prj_version_id) if v])
    return versions.get(env_version_id), versions.get(prj_version_id)


def policy_versions_lock(project) -> None:
    """Until the transaction ends, no version of ``project``'s policy can be published.

    Takes the rows a publish locks, in the order it locks them (the environment, then the
    project: ``governance.services``), so that what is done with the versions read next (an
    approval, a signed command) happens before any narrowing or is decided under it. On
    PostgreSQL the locks are ``FOR KEY SHARE``: deciders never wait for one another, only a
    publish (``FOR UPDATE``) waits for them and they for it. SQLite takes none: its
    transactions begin ``IMMEDIATE`` (settings), so a transaction that writes holds the
    database's one write lock from its start.
    """
    if not connection.in_atomic_block:
        raise RuntimeError("policy_versions_lock holds only inside a transaction")
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        for model, pk in ((Environment, project.environment_id), (Project, project.pk)):
            table = connection.ops.quote_name(model._meta.db_table)
            cursor.execute(f"SELECT 1 FROM {table} WHERE id = %s FOR KEY SHARE", [pk])  # noqa: S608 - a model's table name


def policy_version_label(*, project, mode: Mode, surface: str = "api") -> str:
    env_version, prj_version = _current_versions(project)
    return version_label(
        environment_version=env_version.public_id if env_version else None,
        project_version=prj_version.public_id if prj_version else None,
        mode=mode,
        surface=surface,
    )


def effective_policy(*, project, principal, mode: Mode, surface: str = "api") -> EffectivePolicy:
    if surface not in SURFACE_MASKS:
        raise ValidationFailed(f"Unknown surface {surface!r}.", details={"surface": ["unknown"]})
    env_version, prj_version = _current_versions(project)
    policy = _layered(
        _version_key(env_version),
        _version_key(prj_version),
        policy_of(env_version) or EMPTY_POLICY,
        policy_of(prj_version),
        SURFACE_MASKS[surface],
        mode_mask(mode),
        token_mask(principal, project.organization),
    )
    return EffectivePolicy(
        policy=policy,
        mode=mode,
        surface=surface,
        environment_version=env_version.public_id if env_version else None,
        project_version=prj_version.public_id if prj_version else None,
    )


def _version_key(version: PolicyVersion | None) -> tuple[str, str] | None:
    return None if version is None else (version.public_id, version.sha256)


@lru_cache(maxsize=1024)
def _layered(
    environment_key: tuple[str, str] | None,
    project_key: tuple[str, str] | None,
    environment: Policy,
    project: Policy | None,
    *masks: Policy,
) -> Policy:
    """Environment ∩ Project ∩ masks, computed once per combination of immutable versions
    (the keys) and masks: a meet of two large documents costs milliseconds, and every call
    asks for one. The keys make two versions that merely grant the same never share an entry,
    so the effective document is exactly the one a fresh meet would give."""
    layers = [environment] if project is None else [environment, project]
    return meet_all(*layers, *masks)
