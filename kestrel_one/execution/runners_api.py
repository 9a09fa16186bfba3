"""HTTP endpoints for an organization's dedicated runners (admins only)."""

from __future__ import annotations

import hashlib

from rest_framework import mixins, serializers
from rest_framework.response import Response

from kestrel_one.api.base import OrgScopedViewSet
from kestrel_one.execution.enrollment import runner_revoke_for_organization, runners_serving
from kestrel_one.execution.models import Runner


class RunnerSerializer(serializers.ModelSerializer):
    id = serializers.CharField(source="public_id", read_only=True)
    key_fingerprint = serializers.SerializerMethodField(
        help_text="SHA-256 of the runner's public key (PEM)."
    )
    sandbox = serializers.CharField(
        read_only=True,
        help_text='The sandbox backend its last heartbeat named: "docker", "bubblewrap", '
        '"none", or "" before the first.',
    )
    shared = serializers.SerializerMethodField(
        help_text="Serves every organization of its pool; revoked by the operator only."
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
            "sandbox",
            "shared",
        ]

    def get_key_fingerprint(self, runner) -> str:
        return hashlib.sha256(runner.public_key.encode()).hexdigest()

    def get_shared(self, runner) -> bool:
        return runner.organization_id is None


class RunnerViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, OrgScopedViewSet):
    """The runners that serve this organization: its own, and the shared ones of the pool its
    calls go to (``shared``: the single-host runner, a platform's runners). A shared runner
    holds nothing of any organization, and its ``last_seen_at`` moves with its heartbeat,
    not with anyone's calls; it is the operator's to revoke (``manage.py runner_revoke``)."""

    dangerously_include_unowned = True

    scope_map = {"GET": "runners:write", "DELETE": "runners:write"}
    queryset = Runner.objects.none()
    serializer_class = RunnerSerializer
    lookup_url_kwarg = "id"
    filterset_fields = {"pool": ["exact"]}

    def restrict(self, queryset):
        return runners_serving(self.organization)

    def destroy(self, request, *args, **kwargs):
        runner = runner_revoke_for_organization(actor=self.principal, runner=self.get_object())
        return Response(RunnerSerializer(runner).data)
