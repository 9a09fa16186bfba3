"""HTTP endpoints for policies: publish, read, effective policy, explain, tool inventory."""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from kestrel_one.api.base import OrgScopedViewSet, ProjectScopedViewSet
from kestrel_one.api.serializers import StrictSerializer
from kestrel_one.common.errors import NotFound, echo
from kestrel_one.governance import selectors, services
from kestrel_one.governance.judging import call_judge, tool_call_admitted
from kestrel_one.governance.models import SurfacePolicyVersion
from kestrel_one.tenancy.models import Environment, Project
from policies import Mode, render_decision
from runners.contract.registry import TOOLS

READ, PUBLISH = "org:read", "policies:write"
# How many projects an environment's policy answer names as wider than it.
PROJECTS_EXCEEDING_MAX = 100


def version_body(version, *, fallback_document: dict) -> dict:
    if version is None:
        return {
            "version": None,
            "sha256": None,
            "document": fallback_document,
            "created_at": None,
            "created_by": None,
        }
    return {
        "version": version.public_id,
        "sha256": version.sha256,
        "document": version.document,
        "created_at": version.created_at,
        "created_by": version.created_by,
    }


# The body is a policy document (docs/policy.md), parsed by the strict policy parser.
POLICY_DOCUMENT = OpenApiTypes.OBJECT


class EnvironmentPolicyViewSet(OrgScopedViewSet):
    """The environment's ceiling. With no version published, nothing is granted."""

    scope_map = {"GET": READ, "PUT": PUBLISH}
    queryset = Environment.objects.none()
    lookup_url_kwarg = "env"

    def restrict(self, queryset):
        return queryset.select_related("policy_version")

    @extend_schema(responses={200: OpenApiTypes.OBJECT})
    def retrieve(self, request, *args, **kwargs):
        environment = self.get_object()
        body = version_body(environment.policy_version, fallback_document={"capabilities": {}})
        body.update(self._projects_exceeding(environment))
        return Response(body)

    @extend_schema(request=POLICY_DOCUMENT, responses={200: OpenApiTypes.OBJECT})
    def update(self, request, *args, **kwargs):
        environment = self.get_object()
        version = services.policy_publish_environment(
            actor=self.principal, environment=environment, document=request.data
        )
        body = version_body(version, fallback_document={})
        body.update(self._projects_exceeding(environment))
        return Response(body)

    def _projects_exceeding(self, environment) -> dict:
        """The projects the caller may see whose stored policy is now wider than this ceiling
        (they are narrowed anyway: the effective policy always meets the environment), the
        first ``PROJECTS_EXCEEDING_MAX`` by id; ``projects_exceeding_more`` says whether
        there are others (each project's own policy page names its widenings)."""
        exceeding = []
        visible = Project.objects.visible_to(self.principal, self.organization)
        with_policies = (
            visible.filter(environment=environment, policy_version__isnull=False)
            .select_related("policy_version", "environment__policy_version")
            .order_by("public_id")
        )
        for project in with_policies.iterator(chunk_size=200):
            found = selectors.project_exceeds(project)
            if not found:
                continue
            if len(exceeding) == PROJECTS_EXCEEDING_MAX:
                return {"projects_exceeding": exceeding, "projects_exceeding_more": True}
            exceeding.append(
                {
                    "project": project.public_id,
                    "widenings": [{"path": w.path, "message": w.message} for w in found],
                }
            )
        return {"projects_exceeding": exceeding, "projects_exceeding_more": False}


class ProjectPolicyViewSet(ProjectScopedViewSet):
    """The project's own narrowing; without one the project uses its environment's policy."""

    scope_map = {"GET": READ, "PUT": PUBLISH}

    @extend_schema(responses={200: OpenApiTypes.OBJECT})
    def retrieve(self, request, *args, **kwargs):
        project = self.project
        body = version_body(project.policy_version, fallback_document=None)
        body["inherits_environment"] = project.policy_version is None
        body["exceeds_environment"] = [
            {"path": w.path, "message": w.message} for w in selectors.project_exceeds(project)
        ]
        return Response(body)

    @extend_schema(request=POLICY_DOCUMENT, responses={200: OpenApiTypes.OBJECT})
    def update(self, request, *args, **kwargs):
        version = services.policy_publish_project(
            actor=self.principal, project=self.project, document=request.data
        )
        body = version_body(version, fallback_document={})
        body["inherits_environment"] = False
        body["exceeds_environment"] = []
        return Response(body)


class EffectivePolicyViewSet(ProjectScopedViewSet):
    scope_map = {"GET": "projects:read"}

    @extend_schema(
        parameters=[
            OpenApiParameter("mode", str, enum=[mode.value for mode in Mode]),
            OpenApiParameter("surface", str, enum=list(selectors.SURFACES)),
        ],
        responses={200: OpenApiTypes.OBJECT},
    )
    def retrieve(self, request, *args, **kwargs):
        mode = selectors.parse_mode(request.query_params.get("mode"))
        surface = selectors.parse_surface(request.query_params.get("surface"))
        effective = selectors.effective_policy(
            project=self.project, principal=self.principal, mode=mode, surface=surface
        )
        return Response(effective.describe())


