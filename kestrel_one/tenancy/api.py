"""HTTP endpoints for organizations, members, environments and projects."""

from __future__ import annotations

from typing import Any

import django_filters
from django.conf import settings
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.response import Response

from kestrel_one.accounts.scopes import Role
from kestrel_one.api.base import OrgScopedViewSet
from kestrel_one.api.serializers import (
    PublicIdRelatedField,
    StrictModelSerializer,
    StrictSerializer,
    named_among,
)
from kestrel_one.tenancy import services
from kestrel_one.tenancy.models import Environment, Membership, Organization, Project
from kestrel_one.tenancy.selectors import MemberProjects, member_projects_seen, memberships_of

READ = "org:read"


def read_and_write(scope: str) -> dict[str, str]:
    """Anyone in the organization reads; changing needs ``scope``."""
    return {"GET": READ, "POST": scope, "PATCH": scope, "DELETE": scope}


class OrganizationSerializer(serializers.ModelSerializer):
    id = serializers.CharField(source="public_id", read_only=True)
    role = serializers.SerializerMethodField()
    scopes = serializers.SerializerMethodField()

    class Meta:
        model = Organization
        fields = ["id", "slug", "name", "created_at", "role", "scopes"]

    def get_role(self, organization) -> str | None:
        # A role is a person's; the local agent and integration tokens act with scopes only.
        principal = self.context["request"].auth
        return principal.role_in(organization) if principal.is_person else None

    def get_scopes(self, organization) -> list[str]:
        return sorted(self.context["request"].auth.scopes_in(organization))


class OrganizationListViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):
    """The organizations this principal belongs to (a token: only its own)."""

    serializer_class = OrganizationSerializer
    pagination_class = None
    queryset = Organization.objects.none()

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return self.queryset
        return Organization.objects.visible_to(self.request.auth).order_by("slug")


class OrganizationViewSet(OrgScopedViewSet):
    scope_map = {"GET": READ}
    serializer_class = OrganizationSerializer
    queryset = Organization.objects.none()

    def retrieve(self, request, *args, **kwargs):
        return Response(self.get_serializer(self.organization).data)


class MemberSerializer(serializers.ModelSerializer):
    """A member as the caller may read them (SURF-1): a limited member's projects are named
    only where the caller sees them too, and the others are only counted. The context's
    ``shown`` holds that reading (``MembershipViewSet.member_context``)."""

    id = serializers.CharField(source="public_id", read_only=True)
    user = serializers.SerializerMethodField()
    projects = serializers.SerializerMethodField(
        help_text="The ids of a limited member's projects that you can see too; null when the "
        "member has every project."
    )
    hidden_projects = serializers.SerializerMethodField(
        help_text="How many of a limited member's projects you cannot see (they are not "
        "named); null when the member has every project."
    )

    class Meta:
        model = Membership
        fields = ["id", "user", "role", "all_projects", "projects", "hidden_projects", "created_at"]

    def get_user(self, membership) -> dict:
        user = membership.user
        return {"id": user.public_id, "email": user.email, "name": user.name}

    def _shown(self, membership) -> MemberProjects:
        return self.context["shown"].get(membership.user_id, MemberProjects(seen=[], unseen=0))

    def get_projects(self, membership) -> list[str] | None:
        if membership.all_projects:
            return None
        return sorted(project.public_id for project in self._shown(membership).seen)

    def get_hidden_projects(self, membership) -> int | None:
        if membership.all_projects:
            return None
        return self._shown(membership).unseen


class MemberAddedSerializer(MemberSerializer):
    sign_in_link = serializers.SerializerMethodField(
        help_text="A one-time link where a person with no password yet chooses one and is "
        "signed in. Shown only in this response; null when the person already has a way in."
    )
    sign_in_link_expires_at = serializers.SerializerMethodField()
    sign_in_link_withheld = serializers.SerializerMethodField(
        help_text="True when the person has no way in yet but this caller may not hold their "
        "link: whoever holds it becomes them, with every scope of their role. Someone who holds "
        "those scopes makes it from the console's member page."
    )

    class Meta(MemberSerializer.Meta):
        fields = [
            *MemberSerializer.Meta.fields,
            "sign_in_link",
            "sign_in_link_expires_at",
            "sign_in_link_withheld",
        ]

    def get_sign_in_link(self, membership) -> str | None:
        return self.context["added"].sign_in_link

    def get_sign_in_link_expires_at(self, membership) -> str | None:
        expires_at = self.context["added"].sign_in_link_expires_at
        return serializers.DateTimeField().to_representation(expires_at) if expires_at else None

    def get_sign_in_link_withheld(self, membership) -> bool:
        return self.context["added"].sign_in_link_withheld


