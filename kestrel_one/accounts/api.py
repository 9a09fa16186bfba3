"""HTTP endpoints for API tokens: create (secret shown once), list, revoke."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status
from rest_framework.response import Response

from kestrel_one.accounts.models import ApiToken
from kestrel_one.accounts.scopes import SCOPES
from kestrel_one.accounts.services import token_create, token_revoke
from kestrel_one.api.base import OrgScopedViewSet
from kestrel_one.api.serializers import StrictSerializer


class TokenSerializer(serializers.ModelSerializer):
    id = serializers.CharField(source="public_id", read_only=True)
    prefix = serializers.CharField(source="display_prefix", read_only=True)
    person = serializers.SerializerMethodField()
    integration = serializers.BooleanField(source="is_integration", read_only=True)

    class Meta:
        model = ApiToken
        fields = [
            "id",
            "name",
            "prefix",
            "scopes",
            "person",
            "integration",
            "created_at",
            "expires_at",
            "revoked_at",
            "last_used_at",
        ]

    def get_person(self, token) -> str | None:
        return token.user.email if token.user_id else None


class TokenCreatedSerializer(TokenSerializer):
    token = serializers.SerializerMethodField(help_text="The secret. Shown only in this response.")

    class Meta(TokenSerializer.Meta):
        fields = [*TokenSerializer.Meta.fields, "token"]

    def get_token(self, token) -> str:
        return self.context["plaintext"]


class TokenCreateSerializer(StrictSerializer):
    name = serializers.CharField(max_length=200)
    scopes = serializers.ListField(
        child=serializers.ChoiceField(choices=sorted(SCOPES)), min_length=1, max_length=len(SCOPES)
    )
    integration = serializers.BooleanField(
        default=False, help_text="A token for no person (admins only); it can never approve."
    )
    expires_at = serializers.DateTimeField(required=False)


class TokenViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, OrgScopedViewSet):
    """Anyone in the organization manages their own tokens; admins see and revoke all."""

    # Self-service: a person may create and revoke their own tokens with the scopes they hold.
    scope_map = {"GET": "org:read", "POST": "tokens:write", "DELETE": "tokens:write"}
    queryset = ApiToken.objects.none()
    serializer_class = TokenSerializer
    lookup_url_kwarg = "id"

    def restrict(self, queryset):
        queryset = queryset.select_related("user")
        if "tokens:admin" in self.principal.scopes_in(self.organization):
            return queryset
        if self.principal.user is None:
            return queryset.none()
        return queryset.filter(user=self.principal.user)

    @extend_schema(request=TokenCreateSerializer, responses={201: TokenCreatedSerializer})
    def create(self, request, *args, **kwargs):
        data = TokenCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        token, plaintext = token_create(
            actor=self.principal, organization=self.organization, **data.validated_data
        )
        body = TokenCreatedSerializer(token, context={"plaintext": plaintext}).data
        return Response(body, status=status.HTTP_201_CREATED, headers={"Cache-Control": "no-store"})

    def destroy(self, request, *args, **kwargs):
        token = token_revoke(actor=self.principal, token=self.get_object())
        return Response(TokenSerializer(token).data)
