"""Publishing policy versions: the only way an environment's or a project's policy changes."""

from __future__ import annotations

import json

from django.conf import settings
from django.db import transaction

from kestrel_one.audit.services import audit_record
from kestrel_one.common.errors import Conflict, KestrelError, ValidationFailed
from kestrel_one.governance.models import PolicyDraft, PolicyVersion, SurfacePolicyVersion
from kestrel_one.governance.selectors import (
    environment_ceiling,
    parse_surface,
    policy_of,
    surface_version_current,
)
from kestrel_one.tenancy.models import Environment, Organization, Project
from kestrel_one.webhooks.services import webhook_emit_policy_published
from policies import DocumentLimits, PolicyError, PolicyTooLarge, parse_policy_json, widenings


class PolicyWidens(KestrelError):
    code = "policy_widens"
    status = 400


class PolicyTooLargeError(KestrelError):
    code = "policy_too_large"
    status = 400


def document_limits() -> DocumentLimits:
    """The caps every published document is held to (settings.KESTREL_POLICY_LIMITS)."""
    return DocumentLimits(**settings.KESTREL_POLICY_LIMITS)


def limit_setting(limit: str) -> str:
    """The setting that holds the ``DocumentLimits`` field ``limit``."""
    return f"KESTREL_POLICY_MAX_{limit.upper()}"


def _too_large(exc: PolicyTooLarge) -> PolicyTooLargeError:
    field = exc.path or "(document)"
    setting = limit_setting(exc.limit)
    if exc.limit == "bytes":
        what = f"The policy document is {exc.actual} bytes; at most {exc.maximum} are allowed"
    else:
        what = f"{field} has {exc.actual} items; at most {exc.maximum} are allowed"
    hint = (
        " Grant a directory ('dir/**') instead of listing what is in it."
        if exc.limit == "paths"
        else ""
    )
    return PolicyTooLargeError(
        f"{what} ({setting}).{hint} Nothing was published; the operator can raise {setting}.",
        details={
            "field": field,
            "limit": exc.maximum,
            "actual": exc.actual,
            "setting": setting,
        },
    )


def _parse(document: bytes | dict) -> object:
    """Parse strictly, within the document caps. Raw request bytes are preferred: only they
    show repeated JSON keys, which a parsed dict has already silently collapsed."""
    if not isinstance(document, bytes | str):
        document = json.dumps(document, ensure_ascii=False)
    try:
        return parse_policy_json(document, limits=document_limits())
    except PolicyTooLarge as exc:
        raise _too_large(exc) from None
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


def draft_owner(owner: Environment | Project) -> dict:
    """The lookup of ``owner``'s draft: one draft per environment or project."""
    if isinstance(owner, Environment):
        return {"environment": owner}
    return {"project": owner}


@transaction.atomic
def policy_draft_save(*, actor, owner: Environment | Project, text: str) -> PolicyDraft:
    """Save the draft of ``owner``'s next policy, replacing the one before.

    Held to exactly what publishing holds a document to (``_parse``: the strict parser,
    within the caps), so a draft that saves is one that can be published, except for a
    project draft that widens its environment: that one saves, so the editor can name every
    widening, and publishing it is refused with them (``policy_publish_project``).
    """
    policy = _parse(text.encode("utf-8", "surrogatepass"))
    base = owner.policy_version
    draft, _ = PolicyDraft.objects.update_or_create(
        **draft_owner(owner),
        defaults={
            "organization": owner.organization,
            "text": text,
            "document": policy.to_document(),
            "sha256": policy.sha256(),
            "base_version": base.public_id if base else "",
            "base_sha256": base.sha256 if base else "",
            "updated_by": actor.actor_id,
        },
    )
    audit_record(
        organization=owner.organization,
        actor=actor,
        action="policy.draft_save",
        target=owner,
        data={"sha256": draft.sha256, "base_version": draft.base_version or None},
    )
    return draft


@transaction.atomic
def policy_draft_discard(*, actor, owner: Environment | Project) -> bool:
    """Throw ``owner``'s draft away; False when there was none."""
    deleted, _ = PolicyDraft.objects.filter(**draft_owner(owner)).delete()
    if deleted:
        audit_record(
            organization=owner.organization,
            actor=actor,
            action="policy.draft_discard",
            target=owner,
        )
    return bool(deleted)


class DraftChanged(Conflict):
    code = "draft_changed"


@transaction.atomic
def policy_draft_publish(
    *, actor, owner: Environment | Project, expected_sha256: str
) -> PolicyVersion:
    """Publish ``owner``'s draft through the publish service of its kind, then drop it.

    ``expected_sha256`` is the hash of the draft the person looked at: if the draft was
    saved again since, nothing is published, so nobody publishes a document they did not see.
    """
    draft = PolicyDraft.objects.select_for_update().filter(**draft_owner(owner)).first()
    if draft is None:
        raise DraftChanged("There is no draft to publish: it was published or discarded.")
    if draft.sha256 != expected_sha256:
        raise DraftChanged(
            "The draft was saved again since you loaded this page; nothing was published. "
            "Review the draft as it is now, then publish it."
        )
    document = draft.text.encode("utf-8", "surrogatepass")
    if isinstance(owner, Environment):
        version = policy_publish_environment(actor=actor, environment=owner, document=document)
    else:
        version = policy_publish_project(actor=actor, project=owner, document=document)
    draft.delete()
    return version


@transaction.atomic
def surface_policy_publish(
    *, actor, organization: Organization, surface: str, document: bytes | dict
) -> SurfacePolicyVersion:
    """Publish what ``surface`` (api, console, mcp) may use in ``organization``: one term of
    every effective policy there, so a narrower one narrows every request through that
    surface at once, and queued actions decided under the old one are decided again.

    Held to what publishing an environment policy is: the caller's ``policies:write`` (checked
    by the view), which the local agent and the tokens it or an MCP client gets never hold;
    an owner may give it to an integration (a policy bot) on purpose. The document is held to
    what an environment policy is (``_parse``).
    """
    surface = parse_surface(surface)
    policy = _parse(document)
    # Locked FOR UPDATE, the row every decider holds FOR KEY SHARE (policy_versions_lock):
    # a decision in this organization happens before this version or is made under it.
    organization = Organization.objects.select_for_update().get(pk=organization.pk)
    current = surface_version_current(organization, surface)
    sha256 = policy.sha256()
    if current is not None and current.sha256 == sha256:
        return current  # publishing the same document again changes nothing
    version = SurfacePolicyVersion.objects.create(
        organization=organization,
        surface=surface,
        document=policy.to_document(),
        sha256=sha256,
        previous=current,
        created_by=actor.actor_id,
    )
    audit_record(
        organization=organization,
        actor=actor,
        action="surface_policy.publish",
        target=version,
        data={
            "surface": surface,
            "version": version.public_id,
            "sha256": sha256,
            "previous_version": current.public_id if current else None,
            "previous_sha256": current.sha256 if current else None,
        },
    )
    return version