class ProjectIdsField(serializers.ListField):
    child = serializers.CharField(max_length=40)


class MemberCreateSerializer(StrictSerializer):
    email = serializers.EmailField()
    name = serializers.CharField(max_length=200, required=False, allow_blank=True)
    role = serializers.ChoiceField(choices=[r.value for r in Role])
    projects = ProjectIdsField(
        required=False,
        allow_empty=True,
        max_length=500,
        help_text="Limit the member to these projects; omit for all.",
    )


class MemberUpdateSerializer(StrictSerializer):
    role = serializers.ChoiceField(choices=[r.value for r in Role], required=False)
    projects = ProjectIdsField(
        required=False,
        allow_null=True,
        max_length=500,
        help_text="A list limits the member to those projects; null grants all.",
    )


def resolve_projects(principal, organization, ids: list[str]) -> list[Project]:
    """The named projects, looked up among those the caller can see."""
    visible = Project.objects.visible_to(principal, organization)
    return named_among(visible, ids, field="projects", noun="project")


class MembershipViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, OrgScopedViewSet):
    scope_map = read_and_write("members:write")
    queryset = Membership.objects.none()
    serializer_class = MemberSerializer
    lookup_url_kwarg = "id"
    filterset_fields = {"role": ["exact"]}

    def restrict(self, queryset):
        return memberships_of(self.organization)

    def member_context(self, memberships) -> dict[str, Any]:
        """What ``MemberSerializer`` needs to show ``memberships`` to this caller: one read
        for the whole page, not one per member."""
        return {"shown": member_projects_seen(memberships, self.principal, self.organization)}

    def get_serializer(self, *args, **kwargs):
        if args:  # members to show (not the schema's bare serializer): as this caller sees them
            rows = list(args[0]) if kwargs.get("many") else [args[0]]
            kwargs["context"] = {**self.get_serializer_context(), **self.member_context(rows)}
            if kwargs.get("many"):
                args = (rows, *args[1:])
        return super().get_serializer(*args, **kwargs)

    @extend_schema(request=MemberCreateSerializer, responses={201: MemberAddedSerializer})
    def create(self, request, *args, **kwargs):
        data = MemberCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values = data.validated_data
        projects = None
        if "projects" in values:
            projects = resolve_projects(self.principal, self.organization, values["projects"])
        added = services.member_add(
            actor=self.principal,
            organization=self.organization,
            email=values["email"],
            name=values.get("name", ""),
            role=Role(values["role"]),
            projects=projects,
            # The operator's public address when set; else the address this request came to
            # (its host is one ALLOWED_HOSTS accepts).
            base_url=settings.KESTREL_PUBLIC_URL or request.build_absolute_uri("/"),
        )
        body = MemberAddedSerializer(
            added.membership,
            context={"added": added, **self.member_context([added.membership])},
        ).data
        # The link is a credential: no cache keeps it.
        return Response(body, status=status.HTTP_201_CREATED, headers={"Cache-Control": "no-store"})

    @extend_schema(request=MemberUpdateSerializer, responses={200: MemberSerializer})
    def partial_update(self, request, *args, **kwargs):
        membership = self.get_object()
        data = MemberUpdateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values = data.validated_data
        # Absent: unchanged; null: every project; a list (even empty): exactly those.
        limited_to = None
        if values.get("projects") is not None:
            limited_to = resolve_projects(self.principal, self.organization, values["projects"])
        membership = services.membership_update(
            actor=self.principal,
            membership=membership,
            role=Role(values["role"]) if "role" in values else None,
            projects=limited_to,
            all_projects="projects" in values and values["projects"] is None,
        )
        return Response(self.get_serializer(membership).data)

    def destroy(self, request, *args, **kwargs):
        services.membership_remove(actor=self.principal, membership=self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)


