"""HTTP endpoints for MCP servers (docs/mcp.md, docs/api.md "MCP servers").

Everyone in the organization reads (``org:read``): what is installed, what each tool is and
whether it is dangerous, each risk accepted. Only owners and admins write (``mcp:write``):
install, change, refresh and remove servers, review and mark tools, author egress, accept
and withdraw risks. Bodies are strict (an unknown field is refused, naming it) and every
value is checked by the service, which names the path of each problem.
"""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema, extend_schema_field
from rest_framework import serializers, status
from rest_framework.exceptions import NotFound
from rest_framework.pagination import CursorPagination
from rest_framework.response import Response

from kestrel_one.api.base import OrgScopedViewSet
from kestrel_one.api.pagination import PublicIdCursorPagination
from kestrel_one.api.serializers import PublicIdRelatedField, StrictSerializer
from kestrel_one.mcp import selectors, services
from kestrel_one.mcp.models import McpRiskAcceptance, McpServer
from kestrel_one.tenancy.models import Environment

WRITE = "mcp:write"


class _Value(serializers.JSONField):
    """A JSON value passed as sent to the service, which checks it and names its path (no
    DRF coercion: the string "443" is not a port, 1 is not true)."""


@extend_schema_field(OpenApiTypes.STR)
class _Text(_Value):
    pass


@extend_schema_field(OpenApiTypes.BOOL)
class _Flag(_Value):
    pass


@extend_schema_field(
    {
        "type": "array",
        "maxItems": 64,
        "items": {
            "type": "object",
            "additionalProperties": False,
            "required": ["host", "port", "protocol"],
            "properties": {
                "host": {"type": "string"},
                "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                "protocol": {"enum": ["https", "tcp"]},
            },
        },
    }
)
class _Egress(_Value):
    pass


@extend_schema_field({"type": "array", "items": {"type": "string"}})
class _Command(_Value):
    pass


@extend_schema_field({"type": "object", "additionalProperties": {"type": "number"}})
class _Limits(_Value):
    pass


class McpServerCreateSerializer(StrictSerializer):
    name = _Text(help_text="What policies name it by: unique among the environment's servers.")
    environment = PublicIdRelatedField(
        noun="environment", prefix="env", queryset=Environment.objects.none()
    )
    image = _Text(required=False, help_text="A custom server: REPO@sha256:<64 hex>, never a tag.")
    managed = _Text(required=False, help_text="A managed server: filesystem, git or time.")
    egress = _Egress(required=False, help_text="Exact {host, port, protocol} entries.")
    command = _Command(required=False, help_text="Custom only: the server's argv.")
    workspace = _Text(required=False, help_text="Custom only: none (default), ro or rw.")
    limits = _Limits(required=False, help_text="Any of memory_mb, cpus, pids, tmp_mb.")

    def __init__(self, *args, organization=None, **kwargs):
        super().__init__(*args, **kwargs)
        # Only the caller's organization's environments: another's is "no environment".
        self.fields["environment"].queryset = (
            Environment.objects.filter(organization=organization)
            if organization is not None
            else Environment.objects.none()
        )


class McpServerUpdateSerializer(StrictSerializer):
    name = serializers.CharField(read_only=True)
    environment = serializers.CharField(read_only=True)
    managed = serializers.CharField(read_only=True)
    egress = _Egress(required=False, help_text="Authoring it approves it for the current image.")
    image = _Text(required=False, help_text="Custom only: a new REPO@sha256:<64 hex>.")
    command = _Command(required=False)
    workspace = _Text(required=False)
    limits = _Limits(required=False)


class ToolReviewSerializer(StrictSerializer):
    accept = _Flag(help_text="true adopts the pending definition; false keeps the tool off.")
    sha256 = _Text(
        required=False,
        help_text="The reviewed definition's digest (the tool's pending.sha256); required to "
        "accept, and refused (409) if the server has listed another definition since.",
    )


class ToolMarkSerializer(StrictSerializer):
    dangerous = _Flag(help_text="true marks it dangerous; false removes only that marking.")


class RiskAcceptanceCreateSerializer(StrictSerializer):
    justification = _Text(help_text="Why this server needs unrestricted networking.")
    expires_at = serializers.DateTimeField(
        help_text="In the future, at most KESTREL_MCP_RISK_MAX_DAYS (90) days ahead."
    )


class NewestFirst(PublicIdCursorPagination):
    ordering = "-public_id"


