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
from django.db.models import OuterRef, Subquery

from kestrel_one.common.errors import ValidationFailed, echo
from kestrel_one.governance.models import PolicyVersion, Surface, SurfacePolicyVersion
from kestrel_one.tenancy.models import Environment, Organization, Project
from policies import (
    CAPABILITY_NAMES,
    Mode,
    Policy,
    meet_all,
    mode_mask,
    parse_policy,
    widenings,
)

# The surfaces a request can come through. Each organization may publish a policy per
# surface (SurfacePolicyVersion); a surface without one grants every capability.
SURFACES: tuple[str, ...] = tuple(Surface.values)
ALLOW_ALL = Policy.allowing(CAPABILITY_NAMES)

EMPTY_POLICY = Policy.deny_all()


# Parsed versions, by (version id, content hash); a version never changes, so the cache can
# never keep an old width alive.
_PARSED: OrderedDict[tuple[str, str], Policy] = OrderedDict()
_PARSED_LOCK = threading.Lock()
PARSED_CACHE_SIZE = 1024


def policy_of(version: PolicyVersion | SurfacePolicyVersion | None) -> Policy | None:
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


def parse_surface(value: str | None, *, field: str = "surface") -> str:
    """The surface named by a caller (default ``api``), or a 400 naming the field."""
    surface = value or Surface.API.value
    if surface not in SURFACES:
        allowed = ", ".join(SURFACES)
        raise ValidationFailed(
            f"Unknown surface {echo(surface)!r}; use one of {allowed}.",
            details={field: [f"one of {allowed}"]},
        )
    return surface


def surface_version_current(organization, surface: str) -> SurfacePolicyVersion | None:
    """The surface's current policy version (its newest), or None: then it grants everything."""
    return (
        SurfacePolicyVersion.objects.filter(organization=organization, surface=surface)
        .order_by("-id")
        .first()
    )


def surface_policy(version: SurfacePolicyVersion | None) -> Policy:
    """What a surface grants: its current version's document, every capability without one."""
    return policy_of(version) or ALLOW_ALL


def surface_label(surface: str, version: str | None) -> str:
    """The surface term of a version label: ``mcp@spv_...``, or just ``api`` with no version
    (so labels made before surface policies existed still match)."""
    return surface if version is None else f"{surface}@{version}"


def version_label(
    *,
    environment_version,
    project_version,
    mode: Mode,
    surface: str,
    surface_version: str | None = None,
) -> str:
    """The identity decisions record: both versions, the mode, and the surface with its
    version. A change of any of them (a narrower surface policy too) makes a new label, and a
    queued action whose label is no longer current is decided again (POL-3)."""
    return (
        f"env:{environment_version or 'none'}+prj:{project_version or 'inherit'}"
        f"+mode:{mode}+surface:{surface_label(surface, surface_version)}"
    )


@dataclass(frozen=True)
class EffectivePolicy:
    """The policy one request may use, and the versions it was computed from."""

    policy: Policy
    mode: Mode
    surface: str
    environment_version: str | None
    project_version: str | None
    # The surface's current policy version, and what it grants (every capability when None).
    surface_version: str | None = None
    surface_policy: Policy = ALLOW_ALL

    @property
    def version(self) -> str:
        return version_label(
            environment_version=self.environment_version,
            project_version=self.project_version,
            mode=self.mode,
            surface=self.surface,
            surface_version=self.surface_version,
        )

    def surface_term(self) -> dict:
        """The surface term of the meet, as the API shows it: without a version the surface
        grants every capability, which no document can spell (``document`` is null)."""
        return {
            "name": self.surface,
            "version": self.surface_version,
            "document": None if self.surface_version is None else self.surface_policy.to_document(),
        }

    def describe(self) -> dict:
        return {
            "mode": self.mode.value,
            "surface": self.surface,
            "surface_policy": self.surface_term(),
            "versions": {
                "environment": self.environment_version,
                "project": self.project_version,
                "surface": self.surface_version,
            },
            "version": self.version,
            "document": self.policy.to_document(),
            "sha256": self.policy.sha256(),
        }


