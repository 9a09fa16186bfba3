"""Endpoints that belong to no tenant: health, the public signing keys and the API schema."""

from __future__ import annotations

from django.db import connection
from drf_spectacular.utils import extend_schema, inline_serializer
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView
from rest_framework import serializers
from rest_framework.authentication import SessionAuthentication
from rest_framework.response import Response
from rest_framework.views import APIView

from kestrel_one.accounts.principal import Principal, PrincipalKind
from kestrel_one.api.authentication import KestrelTokenAuthentication
from kestrel_one.api.permissions import AllowAny, IsPrincipal
from kestrel_one.common.keys import control_jwks
from kestrel_one.execution.heartbeats import execution_health


class HealthView(APIView):
    """Liveness, and whether calls can execute: one of the few routes anyone may call
    without a token (``keys``, the public signing keys, is another).

    The database must answer (else this fails). ``status`` is ``degraded`` when the broker
    does not answer, no runner is up, or no runner has a working sandbox, and ``missing``
    names which; nothing secret, no address and no organization is in the answer.
    """

    authentication_classes: list = []
    permission_classes = [AllowAny]

    @extend_schema(
        responses=inline_serializer(
            "Health",
            {
                "status": serializers.ChoiceField(["ok", "degraded"]),
                "broker": serializers.ChoiceField(["ok", "unreachable"]),
                "runner": serializers.ChoiceField(
                    ["ok", "none"], help_text="whether any runner sent a heartbeat lately"
                ),
                "sandbox": serializers.ChoiceField(
                    ["docker", "bubblewrap", "none"],
                    help_text="the best sandbox backend a runner that is up reported",
                ),
                "missing": serializers.ListField(
                    child=serializers.ChoiceField(["broker", "runner", "sandbox"])
                ),
                "message": serializers.CharField(),
            },
        ),
        auth=[],
    )
    def get(self, request):
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        return Response(execution_health())


class KeysView(APIView):
    """The control plane's public signing keys, as a JWKS; public, so no token is read.

    An auditor fetches these once and keeps them, to check signed audit heads
    (``GET /api/v1/orgs/{org}/audit/head``) without trusting whoever serves the heads later.
    """

    authentication_classes: list = []
    permission_classes = [AllowAny]

    @extend_schema(
        responses=inline_serializer(
            "Keys",
            {
                "keys": serializers.ListField(
                    child=serializers.DictField(),
                    help_text="Ed25519 public keys (kty OKP, crv Ed25519, x, kid, alg, use)",
                )
            },
        ),
        auth=[],
    )
    def get(self, request):
        return Response(control_jwks())


class ConsoleSessionAuthentication(SessionAuthentication):
    """For the schema and its docs page only: a signed-in browser may read the API's shape."""

    def authenticate(self, request):
        result = super().authenticate(request)
        if result is None:
            return None
        user, _ = result
        return user, Principal(PrincipalKind.SESSION, user=user)


SCHEMA_AUTH = [KestrelTokenAuthentication, ConsoleSessionAuthentication]


class SchemaView(SpectacularAPIView):
    authentication_classes = SCHEMA_AUTH
    permission_classes = [IsPrincipal]


class DocsView(SpectacularSwaggerSplitView):
    """Swagger UI whose script is a separate request (``?script``), as the CSP requires."""

    authentication_classes = SCHEMA_AUTH
    permission_classes = [IsPrincipal]
    template_name = "api/swagger_ui.html"
