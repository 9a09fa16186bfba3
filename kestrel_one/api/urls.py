"""The REST API's routes. Every route under ``orgs/<org>/`` uses an OrgScopedViewSet."""

from django.urls import path

from kestrel_one.accounts.api import TokenViewSet
from kestrel_one.adapters.api import AdapterRegistryView
from kestrel_one.api.views import DocsView, HealthView, KeysView, SchemaView
from kestrel_one.artifacts.api import (
    ArtifactShareViewSet,
    ArtifactViewSet,
    CheckpointViewSet,
    ReplayViewSet,
    RetentionViewSet,
    SharedContentView,
    SharedObjectView,
    ShareLinkViewSet,
    ThreadShareViewSet,
)
from kestrel_one.audit.api import AuditHeadViewSet, AuditRecordViewSet
from kestrel_one.credentials.api import ConnectionViewSet, CredentialViewSet
from kestrel_one.execution.api import (
    ActionDecisionViewSet,
    ActionViewSet,
    CheckpointRestoreViewSet,
    PlanAcceptViewSet,
    PlanViewSet,
    ReceiptViewSet,
    VerificationViewSet,
)
from kestrel_one.execution.runners_api import RunnerViewSet
from kestrel_one.gateway.api import BudgetViewSet, ChatCompletionsViewSet, UsageViewSet
from kestrel_one.governance.api import (
    EffectivePolicyViewSet,
    EnvironmentPolicyViewSet,
    ExplainViewSet,
    ProjectPolicyViewSet,
    SurfaceListViewSet,
    SurfacePolicyViewSet,
    ToolInventoryView,
)
from kestrel_one.mcp.api import McpServerViewSet, OrgToolInventoryViewSet
from kestrel_one.mcp_endpoint.api import McpEndpointViewSet
from kestrel_one.tenancy.api import (
    EnvironmentViewSet,
    MembershipViewSet,
    OrganizationListViewSet,
    OrganizationViewSet,
    ProjectViewSet,
)
from kestrel_one.threads.api import EventViewSet, ThreadEndViewSet, ThreadViewSet
from kestrel_one.webhooks.api import WebhookDeliveryViewSet, WebhookEndpointViewSet

LIST = {"get": "list", "post": "create"}
DETAIL = {"get": "retrieve", "patch": "partial_update", "delete": "destroy"}
POLICY = {"get": "retrieve", "put": "update"}

ORG = "orgs/<slug:org>"
WHK = f"{ORG}/webhooks/<str:id>"
THR = f"{ORG}/projects/<str:prj>/threads/<str:thr>"
ACT = f"{THR}/actions/<str:act>"
ART = f"{ORG}/artifacts/<str:id>"
CHK = f"{ORG}/projects/<str:prj>/checkpoints/<str:chk>"
MCP = f"{ORG}/mcp-servers/<str:id>"

