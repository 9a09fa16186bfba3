"""Publishing policy versions: the only way an environment's or a project's policy changes."""

from __future__ import annotations

from django.db import transaction

from kestrel_one.audit.services import audit_record
from kestrel_one.common.errors import KestrelError, ValidationFailed
from kestrel_one.governance.models import PolicyVersion
from kestrel_one.governance.selectors import environment_ceiling, policy_of
from kestrel_one.tenancy.models import Environment, Project
from kestrel_one.webhooks.services import webhook_emit_policy_published
from policies import PolicyError, parse_policy, parse_policy_json, widenings


class PolicyWidens(KestrelError):
    code = "policy_widens"
    status = 400


def _parse(document: bytes | dict) -> object:
    """Parse strictly. Raw request bytes are preferred: only they show repeated JSON keys,
    which a parsed dict has already silently collapsed."""
    try:
        if isinstance(document, bytes | str):
            return parse_policy_json(document)
        return parse_policy(document)
    except PolicyError as exc:
        issues = [{"path": issue.path, "message": issue.message} for issue in exc.issues]
        raise ValidationFailed(
            f"The policy document has {len(issues)} problem(s): {exc}",
            details={"issues": issues},
        ) from None


def _publish(*, actor, owner, policy) -> PolicyVersion:
    current = owner.policy_version
    sha256 = policy.sha256()
    if current is not None and current.sha256 == sha256:
        return current  # publishing the same document again changes nothing
    is_environment = isinstance(owner, Environment)
    version = PolicyVersion.objects.create(
        organization=owner.organization,
        environment=owner if is_environment else None,
        project=None if is_environment else owner,
        document=policy.to_document(),
        sha256=sha256,
        previous=current,
        created_by=actor.actor_id,
    )
    type(owner).objects.filter(pk=owner.pk).update(policy_version=version)
    owner.policy_version = version
    audit_record(
        organization=owner.organization,
        actor=actor,
        action="policy.publish",
        target=owner,
        data={
            "version": version.public_id,
            "sha256": sha256,
            "previous_version": current.public_id if current else None,
            "previous_sha256": current.sha256 if current else None,
        },
    )
    webhook_emit_policy_published(owner=owner, version=version, previous=current)
    return version


@transaction.atomic
def policy_publish_environment(
    *, actor, environment: Environment, document: bytes | dict
) -> PolicyVersion:
    """Publish a new ceiling. Projects narrow with it at once: effective policy is computed
    from the current versions on every request, and projects now exceeding it are reported."""
    policy = _parse(document)
    environment = Environment.objects.select_for_update().get(pk=environment.pk)
    return _publish(actor=actor, owner=environment, policy=policy)


@transaction.atomic
def policy_publish_project(*, actor, project: Project, document: bytes | dict) -> PolicyVersion:
    """Publish a project's narrowing; anything wider than its environment is refused."""
    policy = _parse(document)
    # Lock the environment so that a concurrent environment publish cannot slip between
    # the check below and the write: the check runs against the ceiling that will stand.
    environment = Environment.objects.select_for_update().get(pk=project.environment_id)
    project = Project.objects.select_for_update().get(pk=project.pk)
    found = widenings(policy, environment_ceiling(environment), parent_label="environment")
    if found:
        raise PolicyWidens(
            f"This policy would widen its environment in {len(found)} place(s): "
            + "; ".join(f"{w.path}: {w.message}" for w in found),
            details={"widenings": [{"path": w.path, "message": w.message} for w in found]},
        )
    version = _publish(actor=actor, owner=project, policy=policy)
    # Re-check what was stored, inside the transaction, against the locked ceiling.
    if widenings(policy_of(version), environment_ceiling(environment)):
        raise PolicyWidens("The stored policy escaped its environment; nothing was published.")
    return version