class McpServerViewSet(OrgScopedViewSet):
    """The organization's installed servers and, under each, its tools and risk
    acceptances (always found through the server, itself found through the organization)."""

    scope_map = {"GET": "org:read", "POST": WRITE, "PATCH": WRITE, "DELETE": WRITE}
    queryset = McpServer.objects.none()
    lookup_url_kwarg = "id"

    def restrict(self, queryset):
        return selectors.mcp_servers_of(self.organization)

    def _tool(self, server):
        tool = selectors.tools_of(server).filter(name=self.kwargs.get("name")).first()
        if tool is None:
            raise NotFound()
        return tool

    def _acceptance(self, server) -> McpRiskAcceptance:
        found = (
            selectors.risk_acceptances_of(server).filter(public_id=self.kwargs.get("rsk")).first()
        )
        if found is None:
            raise NotFound()
        return found

    @extend_schema(operation_id="mcp_servers_list", responses={200: OpenApiTypes.OBJECT})
    def list(self, request, *args, **kwargs):
        page = self.paginate_queryset(self.get_queryset())
        return self.get_paginated_response([selectors.server_body(s) for s in page])

    @extend_schema(operation_id="mcp_servers_retrieve", responses={200: OpenApiTypes.OBJECT})
    def retrieve(self, request, *args, **kwargs):
        return Response(selectors.server_body(self.get_object()))

    @extend_schema(
        operation_id="mcp_servers_create",
        request=McpServerCreateSerializer,
        responses={201: OpenApiTypes.OBJECT},
    )
    def create(self, request, *args, **kwargs):
        data = McpServerCreateSerializer(data=request.data, organization=self.organization)
        data.is_valid(raise_exception=True)
        server = services.mcp_server_install(
            actor=self.principal, organization=self.organization, **data.validated_data
        )
        return Response(selectors.server_body(server), status=status.HTTP_201_CREATED)

    @extend_schema(
        operation_id="mcp_servers_update",
        request=McpServerUpdateSerializer,
        responses={200: OpenApiTypes.OBJECT},
    )
    def partial_update(self, request, *args, **kwargs):
        server = self.get_object()
        data = McpServerUpdateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        server = services.mcp_server_update(
            actor=self.principal, server=server, changes=dict(data.validated_data)
        )
        return Response(selectors.server_body(server))

    @extend_schema(operation_id="mcp_servers_remove", request=None, responses={204: None})
    def destroy(self, request, *args, **kwargs):
        services.mcp_server_remove(actor=self.principal, server=self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(
        operation_id="mcp_servers_refresh", request=None, responses={202: OpenApiTypes.OBJECT}
    )
    def refresh(self, request, *args, **kwargs):
        server = services.mcp_server_refresh(actor=self.principal, server=self.get_object())
        return Response(selectors.server_body(server), status=status.HTTP_202_ACCEPTED)

    @extend_schema(operation_id="mcp_tools_list", responses={200: OpenApiTypes.OBJECT})
    def tools(self, request, *args, **kwargs):
        # Bounded by MAX_TOOLS per server: one answer, no pages.
        return Response([selectors.tool_body(t) for t in selectors.tools_of(self.get_object())])

    @extend_schema(
        operation_id="mcp_tools_review",
        request=ToolReviewSerializer,
        responses={200: OpenApiTypes.OBJECT},
    )
    def tool_review(self, request, *args, **kwargs):
        tool = self._tool(self.get_object())
        data = ToolReviewSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        tool = services.mcp_tool_review(
            actor=self.principal,
            tool=tool,
            accept=data.validated_data["accept"],
            sha256=data.validated_data.get("sha256"),
        )
        return Response(selectors.tool_body(tool))

    @extend_schema(
        operation_id="mcp_tools_mark",
        request=ToolMarkSerializer,
        responses={200: OpenApiTypes.OBJECT},
    )
    def tool_mark(self, request, *args, **kwargs):
        tool = self._tool(self.get_object())
        data = ToolMarkSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        tool = services.mcp_tool_mark(
            actor=self.principal, tool=tool, dangerous=data.validated_data["dangerous"]
        )
        return Response(selectors.tool_body(tool))

    @extend_schema(operation_id="mcp_risk_acceptances_list", responses={200: OpenApiTypes.OBJECT})
    def risk_list(self, request, *args, **kwargs):
        server = self.get_object()
        paginator: CursorPagination = NewestFirst()
        page = paginator.paginate_queryset(selectors.risk_acceptances_of(server), request, self)
        body = [selectors.risk_acceptance_body(a) for a in page or []]
        return paginator.get_paginated_response(body)

    @extend_schema(
        operation_id="mcp_risk_acceptances_create",
        request=RiskAcceptanceCreateSerializer,
        responses={201: OpenApiTypes.OBJECT},
    )
    def risk_create(self, request, *args, **kwargs):
        server = self.get_object()
        data = RiskAcceptanceCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        acceptance = services.mcp_risk_accept(
            actor=self.principal, server=server, **data.validated_data
        )
        return Response(selectors.risk_acceptance_body(acceptance), status=status.HTTP_201_CREATED)

    @extend_schema(
        operation_id="mcp_risk_acceptances_withdraw",
        request=None,
        responses={200: OpenApiTypes.OBJECT},
    )
    def risk_withdraw(self, request, *args, **kwargs):
        acceptance = self._acceptance(self.get_object())
        acceptance = services.mcp_risk_withdraw(actor=self.principal, acceptance=acceptance)
        return Response(selectors.risk_acceptance_body(acceptance))


class InventoryPages(PublicIdCursorPagination):
    ordering = "inventory_key"


class OrgToolInventoryViewSet(OrgScopedViewSet):
    """The organization's runtime inventory (POL-7): the registry's tools and every
    installed server's recorded tools, each with the capability it needs. The recorded
    tools come in cursor pages (``?limit=``, then ``next``), the registry's on every page."""

    scope_map = {"GET": "org:read"}
    queryset = McpServer.objects.none()

    @extend_schema(operation_id="org_tools_retrieve", responses={200: OpenApiTypes.OBJECT})
    def retrieve(self, request, *args, **kwargs):
        paginator: CursorPagination = InventoryPages()
        page = paginator.paginate_queryset(
            selectors.inventory_tools_of(self.organization), request, self
        )
        return Response(
            {
                "tools": selectors.registry_inventory(),
                "mcp_tools": [selectors.inventory_tool_body(tool) for tool in page or []],
                "next": paginator.get_next_link(),
                "previous": paginator.get_previous_link(),
            }
        )