def _current_versions(
    project, surface: str
) -> tuple[PolicyVersion | None, PolicyVersion | None, SurfacePolicyVersion | None]:
    """The environment's, the project's and the surface's current versions, read from the
    database on every call (one query for the three ids), never from the caller's (possibly
    stale) objects."""
    newest_surface_version = (
        SurfacePolicyVersion.objects.filter(
            organization=OuterRef("organization_id"), surface=surface
        )
        .order_by("-id")
        .values("id")[:1]
    )
    env_version_id, prj_version_id, surface_version_id = (
        Project.objects.filter(pk=project.pk)
        .annotate(surface_version_id=Subquery(newest_surface_version))
        .values_list("environment__policy_version_id", "policy_version_id", "surface_version_id")
        .get()
    )
    # Without their documents: a version's document is read (and parsed) only the first time
    # this process meets the version (policy_of), and a large one costs milliseconds to decode.
    versions = PolicyVersion.objects.defer("document").in_bulk(
        [v for v in (env_version_id, prj_version_id) if v]
    )
    surface_version = (
        SurfacePolicyVersion.objects.defer("document").filter(pk=surface_version_id).first()
        if surface_version_id
        else None
    )
    return versions.get(env_version_id), versions.get(prj_version_id), surface_version


def policy_versions_lock(project) -> None:
    """Until the transaction ends, no version of ``project``'s policy can be published, nor
    any surface policy of its organization.

    Takes the rows a publish locks, in the order it locks them (the organization for a
    surface policy, the environment, then the project: ``governance.services``), so that what
    is done with the versions read next (an approval, a signed command) happens before any
    narrowing or is decided under it. On PostgreSQL the locks are ``FOR KEY SHARE``: deciders
    never wait for one another, only a publish (``FOR UPDATE``) waits for them and they for
    it. SQLite takes none: its transactions begin ``IMMEDIATE`` (settings), so a transaction
    that writes holds the database's one write lock from its start.
    """
    if not connection.in_atomic_block:
        raise RuntimeError("policy_versions_lock holds only inside a transaction")
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        for model, pk in (
            (Organization, project.organization_id),
            (Environment, project.environment_id),
            (Project, project.pk),
        ):
            table = connection.ops.quote_name(model._meta.db_table)
            cursor.execute(f"SELECT 1 FROM {table} WHERE id = %s FOR KEY SHARE", [pk])  # noqa: S608 - a model's table name


def policy_version_label(*, project, mode: Mode, surface: str = "api") -> str:
    env_version, prj_version, surface_version = _current_versions(project, parse_surface(surface))
    return version_label(
        environment_version=env_version.public_id if env_version else None,
        project_version=prj_version.public_id if prj_version else None,
        mode=mode,
        surface=surface,
        surface_version=surface_version.public_id if surface_version else None,
    )


def effective_policy(*, project, principal, mode: Mode, surface: str = "api") -> EffectivePolicy:
    surface = parse_surface(surface)
    env_version, prj_version, surface_version = _current_versions(project, surface)
    on_surface = surface_policy(surface_version)
    policy = _layered(
        _version_key(env_version),
        _version_key(prj_version),
        _version_key(surface_version),
        policy_of(env_version) or EMPTY_POLICY,
        policy_of(prj_version),
        on_surface,
        mode_mask(mode),
        token_mask(principal, project.organization),
    )
    return EffectivePolicy(
        policy=policy,
        mode=mode,
        surface=surface,
        environment_version=env_version.public_id if env_version else None,
        project_version=prj_version.public_id if prj_version else None,
        surface_version=surface_version.public_id if surface_version else None,
        surface_policy=on_surface,
    )


def _version_key(version: PolicyVersion | SurfacePolicyVersion | None) -> tuple[str, str] | None:
    return None if version is None else (version.public_id, version.sha256)


@lru_cache(maxsize=1024)
def _layered(
    environment_key: tuple[str, str] | None,
    project_key: tuple[str, str] | None,
    surface_key: tuple[str, str] | None,
    environment: Policy,
    project: Policy | None,
    surface: Policy,
    *masks: Policy,
) -> Policy:
    """Environment ∩ Project ∩ surface ∩ masks, computed once per combination of immutable
    versions (the keys) and masks: a meet of two large documents costs milliseconds, and
    every call asks for one. The keys make two versions that merely grant the same never
    share an entry, so the effective document is exactly the one a fresh meet would give."""
    layers = [environment] if project is None else [environment, project]
    return meet_all(*layers, surface, *masks)
