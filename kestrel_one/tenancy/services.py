"""Writes for organizations, memberships, environments and projects.

Each write records its audit row in the same transaction.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db import IntegrityError, transaction
from guardian.shortcuts import assign_perm, remove_perm

from kestrel_one.accounts.principal import Principal, PrincipalKind
from kestrel_one.accounts.scopes import ROLE_RANK, Role, outranks, role_scopes
from kestrel_one.accounts.selectors import integration_tokens_made_by
from kestrel_one.accounts.services import user_get_or_create
from kestrel_one.accounts.sign_in_links import (
    sign_in_link_allowed,
    sign_in_link_expires_at,
    sign_in_link_path,
)
from kestrel_one.audit.models import AuditChain
from kestrel_one.audit.services import audit_record
from kestrel_one.common.erasure import erasing
from kestrel_one.common.errors import Conflict, PermissionDenied, ValidationFailed
from kestrel_one.tenancy.models import Environment, Membership, Organization, Project
from kestrel_one.tenancy.signals import project_deleting

PROJECT_PERMISSIONS = ("view_project",)


@transaction.atomic
def organization_create(*, actor: Principal, slug: str, name: str, owner) -> Organization:
    if Organization.objects.filter(slug=slug).exists():
        raise Conflict(f"An organization with slug '{slug}' already exists.")
    organization = Organization(slug=slug, name=name or slug)
    organization.full_clean()
    organization.save()
    AuditChain.objects.create(organization=organization)
    Membership.objects.create(organization=organization, user=owner, role=Role.OWNER)
    audit_record(
        organization=organization,
        actor=actor,
        action="organization.create",
        target=organization,
        data={"slug": slug, "owner": owner.public_id},
    )
    return organization


def _check_can_grant(
    actor: Principal, organization, role: Role, projects: list[Project] | None
) -> None:
    """Nobody grants what they do not hold: a role above their own (only owners make owners),
    or a project set wider than their own (``projects`` None is every project)."""
    if actor.kind == PrincipalKind.SYSTEM:
        return  # an operator's command on the server itself (bootstrap, member_add)
    actor_role = actor.role_in(organization)
    # Integration tokens with members:write act as admins; nobody but an owner makes owners.
    rank = ROLE_RANK[actor_role] if actor_role else ROLE_RANK[Role.ADMIN]
    if ROLE_RANK[role] > rank or (role == Role.OWNER and actor_role != Role.OWNER):
        raise PermissionDenied(f"Your role cannot grant the role '{role}'.")
    limit = Project.objects.limit_of(actor, organization)
    if limit is None:
        return
    if projects is None:
        raise PermissionDenied(
            "You are limited to some projects, so you cannot grant every project: name the "
            "projects (only ones you can see).",
            details={"projects": ["all projects is wider than yours"]},
        )
    held = set(limit.values_list("pk", flat=True))
    beyond = sorted(p.public_id for p in projects if p.pk not in held)
    if beyond:
        raise PermissionDenied(
            f"You cannot grant project(s) you cannot see yourself: {', '.join(beyond)}.",
            details={"projects": beyond},
        )


def _granted_projects(membership: Membership) -> list[Project] | None:
    """The member's project set: None for every project."""
    if membership.all_projects:
        return None
    return list(
        Project.objects.filter(
            organization=membership.organization,
            user_permissions__user=membership.user,
            user_permissions__permission__codename="view_project",
        ).distinct()
    )


def _is_self(actor: Principal, membership: Membership) -> bool:
    return actor.user is not None and actor.user.pk == membership.user_id


def _check_can_manage(actor: Principal, membership: Membership) -> None:
    """Changing or removing someone else needs a higher rank (owners manage owners) and a
    project set that covers theirs: nobody narrows or locks out who holds more than they do."""
    if actor.kind == PrincipalKind.SYSTEM:
        return
    organization = membership.organization
    if not outranks(actor.role_in(organization), Role(membership.role)):
        raise PermissionDenied(
            f"Your role cannot change or remove a member who is {membership.role}: that needs "
            "a higher role (owners manage owners)."
        )
    limit = Project.objects.limit_of(actor, organization)
    if limit is None:
        return
    theirs = _granted_projects(membership)
    held = set(limit.values_list("pk", flat=True))
    if theirs is None or any(p.pk not in held for p in theirs):
        raise PermissionDenied(
            "This member can see projects that you cannot, so you cannot change or remove "
            "them; ask someone who sees all of their projects."
        )


