"""HTTP endpoints for credentials (admins) and a person's own App connections (CRED-1, TEN-5).

Secrets are write-only: a request carries one, no response ever does (a fingerprint at most),
and a refusal of a bad secret never repeats it.
"""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema, extend_schema_field
from rest_framework import mixins, serializers, status
from rest_framework.response import Response

from kestrel_one.api.base import OrgScopedViewSet
from kestrel_one.api.serializers import StrictSerializer
from kestrel_one.credentials import services
from kestrel_one.credentials.models import Connection, Credential
from kestrel_one.credentials.selectors import connections_of

NO_STORE = {"Cache-Control": "no-store"}


@extend_schema_field(OpenApiTypes.STR)
class SecretField(serializers.Field):
    """A secret as sent: checked by the service, whose refusals never repeat it. No DRF
    coercion (an integer is not a secret) and no whitespace trimming."""

    def to_internal_value(self, data):
        return services.secret_check(data)

    def to_representation(self, value):  # never called: secrets are write-only
        raise AssertionError("secrets are write-only")


@extend_schema_field(OpenApiTypes.STR)
class AdapterField(serializers.Field):
    def to_internal_value(self, data):
        return services.adapter_check(data)

    def to_representation(self, value):
        return value


class CredentialSerializer(serializers.ModelSerializer):
    id = serializers.CharField(source="public_id", read_only=True)
    state = serializers.CharField(read_only=True)

    class Meta:
        model = Credential
        fields = [
            "id",
            "name",
            "adapter",
            "kind",
            "fingerprint",
            "state",
            "created_by",
            "created_at",
            "rotated_at",
            "revoked_at",
        ]


class CredentialCreateSerializer(StrictSerializer):
    name = serializers.CharField(max_length=100)
    adapter = AdapterField(help_text="An adapter of GET /api/v1/adapters.")
    secret = SecretField(write_only=True, help_text="Write-only; answered with a fingerprint.")


class CredentialRotateSerializer(StrictSerializer):
    secret = SecretField(write_only=True, help_text="The new secret; write-only.")


class CredentialViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, OrgScopedViewSet):
    scope_map = {
        "GET": "credentials:read",
        "POST": "credentials:write",
        "DELETE": "credentials:write",
    }
    queryset = Credential.objects.none()
    serializer_class = CredentialSerializer
    lookup_url_kwarg = "id"
    filterset_fields = {"adapter": ["exact"]}

    @extend_schema(request=CredentialCreateSerializer, responses={201: CredentialSerializer})
    def create(self, request, *args, **kwargs):
        data = CredentialCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        credential = services.credential_create(
            actor=self.principal, organization=self.organization, **data.validated_data
        )
        body = CredentialSerializer(credential).data
        return Response(body, status=status.HTTP_201_CREATED, headers=NO_STORE)

    @extend_schema(request=CredentialRotateSerializer, responses={200: CredentialSerializer})
    def rotate(self, request, *args, **kwargs):
        credential = self.get_object()
        data = CredentialRotateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        credential = services.credential_rotate(
            actor=self.principal, credential=credential, secret=data.validated_data["secret"]
        )
        return Response(CredentialSerializer(credential).data, headers=NO_STORE)

    def destroy(self, request, *args, **kwargs):
        services.credential_revoke(actor=self.principal, credential=self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)


class ConnectionSerializer(serializers.ModelSerializer):
    id = serializers.CharField(source="public_id", read_only=True)
    state = serializers.CharField(read_only=True)

    class Meta:
        model = Connection
        fields = [
            "id",
            "adapter",
            "kind",
            "fingerprint",
            "state",
            "revoked_reason",
            "created_at",
            "revoked_at",
        ]


class ConnectionCreateSerializer(StrictSerializer):
    adapter = AdapterField(help_text="An adapter of GET /api/v1/adapters.")
    secret = SecretField(write_only=True, help_text="Write-only; answered with a fingerprint.")


class ConnectionViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, OrgScopedViewSet):
    """The caller's own connections only: another person's is the same 404 as a missing one,
    whatever the caller's role (TEN-5). There is no update: a connection is never rebound to
    another person or adapter."""

    scope_map = {
        "GET": "connections:write",
        "POST": "connections:write",
        "DELETE": "connections:write",
    }
    queryset = Connection.objects.none()
    serializer_class = ConnectionSerializer
    lookup_url_kwarg = "id"

    def restrict(self, queryset):
        return connections_of(self.principal, self.organization)

    @extend_schema(request=ConnectionCreateSerializer, responses={201: ConnectionSerializer})
    def create(self, request, *args, **kwargs):
        data = ConnectionCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        connection = services.connection_create(
            actor=self.principal, organization=self.organization, **data.validated_data
        )
        body = ConnectionSerializer(connection).data
        return Response(body, status=status.HTTP_201_CREATED, headers=NO_STORE)

    def destroy(self, request, *args, **kwargs):
        services.connection_revoke(actor=self.principal, connection=self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)
