"""Enrolling and revoking runner identities, and which pool an organization's calls use.

A pool is shared (every organization's calls may go there; its runners are the platform's)
or dedicated to one organization (its runners serve that organization only). The first
runner enrolled in a pool decides which; a runner of any other kind is refused there, and
``KESTREL_DEFAULT_POOL`` is always shared. Each runner also gets a broker user of its own
(``broker_users``), which revocation removes.
"""

from __future__ import annotations

import logging
import re

from django.conf import settings
from django.db import transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from kestrel_one.audit.services import audit_record
from kestrel_one.common.errors import (
    KestrelError,
    PermissionDenied,
    Unavailable,
    ValidationFailed,
)
from kestrel_one.execution.broker_users import (
    runner_broker_user_issue,
    runner_broker_user_remove,
)
from kestrel_one.execution.models import Runner, RunnerPool
from runners.contract.tokens import load_public_key

logger = logging.getLogger(__name__)

POOL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@transaction.atomic
def runner_enroll(
    *, actor, pool: str, public_key_pem: str, organization=None, name: str = ""
) -> Runner:
    """Register a runner's public key for a pool (an organization's own, or the platform's)."""
    if not POOL_NAME.match(pool):
        raise ValidationFailed(
            "A pool name is letters, digits, '_', '-' or '.', at most 64.",
            details={"pool": ["invalid"]},
        )
    try:
        load_public_key(public_key_pem)
    except Exception:
        raise ValidationFailed(
            "The public key must be an Ed25519 public key in PEM form.",
            details={"public_key": ["not an Ed25519 PEM public key"]},
        ) from None
    _pool_claim(pool=pool, organization=organization)
    runner = Runner.objects.create(
        organization=organization,
        pool=pool,
        name=name,
        public_key=public_key_pem,
        enrolled_by=actor.actor_id,
    )
    # Shown once (runner_enroll prints it); the database keeps only its hash. A broker that
    # cannot make the user fails the enrollment: no runner gets a credential nobody can revoke.
    runner.broker_password = runner_broker_user_issue(runner=runner)
    if organization is not None:
        audit_record(
            organization=organization,
            actor=actor,
            action="runner.enroll",
            target=runner,
            data={"pool": pool},
        )
    return runner


def _pool_claim(*, pool: str, organization) -> RunnerPool:
    """The pool, recorded as shared or as ``organization``'s; refused if it is the other kind."""
    owner_id = organization.pk if organization is not None else None
    if owner_id is not None and pool == settings.KESTREL_DEFAULT_POOL:
        raise ValidationFailed(
            f"Pool {pool!r} is the default pool, which serves every organization; give an "
            "organization's own runners a pool of their own.",
            details={"pool": ["shared"]},
        )
    record, _ = RunnerPool.objects.select_for_update().get_or_create(
        name=pool, defaults={"organization": organization}
    )
    # Pools enrolled before pools were recorded: their active runners say what they are.
    mixed = Runner.objects.filter(pool=pool, revoked_at__isnull=True).exclude(
        organization_id=owner_id
    )
    if record.organization_id != owner_id or mixed.exists():
        joining = "an organization's own runner" if owner_id is not None else "a shared runner"
        raise ValidationFailed(
            f"Pool {pool!r} is {'shared' if record.organization_id is None else 'dedicated'} "
            f"and serves runners of another kind, so {joining} cannot join it; use another "
            "pool name.",
            details={"pool": ["taken"]},
        )
    return record


@transaction.atomic
def runner_pool_route(*, actor, organization, pool: str | None) -> str:
    """Send ``organization``'s calls to its dedicated ``pool`` (None: back to the shared
    default pool). Returns the pool its calls go to now."""
    RunnerPool.objects.filter(organization=organization, routes_calls=True).update(
        routes_calls=False
    )
    if pool is not None:
        moved = RunnerPool.objects.filter(name=pool, organization=organization).update(
            routes_calls=True
        )
        if not moved:
            raise ValidationFailed(
                f"Pool {pool!r} is not dedicated to this organization: enroll one of its "
                "runners there first (runner_enroll --org).",
                details={"pool": ["not_dedicated"]},
            )
    routed = pool or settings.KESTREL_DEFAULT_POOL
    audit_record(
        organization=organization,
        actor=actor,
        action="runner.pool_route",
        target=organization,
        data={"pool": routed},
    )
    return routed


def call_pool_for(organization) -> str:
    """The pool ``organization``'s calls are sent to: its routed dedicated pool, else the
    shared default one; never a pool dedicated to anyone else (one query)."""
    default = settings.KESTREL_DEFAULT_POOL
    pools = RunnerPool.objects.filter(
        Q(organization=organization, routes_calls=True) | Q(name=default)
    ).values_list("name", "organization_id", "routes_calls")
    routed = [name for name, _, routes in pools if routes]
    if routed:
        return routed[0]
    if any(owner not in (None, organization.pk) for _, owner, _ in pools):
        # KESTREL_DEFAULT_POOL was changed to name a pool enrolled as someone's own.
        raise Unavailable(
            f"Execution is off: KESTREL_DEFAULT_POOL ({default!r}) names a pool dedicated to "
            "one organization, so it cannot take every organization's calls. Set it to a "
            "shared pool."
        )
    return default


@transaction.atomic
def runner_revoke(*, actor, runner: Runner) -> Runner:
    """From now on nothing this runner signs is accepted, and it can take no command: its
    broker user is removed and its connections ended.

    The database comes first, so a broker that does not answer never keeps a revocation
    from counting; the sweep's reconcile then removes the user when the broker is back.
    """
    moved = Runner.objects.filter(pk=runner.pk, revoked_at__isnull=True).update(
        revoked_at=timezone.now()
    )
    runner.refresh_from_db()
    try:
        runner_broker_user_remove(runner_id=runner.public_id)
    except KestrelError as error:
        logger.warning(
            "runner %s revoked; its broker user is removed when the broker answers (%s)",
            runner.public_id,
            error.message,
        )
    if moved and runner.organization is not None:
        audit_record(
            organization=runner.organization,
            actor=actor,
            action="runner.revoke",
            target=runner,
            data={"pool": runner.pool},
        )
    return runner


def runners_serving(organization) -> QuerySet[Runner]:
    """The runners that serve ``organization``: its own (revoked ones too, so their history
    shows), and the active shared runners of the default pool its calls may go to. The API's
    runner list and the console's runners page both read this."""
    return Runner.objects.filter(
        Q(organization=organization)
        | Q(organization__isnull=True, pool=settings.KESTREL_DEFAULT_POOL, revoked_at__isnull=True)
    )


def runner_revoke_for_organization(*, actor, runner: Runner) -> Runner:
    """A member's revocation (API or console): only the organization's own runners. A shared
    runner holds nothing of any one organization and serves them all; it is the operator's."""
    if runner.organization_id is None:
        raise PermissionDenied(
            "This runner is shared by every organization on this service; only the "
            "operator can revoke it (python manage.py runner_revoke)."
        )
    return runner_revoke(actor=actor, runner=runner)