def _check_not_widening_self(
    membership: Membership, role: Role | None, projects: list[Project] | None, all_projects: bool
) -> None:
    """A person may step down or narrow their own projects, never widen themselves."""
    if role is not None and ROLE_RANK[role] > ROLE_RANK[Role(membership.role)]:
        raise PermissionDenied(
            "You cannot raise your own role; ask someone who holds the role to grant it.",
            details={"role": ["wider than your own"]},
        )
    current = _granted_projects(membership)
    if current is None:
        return
    held = {p.pk for p in current}
    if all_projects or (projects is not None and any(p.pk not in held for p in projects)):
        raise PermissionDenied(
            "You cannot widen your own projects; ask someone who can see them to grant them.",
            details={"projects": ["wider than your own"]},
        )


def _set_project_grants(membership: Membership, projects: list[Project] | None) -> None:
    current = Project.objects.filter(
        user_permissions__user=membership.user,
        organization=membership.organization,
    ).distinct()
    for project in current:
        for perm in PROJECT_PERMISSIONS:
            remove_perm(f"tenancy.{perm}", membership.user, project)
    for project in projects or []:
        _grant_project(membership.user, project)


def _grant_project(user, project: Project) -> None:
    for perm in PROJECT_PERMISSIONS:
        assign_perm(f"tenancy.{perm}", user, project)


@transaction.atomic
def membership_add(
    *, actor: Principal, organization, user, role: Role, projects: list[Project] | None = None
) -> Membership:
    membership = _membership_create(
        actor=actor, organization=organization, user=user, role=role, projects=projects
    )
    _membership_add_audit(actor=actor, membership=membership, projects=projects)
    return membership


def _membership_create(
    *, actor: Principal, organization, user, role: Role, projects: list[Project] | None
) -> Membership:
    _check_can_grant(actor, organization, role, projects)
    try:
        with transaction.atomic():
            membership = Membership.objects.create(
                organization=organization,
                user=user,
                role=role,
                all_projects=projects is None,
            )
    except IntegrityError:
        raise Conflict(f"{user.email} is already a member of this organization.") from None
    _set_project_grants(membership, projects)
    return membership


def _membership_add_audit(
    *, actor: Principal, membership: Membership, projects: list[Project] | None, **extra
) -> None:
    audit_record(
        organization=membership.organization,
        actor=actor,
        action="membership.add",
        target=membership,
        data={
            "user": membership.user.public_id,
            "role": membership.role,
            "projects": [p.public_id for p in projects] if projects is not None else "all",
            **extra,
        },
    )


@dataclass(frozen=True)
class MemberAdded:
    """A new membership, with the person's one-time sign-in link when they had no way in.

    ``sign_in_link_withheld``: they have no way in, but the caller may not hold their link
    (``may_hold_sign_in_link``); someone who may makes one on the console's member page."""

    membership: Membership
    sign_in_link: str | None = None
    sign_in_link_expires_at: datetime | None = None
    sign_in_link_withheld: bool = False


def may_hold_sign_in_link(
    actor: Principal, organization, role: Role, *, every_project: bool
) -> bool:
    """Whether ``actor`` may be handed the sign-in link of a person with ``role`` (seeing
    ``every_project`` of the organization, or only some).

    Whoever holds a link becomes that person, with every scope of their role, approving
    included. So it goes only to the operator on the server, or to a person who already holds
    every one of those scopes here: never to an integration token (a credential that makes its
    holder a person comes only from a person), and never to a person's token narrower than the
    role (such a token would gain, through the new person, what it was made without: POL-5).
    """
    if actor.kind == PrincipalKind.SYSTEM:
        return True
    theirs = role_scopes(role, every_project=every_project)
    return actor.is_person and theirs <= actor.scopes_in(organization)


def _sign_in_link(membership: Membership, base_url: str) -> tuple[str, datetime]:
    """A fresh link for ``membership``'s person under ``base_url``, and until when it works.
    Callers check first that the person may have one and the caller may hold it."""
    return base_url.rstrip("/") + sign_in_link_path(membership.user), sign_in_link_expires_at()


