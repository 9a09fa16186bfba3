"""Enrolling and revoking runner identities."""

from __future__ import annotations

import re

from django.db import transaction
from django.utils import timezone

from kestrel_one.audit.services import audit_record
from kestrel_one.common.errors import ValidationFailed
from kestrel_one.execution.models import Runner
from runners.contract.tokens import load_public_key

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
    runner = Runner.objects.create(
        organization=organization,
        pool=pool,
        name=name,
        public_key=public_key_pem,
        enrolled_by=actor.actor_id,
    )
    if organization is not None:
        audit_record(
            organization=organization,
            actor=actor,
            action="runner.enroll",
            target=runner,
            data={"pool": pool},
        )
    return runner


@transaction.atomic
def runner_revoke(*, actor, runner: Runner) -> Runner:
    """From now on nothing this runner signs is accepted."""
    moved = Runner.objects.filter(pk=runner.pk, revoked_at__isnull=True).update(
        revoked_at=timezone.now()
    )
    runner.refresh_from_db()
    if moved and runner.organization is not None:
        audit_record(
            organization=runner.organization,
            actor=actor,
            action="runner.revoke",
            target=runner,
            data={"pool": runner.pool},
        )
    return runner