class EnvironmentSerializer(StrictModelSerializer):
    id = serializers.CharField(source="public_id", read_only=True)

    class Meta:
        model = Environment
        fields = ["id", "name", "description", "created_at", "updated_at"]
        read_only_fields = ["created_at", "updated_at"]
        # Uniqueness per organization is checked by the service (it knows the organization).
        validators: list = []


class EnvironmentFilter(django_filters.FilterSet):
    name = django_filters.CharFilter(lookup_expr="icontains")

    class Meta:
        model = Environment
        fields = ["name"]


class EnvironmentViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, OrgScopedViewSet):
    scope_map = read_and_write("environments:write")
    queryset = Environment.objects.none()
    serializer_class = EnvironmentSerializer
    lookup_url_kwarg = "env"
    filterset_class = EnvironmentFilter

    def create(self, request, *args, **kwargs):
        data = EnvironmentSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        environment = services.environment_create(
            actor=self.principal, organization=self.organization, **data.validated_data
        )
        return Response(EnvironmentSerializer(environment).data, status=status.HTTP_201_CREATED)

    def partial_update(self, request, *args, **kwargs):
        environment = self.get_object()
        data = EnvironmentSerializer(environment, data=request.data, partial=True)
        data.is_valid(raise_exception=True)
        environment = services.environment_update(
            actor=self.principal, environment=environment, **data.validated_data
        )
        return Response(EnvironmentSerializer(environment).data)

    def destroy(self, request, *args, **kwargs):
        services.environment_delete(actor=self.principal, environment=self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)


class ProjectSerializer(StrictModelSerializer):
    id = serializers.CharField(source="public_id", read_only=True)
    environment = PublicIdRelatedField(
        noun="environment",
        prefix="env",
        queryset=Environment.objects.none(),
        help_text="The environment's id (env_...). Fixed once the project exists.",
    )

    class Meta:
        model = Project
        fields = ["id", "name", "description", "environment", "created_at", "updated_at"]
        read_only_fields = ["created_at", "updated_at"]
        validators: list = []

    def get_fields(self):
        fields = super().get_fields()
        view = self.context.get("view")
        organization = getattr(view, "organization", None)
        # Environments are looked up only inside the caller's organization: a foreign id is
        # "does not exist", exactly like a missing one.
        fields["environment"].queryset = (
            Environment.objects.filter(organization=organization)
            if organization is not None
            else Environment.objects.none()
        )
        if self.instance is not None:
            fields["environment"].read_only = True
        return fields


class ProjectFilter(django_filters.FilterSet):
    name = django_filters.CharFilter(lookup_expr="icontains")
    environment = django_filters.CharFilter(field_name="environment__public_id")

    class Meta:
        model = Project
        fields = ["name", "environment"]


class ProjectViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, OrgScopedViewSet):
    scope_map = read_and_write("projects:manage")
    queryset = Project.objects.none()
    serializer_class = ProjectSerializer
    lookup_url_kwarg = "prj"
    filterset_class = ProjectFilter

    def restrict(self, queryset):
        return Project.objects.visible_to(self.principal, self.organization).select_related(
            "environment"
        )

    def create(self, request, *args, **kwargs):
        data = self.get_serializer(data=request.data)
        data.is_valid(raise_exception=True)
        project = services.project_create(
            actor=self.principal, organization=self.organization, **data.validated_data
        )
        return Response(self.get_serializer(project).data, status=status.HTTP_201_CREATED)

    def partial_update(self, request, *args, **kwargs):
        project = self.get_object()
        data = self.get_serializer(project, data=request.data, partial=True)
        data.is_valid(raise_exception=True)
        project = services.project_update(
            actor=self.principal, project=project, **data.validated_data
        )
        return Response(self.get_serializer(project).data)

    def destroy(self, request, *args, **kwargs):
        services.project_delete(actor=self.principal, project=self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)
