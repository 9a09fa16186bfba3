"""Reads for memberships and projects: who belongs to an organization, and what a person sees."""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

from django.db.models import QuerySet

from kestrel_one.tenancy.models import (
    Membership,
    Organization,
    Project,
    ProjectUserObjectPermission,
)


def memberships_of(organization) -> QuerySet[Membership]:
    """The organization's memberships with their people: the API's member list and the
    console's members page read this (anyone in the organization may)."""
    return Membership.objects.filter(organization=organization).select_related("user")


def member_project_grants(memberships) -> dict[int, list[Project]]:
    """For the limited ones among ``memberships`` (one organization's), the projects each is
    granted, by user id, sorted by name: one query whatever the number of members."""
    limited = [m for m in memberships if not m.all_projects]
    if not limited:
        return {}
    organization_id = limited[0].organization_id
    grants = (
        ProjectUserObjectPermission.objects.filter(
            user_id__in=[m.user_id for m in limited],
            permission__codename="view_project",
            content_object__organization_id=organization_id,
        )
        .select_related("content_object")
        .order_by("content_object__name")
    )
    granted: dict[int, list[Project]] = defaultdict(list)
    for grant in grants:
        if grant.content_object not in granted[grant.user_id]:
            granted[grant.user_id].append(grant.content_object)
    return dict(granted)


class MemberProjects(NamedTuple):
    """A limited member's projects as someone reads them: by name where they see them too,
    sorted by name, and the others only counted."""

    seen: list[Project]
    unseen: int


def member_projects_seen(memberships, principal, organization) -> dict[int, MemberProjects]:
    """For the limited ones among ``memberships``, by user id, the projects each holds as
    ``principal`` may read them (SURF-1: nobody learns of a project they cannot see, not
    even its id); one query for the grants and at most one for what ``principal`` sees."""
    grants = member_project_grants(memberships)
    granted = {project.pk for projects in grants.values() for project in projects}
    limit = Project.objects.limit_of(principal, organization) if granted else None
    seen = (
        granted if limit is None else set(limit.filter(pk__in=granted).values_list("pk", flat=True))
    )
    return {
        user_id: MemberProjects(
            seen=[project for project in projects if project.pk in seen],
            unseen=sum(project.pk not in seen for project in projects),
        )
        for user_id, projects in grants.items()
    }


def organization_addressed(principal, slug) -> Organization | None:
    """The organization ``slug`` names, if ``principal`` may address it at all
    (``Organization.objects.visible_to``); None is answered like a missing organization.

    For a person (or the local agent's owner) it is read with their membership, in one
    query, and the principal keeps that membership for its role and scopes.
    """
    member = principal.member_user
    if member is None:
        return Organization.objects.visible_to(principal).filter(slug=slug).first()
    memberships = Membership.objects.filter(user=member, organization__slug=slug)
    if principal.token is not None:
        memberships = memberships.filter(organization_id=principal.token.organization_id)
    membership = memberships.select_related("organization").first()
    if membership is None:
        return None
    membership.user = member
    principal.membership_known(membership)
    return membership.organization


def project_visible(principal, organization, public_id) -> Project | None:
    """The project ``public_id`` names, if ``principal`` may see it in ``organization``: the
    API's project-scoped endpoints and the console's project pages resolve it so. None is
    answered like a missing project."""
    return (
        Project.objects.visible_to(principal, organization)
        .select_related("environment", "organization")
        .filter(public_id=public_id)
        .first()
    )
