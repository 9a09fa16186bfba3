"""The REST API's routes. Every route under ``orgs/<org>/`` uses an OrgScopedViewSet."""

from django.urls import path

from kestrel_one.accounts.api import TokenViewSet
from kestrel_one.api.views import DocsView, HealthView, SchemaView
from kestrel_one.execution.api import RunnerViewSet
from kestrel_one.governance.api import (
    EffectivePolicyViewSet,
    EnvironmentPolicyViewSet,
    ExplainViewSet,
    ProjectPolicyViewSet,
    ToolInventoryView,
)
from kestrel_one.tenancy.api import (
    EnvironmentViewSet,
    MembershipViewSet,
    OrganizationListViewSet,
    OrganizationViewSet,
    ProjectViewSet,
)

LIST = {"get": "list", "post": "create"}
DETAIL = {"get": "retrieve", "patch": "partial_update", "delete": "destroy"}
POLICY = {"get": "retrieve", "put": "update"}

ORG = "orgs/<slug:org>"

urlpatterns = [
    path("health", HealthView.as_view(), name="health"),
    path("schema", SchemaView.as_view(), name="schema"),
    path("docs", DocsView.as_view(url_name="api:schema"), name="docs"),
    path("tools", ToolInventoryView.as_view(), name="tools"),
    path("orgs", OrganizationListViewSet.as_view({"get": "list"}), name="org-list"),
    path(ORG, OrganizationViewSet.as_view({"get": "retrieve"}), name="org-detail"),
    path(f"{ORG}/members", MembershipViewSet.as_view(LIST), name="member-list"),
    path(f"{ORG}/members/<str:id>", MembershipViewSet.as_view(DETAIL), name="member-detail"),
    path(f"{ORG}/tokens", TokenViewSet.as_view(LIST), name="token-list"),
    path(
        f"{ORG}/tokens/<str:id>",
        TokenViewSet.as_view({"get": "retrieve", "delete": "destroy"}),
        name="token-detail",
    ),
    path(f"{ORG}/environments", EnvironmentViewSet.as_view(LIST), name="environment-list"),
    path(
        f"{ORG}/environments/<str:env>",
        EnvironmentViewSet.as_view(DETAIL),
        name="environment-detail",
    ),
    path(f"{ORG}/projects", ProjectViewSet.as_view(LIST), name="project-list"),
    path(f"{ORG}/projects/<str:prj>", ProjectViewSet.as_view(DETAIL), name="project-detail"),
    path(
        f"{ORG}/environments/<str:env>/policy",
        EnvironmentPolicyViewSet.as_view(POLICY),
        name="environment-policy",
    ),
    path(
        f"{ORG}/projects/<str:prj>/policy",
        ProjectPolicyViewSet.as_view(POLICY),
        name="project-policy",
    ),
    path(
        f"{ORG}/projects/<str:prj>/effective-policy",
        EffectivePolicyViewSet.as_view({"get": "retrieve"}),
        name="project-effective-policy",
    ),
    path(
        f"{ORG}/projects/<str:prj>/explain",
        ExplainViewSet.as_view({"post": "create"}),
        name="project-explain",
    ),
    path(f"{ORG}/runners", RunnerViewSet.as_view({"get": "list"}), name="runner-list"),
    path(
        f"{ORG}/runners/<str:id>",
        RunnerViewSet.as_view({"get": "retrieve", "delete": "destroy"}),
        name="runner-detail",
    ),
]
