"""The tenant tree and its invariants."""

from __future__ import annotations

import pytest
from django.db.models import RestrictedError
from guardian.shortcuts import assign_perm

from kestrel_one.tenancy.models import (
    Organization,
    Project,
    ProjectUserObjectPermission,
)
from tests.factories import EnvironmentFactory, OrganizationFactory, ProjectFactory, UserFactory

pytestmark = [pytest.mark.django_db, pytest.mark.spec("TEN-2", "TEN-3")]


def test_public_ids_are_prefixed_and_distinct():
    project = ProjectFactory()
    assert project.public_id.startswith("prj_") and len(project.public_id) == 30
    assert project.environment.public_id.startswith("env_")
    assert project.organization.public_id.startswith("org_")
    assert len({ProjectFactory().public_id for _ in range(20)}) == 20


def test_project_environment_must_be_in_the_same_organization():
    foreign = EnvironmentFactory()
    with pytest.raises(ValueError, match="same organization"):
        Project.objects.create(organization=OrganizationFactory(), environment=foreign, name="x")


def test_environment_with_projects_cannot_be_deleted_underneath_them():
    project = ProjectFactory()
    with pytest.raises(RestrictedError):
        project.environment.delete()


def test_project_grants_do_not_outlive_the_project():
    project = ProjectFactory()
    assign_perm("tenancy.view_project", UserFactory(), project)
    assert ProjectUserObjectPermission.objects.count() == 1
    project.delete()
    assert ProjectUserObjectPermission.objects.count() == 0


def test_deleting_an_organization_removes_its_whole_tree():
    project = ProjectFactory()
    assign_perm("tenancy.view_project", UserFactory(), project)
    project.organization.delete()
    assert not Project.objects.exists()
    assert not Organization.objects.exists()
    assert not ProjectUserObjectPermission.objects.exists()
