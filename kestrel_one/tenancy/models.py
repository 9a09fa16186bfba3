"""The tenant tree: Organization > Environment > Project, and who belongs to an organization."""

from __future__ import annotations

from django.conf import settings
from django.core.validators import RegexValidator
from django.db import models
from guardian.models import GroupObjectPermissionBase, UserObjectPermissionBase

from kestrel_one.accounts.principal import PrincipalKind
from kestrel_one.accounts.scopes import Role
from kestrel_one.common.ids import PublicIdField

slug_validator = RegexValidator(
    r"^[a-z0-9](?:[a-z0-9-]{0,48}[a-z0-9])?$",
    "Use 1-50 lowercase letters, digits and inner hyphens.",
)


class OrganizationQuerySet(models.QuerySet):
    def visible_to(self, principal) -> OrganizationQuerySet:
        """Organizations the principal may address at all; anything else is a 404."""
        qs = self
        if principal.token is not None:
            qs = qs.filter(pk=principal.token.organization_id)
        if principal.member_user is not None:
            qs = qs.filter(memberships__user=principal.member_user)
        elif principal.token is None:
            return self.none()
        return qs


class Organization(models.Model):
    """A tenant: every other tenant row hangs off exactly one organization."""

    public_id = PublicIdField("org")
    slug = models.SlugField(max_length=50, unique=True, validators=[slug_validator])
    name = models.CharField(max_length=200)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = OrganizationQuerySet.as_manager()

    def __str__(self) -> str:
        return self.slug


class Membership(models.Model):
    """A person's role in one organization, optionally limited to some projects."""

    ROLE_CHOICES = [(role.value, role.value) for role in Role]

    public_id = PublicIdField("mem")
    organization = models.ForeignKey(
        Organization, on_delete=models.CASCADE, related_name="memberships"
    )
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships"
    )
    role = models.CharField(max_length=16, choices=ROLE_CHOICES)
    # False: the member sees only projects granted through ProjectUserObjectPermission.
    all_projects = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["organization", "user"], name="one_membership_per_org")
        ]

    def __str__(self) -> str:
        return f"{self.user} in {self.organization} as {self.role}"


class Environment(models.Model):
    """A shared execution setting whose policy is the ceiling for its projects."""

    public_id = PublicIdField("env")
    organization = models.ForeignKey(
        Organization, on_delete=models.CASCADE, related_name="environments"
    )
    name = models.CharField(max_length=100)
    description = models.TextField(blank=True, max_length=2000)
    # The ceiling for every project in this environment; none means nothing is granted.
    policy_version = models.ForeignKey(
        "governance.PolicyVersion",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["organization", "name"], name="environment_name_per_org"
            )
        ]
        indexes = [models.Index(fields=["organization", "public_id"])]

    def __str__(self) -> str:
        return self.name


class ProjectQuerySet(models.QuerySet):
    def for_org(self, organization: Organization) -> ProjectQuerySet:
        return self.filter(organization=organization)

    def limit_of(self, principal, organization: Organization) -> ProjectQuerySet | None:
        """None when the principal sees every project of the organization, else the projects
        it is limited to (possibly none).

        A member (and the local agent, through the local owner) follows its membership: all
        projects, or those granted to it by object permission. An integration token follows
        its own explicit set (``ApiToken.all_projects`` / ``projects``). A person's token
        limited to projects (``ApiToken.limited_to_projects``) sees those of the person's.
        Anyone else, a token of another organization included, sees nothing; only an
        operator's command (SYSTEM) sees everything without either. Fail closed.
        """
        qs = self.for_org(organization)
        if principal.kind == PrincipalKind.SYSTEM:
            return None
        token = principal.token
        membership = principal.membership_in(organization)
        if membership is not None:
            limit = None
            if not membership.all_projects:
                limit = qs.filter(
                    pk__in=ProjectUserObjectPermission.objects.filter(
                        user=membership.user, permission__codename="view_project"
                    ).values("content_object_id")
                )
            if token is not None and token.user_id is not None and token.limited_to_projects:
                limit = (qs if limit is None else limit).filter(pk__in=token.projects.values("pk"))
            return limit
        if (
            principal.user is None
            and token is not None
            and token.user_id is None
            and token.organization_id == organization.pk
        ):
            if token.all_projects:
                return None
            return qs.filter(pk__in=token.projects.values("pk"))
        return qs.none()

    def visible_to(self, principal, organization: Organization) -> ProjectQuerySet:
        """Projects of the organization this principal may see (``limit_of``)."""
        limit = self.limit_of(principal, organization)
        return self.for_org(organization) if limit is None else limit


class Project(models.Model):
    """Where work happens: threads, artifacts and workspaces belong to one project."""

    public_id = PublicIdField("prj")
    organization = models.ForeignKey(
        Organization, on_delete=models.CASCADE, related_name="projects"
    )
    # RESTRICT: an environment cannot be deleted under its projects, yet deleting the
    # organization removes both.
    environment = models.ForeignKey(Environment, on_delete=models.RESTRICT, related_name="projects")
    name = models.CharField(max_length=100)
    description = models.TextField(blank=True, max_length=2000)
    # The project's own narrowing of its environment; none means the environment's as is.
    policy_version = models.ForeignKey(
        "governance.PolicyVersion",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = ProjectQuerySet.as_manager()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["organization", "name"], name="project_name_per_org")
        ]
        indexes = [models.Index(fields=["organization", "public_id"])]

    def __str__(self) -> str:
        return self.name

    def save(self, *args, **kwargs):
        # The environment must be the project's own organization's; a service checks this
        # too, but the model refuses to store the crossing whatever the caller.
        if self.environment.organization_id != self.organization_id:
            raise ValueError("a project's environment must belong to the same organization")
        super().save(*args, **kwargs)


class ProjectUserObjectPermission(UserObjectPermissionBase):
    """A grant of one project to one person (guardian, direct foreign key: no orphans)."""

    content_object = models.ForeignKey(
        Project, on_delete=models.CASCADE, related_name="user_permissions"
    )


class ProjectGroupObjectPermission(GroupObjectPermissionBase):
    """A grant of one project to a group (guardian, direct foreign key: no orphans)."""

    content_object = models.ForeignKey(
        Project, on_delete=models.CASCADE, related_name="group_permissions"
    )
