"""HTTP endpoints for an organization's webhooks (admins only: reads show where events go)."""

from __future__ import annotations

from datetime import datetime

from django.utils import timezone
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status
from rest_framework.exceptions import NotFound
from rest_framework.response import Response

from kestrel_one.api.base import OrgScopedViewSet
from kestrel_one.api.serializers import StrictSerializer
from kestrel_one.webhooks import services
from kestrel_one.webhooks.events import EVENT_TYPES
from kestrel_one.webhooks.models import WebhookDelivery, WebhookEndpoint
from kestrel_one.webhooks.selectors import deliveries_for_endpoint, webhook_endpoints_of
from kestrel_one.webhooks.services import MAX_ROTATION_OVERLAP_SECONDS

ADMIN = "webhooks:write"
NO_STORE = {"Cache-Control": "no-store"}


class WebhookEndpointSerializer(serializers.ModelSerializer):
    id = serializers.CharField(source="public_id", read_only=True)
    rotation_overlap_until = serializers.SerializerMethodField(
        help_text="Until then the previous secret signs too (a second signature)."
    )

    class Meta:
        model = WebhookEndpoint
        fields = [
            "id",
            "url",
            "description",
            "event_types",
            "enabled",
            "disabled_reason",
            "disabled_at",
            "secret_fingerprint",
            "secret_rotated_at",
            "rotation_overlap_until",
            "failing_since",
            "consecutive_failures",
            "last_success_at",
            "created_at",
            "updated_at",
        ]

    def get_rotation_overlap_until(self, endpoint) -> datetime | None:
        expires = endpoint.previous_secret_expires_at
        return expires if expires and expires > timezone.now() else None


class WebhookEndpointCreatedSerializer(WebhookEndpointSerializer):
    secret = serializers.SerializerMethodField(
        help_text="The signing secret (whsec_...). Shown only in this response."
    )

    class Meta(WebhookEndpointSerializer.Meta):
        fields = [*WebhookEndpointSerializer.Meta.fields, "secret"]

    def get_secret(self, endpoint) -> str:
        return self.context["secret"]


class WebhookEndpointCreateSerializer(StrictSerializer):
    url = serializers.CharField(max_length=2048)
    event_types = serializers.ListField(
        child=serializers.ChoiceField(choices=sorted(EVENT_TYPES)),
        min_length=1,
        max_length=len(EVENT_TYPES),
    )
    description = serializers.CharField(max_length=200, required=False, allow_blank=True)
    enabled = serializers.BooleanField(default=True)


class WebhookEndpointUpdateSerializer(StrictSerializer):
    url = serializers.CharField(max_length=2048, required=False)
    event_types = serializers.ListField(
        child=serializers.ChoiceField(choices=sorted(EVENT_TYPES)),
        min_length=1,
        max_length=len(EVENT_TYPES),
        required=False,
    )
    description = serializers.CharField(max_length=200, required=False, allow_blank=True)
    enabled = serializers.BooleanField(required=False)


class SecretRotateSerializer(StrictSerializer):
    overlap_seconds = serializers.IntegerField(
        min_value=0,
        max_value=MAX_ROTATION_OVERLAP_SECONDS,
        required=False,
        help_text="How long the previous secret keeps signing beside the new one.",
    )


class WebhookEndpointViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, OrgScopedViewSet):
    scope_map = {"GET": ADMIN, "POST": ADMIN, "PATCH": ADMIN, "DELETE": ADMIN}
    queryset = WebhookEndpoint.objects.none()
    serializer_class = WebhookEndpointSerializer
    lookup_url_kwarg = "id"
    filterset_fields = {"enabled": ["exact"]}

    @extend_schema(
        request=WebhookEndpointCreateSerializer, responses={201: WebhookEndpointCreatedSerializer}
    )
    def create(self, request, *args, **kwargs):
        data = WebhookEndpointCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        endpoint, secret = services.webhook_endpoint_create(
            actor=self.principal, organization=self.organization, **data.validated_data
        )
        body = WebhookEndpointCreatedSerializer(endpoint, context={"secret": secret}).data
        return Response(body, status=status.HTTP_201_CREATED, headers=NO_STORE)

    @extend_schema(
        request=WebhookEndpointUpdateSerializer, responses={200: WebhookEndpointSerializer}
    )
    def partial_update(self, request, *args, **kwargs):
        endpoint = self.get_object()
        data = WebhookEndpointUpdateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        endpoint = services.webhook_endpoint_update(
            actor=self.principal, endpoint=endpoint, **data.validated_data
        )
        return Response(WebhookEndpointSerializer(endpoint).data)

    def destroy(self, request, *args, **kwargs):
        services.webhook_endpoint_delete(actor=self.principal, endpoint=self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(
        request=SecretRotateSerializer, responses={200: WebhookEndpointCreatedSerializer}
    )
    def rotate_secret(self, request, *args, **kwargs):
        endpoint = self.get_object()
        data = SecretRotateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        endpoint, secret = services.webhook_secret_rotate(
            actor=self.principal,
            endpoint=endpoint,
            overlap_seconds=data.validated_data.get("overlap_seconds"),
        )
        body = WebhookEndpointCreatedSerializer(endpoint, context={"secret": secret}).data
        return Response(body, headers=NO_STORE)


class WebhookDeliverySerializer(serializers.ModelSerializer):
    id = serializers.CharField(source="public_id", read_only=True)
    webhook_id = serializers.CharField(
        source="message.public_id",
        read_only=True,
        help_text="Sent as the webhook-id header; the same on every attempt.",
    )
    event_type = serializers.CharField(source="message.event_type", read_only=True)

    class Meta:
        model = WebhookDelivery
        fields = [
            "id",
            "webhook_id",
            "event_type",
            "state",
            "attempts",
            "next_attempt_at",
            "last_attempt_at",
            "last_status_code",
            "last_error",
            "delivered_at",
            "created_at",
        ]


class WebhookDeliveryViewSet(mixins.ListModelMixin, OrgScopedViewSet):
    """One endpoint's deliveries, newest last; a finished one can be sent again by hand."""

    scope_map = {"GET": ADMIN, "POST": ADMIN}
    queryset = WebhookDelivery.objects.none()
    serializer_class = WebhookDeliverySerializer
    lookup_url_kwarg = "dlv"
    filterset_fields = {"state": ["exact"]}

    def resolve_parents(self, **kwargs) -> None:
        endpoint = (
            webhook_endpoints_of(self.organization).filter(public_id=kwargs.get("id")).first()
        )
        if endpoint is None:
            raise NotFound()
        self.endpoint = endpoint

    def restrict(self, queryset):
        return deliveries_for_endpoint(endpoint=self.endpoint)

    @extend_schema(request=None, responses={200: WebhookDeliverySerializer})
    def retry(self, request, *args, **kwargs):
        delivery = services.delivery_retry(actor=self.principal, delivery=self.get_object())
        return Response(WebhookDeliverySerializer(delivery).data)