@transaction.atomic
def member_add(
    *,
    actor: Principal,
    organization,
    email: str,
    role: Role,
    name: str = "",
    projects: list[Project] | None = None,
    base_url: str,
) -> MemberAdded:
    """Add a person by email (creating them when new) and give them a way in.

    Someone with no password yet gets a one-time sign-in link under ``base_url``
    (accounts/sign_in_links.py says who qualifies), when the caller may hold it
    (``may_hold_sign_in_link``). The link is returned to be shown once; the one
    ``membership.add`` audit row says until when it works, never the link.
    """
    user, _ = user_get_or_create(email=email, name=name)
    membership = _membership_create(
        actor=actor, organization=organization, user=user, role=role, projects=projects
    )
    no_way_in = sign_in_link_allowed(user, organization)
    if not (
        no_way_in
        and may_hold_sign_in_link(actor, organization, role, every_project=projects is None)
    ):
        _membership_add_audit(actor=actor, membership=membership, projects=projects)
        return MemberAdded(membership, sign_in_link_withheld=no_way_in)
    # Made after the membership exists: the link's token covers the person's memberships.
    link, expires_at = _sign_in_link(membership, base_url)
    _membership_add_audit(
        actor=actor,
        membership=membership,
        projects=projects,
        sign_in_link_expires_at=expires_at.isoformat(),
    )
    return MemberAdded(membership, link, expires_at)


@transaction.atomic
def member_sign_in_link(*, actor: Principal, membership: Membership, base_url: str) -> MemberAdded:
    """A new one-time sign-in link for a member who still has no way in: one whose link was
    withheld from whoever added them, or expired unused.

    The caller must be able to add this member as they are (role and projects) and to hold
    their link. Recorded as ``membership.sign_in_link`` with its expiry, never the link.
    """
    organization = membership.organization
    _check_can_grant(actor, organization, Role(membership.role), _granted_projects(membership))
    if not sign_in_link_allowed(membership.user, organization):
        raise Conflict(
            f"{membership.user.email} already has a way in (a password, another organization "
            "or operator rights), so no sign-in link is made; they sign in as before, or an "
            "operator runs set_password."
        )
    if not may_hold_sign_in_link(
        actor, organization, Role(membership.role), every_project=membership.all_projects
    ):
        raise PermissionDenied(
            "Whoever holds a sign-in link becomes that person, with every scope of their "
            f"role '{membership.role}', and you do not hold all of them here: make the link "
            "signed in to the console as someone who does."
        )
    link, expires_at = _sign_in_link(membership, base_url)
    audit_record(
        organization=organization,
        actor=actor,
        action="membership.sign_in_link",
        target=membership,
        data={"user": membership.user.public_id, "sign_in_link_expires_at": expires_at.isoformat()},
    )
    return MemberAdded(membership, link, expires_at)


def _owners_left_after(membership: Membership) -> int:
    return (
        Membership.objects.filter(organization=membership.organization, role=Role.OWNER)
        .exclude(pk=membership.pk)
        .count()
    )


@transaction.atomic
def membership_update(
    *,
    actor: Principal,
    membership: Membership,
    role: Role | None = None,
    projects: list[Project] | None = None,
    all_projects: bool = False,
) -> Membership:
    organization = membership.organization
    membership = Membership.objects.select_for_update().get(pk=membership.pk)
    changes: dict[str, object] = {}
    if _is_self(actor, membership):
        _check_not_widening_self(membership, role, projects, all_projects)
    else:
        _check_can_manage(actor, membership)
        if role is not None and role != membership.role:
            _check_can_grant(actor, organization, role, [])
        if all_projects or projects is not None:
            _check_can_grant(actor, organization, Role(membership.role), projects)
    if role is not None and role != membership.role:
        if membership.role == Role.OWNER and _owners_left_after(membership) == 0:
            raise Conflict("An organization must keep at least one owner.")
        changes["role"] = {"from": membership.role, "to": role}
        membership.role = role
    if all_projects:
        changes["projects"] = "all"
        membership.all_projects = True
        _set_project_grants(membership, [])
    elif projects is not None:
        changes["projects"] = [p.public_id for p in projects]
        membership.all_projects = False
        _set_project_grants(membership, projects)
    membership.save()
    audit_record(
        organization=organization,
        actor=actor,
        action="membership.update",
        target=membership,
        data=changes,
    )
    return membership


@transaction.atomic
def membership_remove(*, actor: Principal, membership: Membership) -> None:
    organization = membership.organization
    if not _is_self(actor, membership):  # anyone may leave, except the last owner
        _check_can_manage(actor, membership)
    if membership.role == Role.OWNER and _owners_left_after(membership) == 0:
        raise Conflict("An organization must keep at least one owner.")
    _set_project_grants(membership, [])
    # A removed person's tokens in this organization stop working with the membership. The
    # integration tokens they made belong to the organization and keep working: the record
    # names them, since the person saw each secret once (not under a key with "token" in its
    # name, which the audit log's redaction masks).
    membership.user.tokens.filter(organization=organization).delete()
    made = integration_tokens_made_by(user=membership.user, organization=organization)
    audit_record(
        organization=organization,
        actor=actor,
        action="membership.remove",
        target=membership,
        data={
            "user": membership.user.public_id,
            "role": membership.role,
            "integrations_made": [token.public_id for token in made],
        },
    )
    membership.delete()


