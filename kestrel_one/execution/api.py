"""HTTP endpoints for an organization's dedicated runners (admins only)."""

from __future__ import annotations

import hashlib

from rest_framework import mixins, serializers
from rest_framework.response import Response

from kestrel_one.api.base import OrgScopedViewSet
from kestrel_one.execution.enrollment import runner_revoke
from kestrel_one.execution.models import Runner


class RunnerSerializer(serializers.ModelSerializer):
    id = serializers.CharField(source="public_id", read_only=True)
    key_fingerprint = serializers.SerializerMethodField(
        help_text="SHA-256 of the runner's public key (PEM)."
    )

    class Meta:
        model = Runner
        fields = [
            "id",
            "pool",
            "name",
            "key_fingerprint",
            "enrolled_at",
            "revoked_at",
            "last_seen_at",
        ]

    def get_key_fingerprint(self, runner) -> str:
        return hashlib.sha256(runner.public_key.encode()).hexdigest()


class RunnerViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, OrgScopedViewSet):
    """Runners dedicated to this organization. Platform runners are the operator's
    (``python manage.py runner_revoke``) and never appear here."""

    scope_map = {"GET": "runners:write", "DELETE": "runners:write"}
    queryset = Runner.objects.none()
    serializer_class = RunnerSerializer
    lookup_url_kwarg = "id"
    filterset_fields = {"pool": ["exact"]}

    def destroy(self, request, *args, **kwargs):
        runner = runner_revoke(actor=self.principal, runner=self.get_object())
        return Response(RunnerSerializer(runner).data)
