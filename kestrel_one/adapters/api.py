"""``GET /api/v1/adapters``: the static registry of trusted host adapters (API.md)."""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView

from kestrel_one.adapters.selectors import adapters_describe


class AdapterRegistryView(APIView):
    """Every adapter, each operation's exact resource, effect and credential kind."""

    @extend_schema(responses={200: OpenApiTypes.OBJECT})
    def get(self, request):
        return Response({"adapters": adapters_describe()})