def _require_name_free(model, organization, name: str, *, exclude=None) -> None:
    """Names are unique per organization (a constraint too); a clash is a 409 naming the field."""
    taken = model.objects.filter(organization=organization, name=name)
    if exclude is not None:
        taken = taken.exclude(pk=exclude.pk)
    if taken.exists():
        raise Conflict(
            f"The name '{name}' is already used by another {model._meta.verbose_name} in this "
            "organization.",
            details={"name": ["taken"]},
        )


def _update(*, actor: Principal, instance, action: str, fields: dict):
    if "name" in fields:
        _require_name_free(type(instance), instance.organization, fields["name"], exclude=instance)
    for key, value in fields.items():
        setattr(instance, key, value)
    instance.save()
    audit_record(
        organization=instance.organization,
        actor=actor,
        action=action,
        target=instance,
        data=fields,
    )
    return instance


@transaction.atomic
def environment_create(
    *, actor: Principal, organization, name: str, description: str = ""
) -> Environment:
    _require_name_free(Environment, organization, name)
    environment = Environment.objects.create(
        organization=organization, name=name, description=description
    )
    audit_record(
        organization=organization,
        actor=actor,
        action="environment.create",
        target=environment,
        data={"name": name},
    )
    return environment


@transaction.atomic
def environment_update(*, actor: Principal, environment: Environment, **fields) -> Environment:
    return _update(actor=actor, instance=environment, action="environment.update", fields=fields)


@transaction.atomic
def environment_delete(*, actor: Principal, environment: Environment) -> None:
    if environment.projects.exists():
        raise Conflict(
            "This environment still has projects; move or delete them first.",
            details={"projects": [p.public_id for p in environment.projects.all()[:20]]},
        )
    audit_record(
        organization=environment.organization,
        actor=actor,
        action="environment.delete",
        target=environment,
        data={"name": environment.name},
    )
    with erasing("policy"):  # its policy versions go with it
        environment.delete()


@transaction.atomic
def project_create(
    *, actor: Principal, organization, environment: Environment, name: str, description: str = ""
) -> Project:
    if environment.organization_id != organization.pk:
        # Callers resolve the environment through the organization; this is the last guard.
        missing = f"no environment {environment.public_id} in this organization"
        raise ValidationFailed(missing, details={"environment": [missing]})
    limit = Project.objects.limit_of(actor, organization)
    if limit is not None and not limit.filter(environment=environment).exists():
        # A project reaches its environment's ceiling, credentials and MCP servers: someone
        # limited to some projects must not reach another environment's by making one there.
        raise PermissionDenied(
            "You are limited to some projects, so you make projects only in the environments "
            f"of those: {environment.public_id} is not one of them.",
            details={"environment": ["not an environment of your projects"]},
        )
    _require_name_free(Project, organization, name)
    project = Project.objects.create(
        organization=organization, environment=environment, name=name, description=description
    )
    # A member limited to some projects is granted the one they make: otherwise its own
    # creator could not see it.
    membership = actor.membership_in(organization)
    granted = membership is not None and not membership.all_projects
    grant: dict[str, str] = {}
    if granted:
        _grant_project(membership.user, project)
        grant = {"granted_to_creator": membership.public_id}
    elif actor.token is not None and actor.token.is_integration and not actor.token.all_projects:
        # An integration token limited to some projects is given the one it makes, the same.
        actor.token.projects.add(project)
        grant = {"granted_to_creator": actor.token.public_id}
    audit_record(
        organization=organization,
        actor=actor,
        action="project.create",
        target=project,
        data={
            "name": name,
            "environment": environment.public_id,
            **grant,
        },
    )
    return project


@transaction.atomic
def project_update(*, actor: Principal, project: Project, **fields) -> Project:
    return _update(actor=actor, instance=project, action="project.update", fields=fields)


@transaction.atomic
def project_delete(*, actor: Principal, project: Project) -> None:
    audit_record(
        organization=project.organization,
        actor=actor,
        action="project.delete",
        target=project,
        data={"name": project.name},
    )
    project_deleting.send(sender=Project, project=project)
    with erasing("policy"):  # its policy versions go with it
        project.delete()