urlpatterns = [
    path("health", HealthView.as_view(), name="health"),
    path("schema", SchemaView.as_view(), name="schema"),
    path("docs", DocsView.as_view(url_name="api:schema"), name="docs"),
    path("tools", ToolInventoryView.as_view(), name="tools"),
    path("adapters", AdapterRegistryView.as_view(), name="adapters"),
    path("keys", KeysView.as_view(), name="keys"),
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
    path(f"{ORG}/surfaces", SurfaceListViewSet.as_view({"get": "list"}), name="surface-list"),
    path(
        f"{ORG}/surfaces/<str:surface>/policy",
        SurfacePolicyViewSet.as_view(POLICY),
        name="surface-policy",
    ),
    path(f"{ORG}/audit", AuditRecordViewSet.as_view({"get": "list"}), name="audit-list"),
    path(f"{ORG}/audit/head", AuditHeadViewSet.as_view({"get": "retrieve"}), name="audit-head"),
    path(f"{ORG}/runners", RunnerViewSet.as_view({"get": "list"}), name="runner-list"),
    path(
        f"{ORG}/runners/<str:id>",
        RunnerViewSet.as_view({"get": "retrieve", "delete": "destroy"}),
        name="runner-detail",
    ),
    path(f"{ORG}/projects/<str:prj>/threads", ThreadViewSet.as_view(LIST), name="thread-list"),
    path(THR, ThreadViewSet.as_view({"get": "retrieve"}), name="thread-detail"),
    path(f"{THR}/end", ThreadEndViewSet.as_view({"post": "end"}), name="thread-end"),
    path(f"{THR}/events", EventViewSet.as_view({"get": "list"}), name="thread-events"),
    path(f"{THR}/actions", ActionViewSet.as_view(LIST), name="action-list"),
    path(ACT, ActionViewSet.as_view({"get": "retrieve"}), name="action-detail"),
    path(
        f"{ACT}/approve", ActionDecisionViewSet.as_view({"post": "approve"}), name="action-approve"
    ),
    path(f"{ACT}/deny", ActionDecisionViewSet.as_view({"post": "deny"}), name="action-deny"),
    path(f"{ACT}/receipt", ReceiptViewSet.as_view({"get": "retrieve"}), name="action-receipt"),
    path(f"{ACT}/verifications", VerificationViewSet.as_view(LIST), name="action-verifications"),
    path(f"{THR}/plans", PlanViewSet.as_view(LIST), name="plan-list"),
    path(f"{THR}/plans/<str:plan>", PlanViewSet.as_view({"get": "retrieve"}), name="plan-detail"),
    path(
        f"{THR}/plans/<str:plan>/accept",
        PlanAcceptViewSet.as_view({"post": "accept"}),
        name="plan-accept",
    ),
    path(f"{ORG}/webhooks", WebhookEndpointViewSet.as_view(LIST), name="webhook-list"),
    path(f"{WHK}", WebhookEndpointViewSet.as_view(DETAIL), name="webhook-detail"),
    path(
        f"{WHK}/rotate-secret",
        WebhookEndpointViewSet.as_view({"post": "rotate_secret"}),
        name="webhook-rotate-secret",
    ),
    path(
        f"{WHK}/deliveries",
        WebhookDeliveryViewSet.as_view({"get": "list"}),
        name="webhook-deliveries",
    ),
    path(
        f"{WHK}/deliveries/<str:dlv>/retry",
        WebhookDeliveryViewSet.as_view({"post": "retry"}),
        name="webhook-delivery-retry",
    ),
    # Records (docs/records.md): artifacts, share links, replay, checkpoints, retention.
    path(f"{ORG}/artifacts", ArtifactViewSet.as_view({"get": "list"}), name="artifact-list"),
    path(ART, ArtifactViewSet.as_view({"get": "retrieve"}), name="artifact-detail"),
    path(f"{ART}/content", ArtifactViewSet.as_view({"get": "content"}), name="artifact-content"),
    path(f"{ART}/share", ArtifactShareViewSet.as_view({"post": "create"}), name="artifact-share"),
    path(f"{THR}/share", ThreadShareViewSet.as_view({"post": "create"}), name="thread-share"),
    path(f"{THR}/replay", ReplayViewSet.as_view({"get": "retrieve"}), name="thread-replay"),
    path(f"{ORG}/shares", ShareLinkViewSet.as_view({"get": "list"}), name="share-list"),
    path(
        f"{ORG}/shares/<str:id>",
        ShareLinkViewSet.as_view({"get": "retrieve", "delete": "destroy"}),
        name="share-detail",
    ),
    path(
        f"{ORG}/projects/<str:prj>/checkpoints",
        CheckpointViewSet.as_view({"get": "list"}),
        name="checkpoint-list",
    ),
    path(CHK, CheckpointViewSet.as_view({"get": "retrieve"}), name="checkpoint-detail"),
    path(
        f"{CHK}/restore",
        CheckpointRestoreViewSet.as_view({"post": "restore"}),
        name="checkpoint-restore",
    ),
    path(f"{ORG}/retention", RetentionViewSet.as_view(POLICY), name="retention"),
    # The model gateway (docs/gateway.md).
    path(
        f"{ORG}/projects/<str:prj>/model/v1/chat/completions",
        ChatCompletionsViewSet.as_view({"post": "create"}),
        name="model-chat-completions",
    ),
    path(
        f"{ORG}/projects/<str:prj>/model/budget",
        BudgetViewSet.as_view(POLICY),
        name="model-budget",
    ),
    path(
        f"{ORG}/projects/<str:prj>/model/usage",
        UsageViewSet.as_view({"get": "list"}),
        name="model-usage",
    ),
    # Credentials (docs/credentials.md): write-only secrets, fingerprints in every answer.
    path(f"{ORG}/credentials", CredentialViewSet.as_view(LIST), name="credential-list"),
    path(
        f"{ORG}/credentials/<str:id>",
        CredentialViewSet.as_view({"get": "retrieve", "delete": "destroy"}),
        name="credential-detail",
    ),
    path(
        f"{ORG}/credentials/<str:id>/rotate",
        CredentialViewSet.as_view({"post": "rotate"}),
        name="credential-rotate",
    ),
    path(f"{ORG}/connections", ConnectionViewSet.as_view(LIST), name="connection-list"),
    path(
        f"{ORG}/connections/<str:id>",
        ConnectionViewSet.as_view({"get": "retrieve", "delete": "destroy"}),
        name="connection-detail",
    ),
    # Kestrel One as an MCP server: one governed endpoint per Project (docs/mcp-endpoint.md).
    path(
        f"{ORG}/projects/<str:prj>/mcp",
        McpEndpointViewSet.as_view({"post": "exchange", "get": "stream", "delete": "end"}),
        name="mcp-endpoint",
    ),
    # MCP servers (docs/mcp.md): installed by admins, read by everyone in the organization.
    path(f"{ORG}/mcp-servers", McpServerViewSet.as_view(LIST), name="mcp-server-list"),
    path(MCP, McpServerViewSet.as_view(DETAIL), name="mcp-server-detail"),
    path(
        f"{MCP}/refresh", McpServerViewSet.as_view({"post": "refresh"}), name="mcp-server-refresh"
    ),
    path(f"{MCP}/tools", McpServerViewSet.as_view({"get": "tools"}), name="mcp-tool-list"),
    # A tool's name is the server's text and may hold "/": the client percent-encodes it.
    path(
        f"{MCP}/tools/<path:name>/review",
        McpServerViewSet.as_view({"post": "tool_review"}),
        name="mcp-tool-review",
    ),
    path(
        f"{MCP}/tools/<path:name>/mark",
        McpServerViewSet.as_view({"post": "tool_mark"}),
        name="mcp-tool-mark",
    ),
    path(
        f"{MCP}/risk-acceptances",
        McpServerViewSet.as_view({"get": "risk_list", "post": "risk_create"}),
        name="mcp-risk-list",
    ),
    path(
        f"{MCP}/risk-acceptances/<str:rsk>/withdraw",
        McpServerViewSet.as_view({"post": "risk_withdraw"}),
        name="mcp-risk-withdraw",
    ),
    path(f"{ORG}/tools", OrgToolInventoryViewSet.as_view({"get": "retrieve"}), name="org-tools"),
    # Public: the token in the path opens one object; no credential is read.
    path("shared/<str:token>", SharedObjectView.as_view(), name="shared-object"),
    path("shared/<str:token>/content", SharedContentView.as_view(), name="shared-content"),
]