class ExplainSerializer(StrictSerializer):
    tool = serializers.CharField(max_length=100)
    args = serializers.JSONField()
    mode = serializers.CharField(max_length=16, required=False)
    # The surface the call would come through (api, console, mcp); api when not given.
    surface = serializers.CharField(max_length=16, required=False)


class ExplainViewSet(ProjectScopedViewSet):
    """Would this call be allowed, and why? Explaining never executes anything."""

    scope_map = {"POST": "projects:read"}

    @extend_schema(request=ExplainSerializer, responses={200: OpenApiTypes.OBJECT})
    def create(self, request, *args, **kwargs):
        data = ExplainSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values = data.validated_data
        mode = selectors.parse_mode(values.get("mode"))
        surface = selectors.parse_surface(values.get("surface"))
        # Admitted as a request would be where the policy request depends on it (mcp.call:
        # the server and the recorded tool's danger), so explain answers what a request meets.
        tool, canonical, policy_request = tool_call_admitted(
            values["tool"],
            values["args"],
            project=self.project,
            user=self.principal.user,
            token=self.principal.token,
            judging_only=True,
        )
        judged = call_judge(
            project=self.project,
            principal=self.principal,
            mode=mode,
            policy_request=policy_request,
            canonical=canonical,
            surface=surface,
        )
        effective, decision = judged.effective, judged.decision
        return Response(
            {
                "tool": tool.name,
                "mode": mode.value,
                "decision": decision.outcome,
                "capability": decision.capability,
                "reasons": list(decision.reasons),
                "limits": dict(decision.limits),
                "policy_version": decision.policy_version,
                "versions": {
                    "environment": effective.environment_version,
                    "project": effective.project_version,
                    "surface": effective.surface_version,
                },
                "surface": effective.surface,
                "surface_policy": effective.surface_term(),
                "explanation": render_decision(decision),
            }
        )


def surface_body(surface: str, version) -> dict:
    """One surface and its current policy; without one (``document`` null) it grants every
    capability."""
    return {
        "name": surface,
        **version_body(version, fallback_document=None),
        "grants_everything": version is None,
    }


def known_surface(value: str) -> str:
    if value not in selectors.SURFACES:
        raise NotFound(
            f"There is no surface {echo(value)!r}; the surfaces are "
            f"{', '.join(selectors.SURFACES)}.",
            details={"surface": list(selectors.SURFACES)},
        )
    return value


class SurfaceListViewSet(OrgScopedViewSet):
    """Every surface of the organization (api, console, mcp) with its current policy."""

    scope_map = {"GET": READ}
    queryset = SurfacePolicyVersion.objects.none()

    @extend_schema(responses={200: OpenApiTypes.OBJECT})
    def list(self, request, *args, **kwargs):
        return Response(
            {
                "surfaces": [
                    surface_body(
                        surface, selectors.surface_version_current(self.organization, surface)
                    )
                    for surface in selectors.SURFACES
                ]
            }
        )


class SurfacePolicyViewSet(OrgScopedViewSet):
    """One surface's policy: a term of every effective policy of a call through it. Publishing
    one is a person's act (``surface_policy_publish``), with the scope that publishes an
    environment's policy."""

    scope_map = {"GET": READ, "PUT": PUBLISH}
    queryset = SurfacePolicyVersion.objects.none()

    @extend_schema(responses={200: OpenApiTypes.OBJECT})
    def retrieve(self, request, *args, **kwargs):
        surface = known_surface(kwargs["surface"])
        return Response(
            surface_body(surface, selectors.surface_version_current(self.organization, surface))
        )

    @extend_schema(request=POLICY_DOCUMENT, responses={200: OpenApiTypes.OBJECT})
    def update(self, request, *args, **kwargs):
        surface = known_surface(kwargs["surface"])
        version = services.surface_policy_publish(
            actor=self.principal,
            organization=self.organization,
            surface=surface,
            document=request.data,
        )
        return Response(surface_body(surface, version))


class ToolInventoryView(APIView):
    """The runtime inventory: every registered tool, the capability it needs, its schema."""

    @extend_schema(responses={200: OpenApiTypes.OBJECT})
    def get(self, request):
        return Response(
            {
                "tools": [
                    {
                        "name": spec.name,
                        "capability": spec.capability,
                        "summary": spec.summary,
                        "idempotent": spec.idempotent,
                        "tier": spec.tier.value,
                        "input_schema": spec.input_schema,
                    }
                    for spec in sorted(TOOLS.values(), key=lambda s: s.name)
                ]
            }
        )
