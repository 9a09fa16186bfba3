"""HTTP endpoints for API tokens: create (secret shown once), list, revoke."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status
from rest_framework.response import Response

from kestrel_one.accounts.models import ApiToken
from kestrel_one.accounts.scopes import SCOPES
from kestrel_one.accounts.selectors import tokens_visible_to
from kestrel_one.accounts.services import token_create, token_revoke
from kestrel_one.api.base import OrgScopedViewSet
from kestrel_one.api.serializers import StrictSerializer, named_among


class TokenSerializer(serializers.ModelSerializer):
    id = serializers.CharField(source="public_id", read_only=True)
    prefix = serializers.CharField(source="display_prefix", read_only=True)
    person = serializers.SerializerMethodField()
    integration = serializers.BooleanField(source="is_integration", read_only=True)
    projects = serializers.SerializerMethodField(
        help_text="The projects the token sees; null: every project for an integration token, "
        "the person's projects for a person's token (one limited to projects lists them)."
    )
    parent = serializers.SerializerMethodField(
        help_text="The token that made this one; null when made from the console or server."
    )
    made_by = serializers.SerializerMethodField(
        help_text="Who made it: their email and whether they are still a member here (an "
        "integration token outlives its maker's membership); null when made on the server."
    )

    class Meta:
        model = ApiToken
        fields = [
            "id",
            "name",
            "prefix",
            "scopes",
            "person",
            "integration",
            "projects",
            "checks",
            "parent",
            "audience",
            "made_by",
            "lineage",
            "created_at",
            "expires_at",
            "revoked_at",
            "last_used_at",
        ]

    def get_person(self, token) -> str | None:
        return token.user.email if token.user_id else None

    def get_projects(self, token) -> list[str] | None:
        if token.is_integration and token.all_projects:
            return None
        if not token.is_integration and not token.limited_to_projects:
            return None
        return sorted(p.public_id for p in token.projects.all())

    def get_parent(self, token) -> str | None:
        return token.parent.public_id if token.parent_id else None

    def get_made_by(self, token) -> dict | None:
        if token.created_by_id is None:
            return None
        member = getattr(token, "made_by_member", None)  # annotated by tokens_visible_to
        if member is None:
            member = token.created_by.memberships.filter(
                organization_id=token.organization_id
            ).exists()
        return {"email": token.created_by.email, "member": member}


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
    expires_at = serializers.DateTimeField(
        required=False,
        help_text="Never after the expiry of the token making it; left out: the default "
        "lifetime, clipped to that expiry.",
    )
    projects = serializers.ListField(
        child=serializers.CharField(max_length=40),
        required=False,
        allow_null=True,
        allow_empty=True,
        max_length=500,
        help_text="Integration tokens: the projects it sees (only ones you see); null: every "
        "project (only if you see all); left out: the projects you see.",
    )
    checks = serializers.ListField(
        child=serializers.RegexField(r"^[a-z0-9][a-z0-9._-]{0,99}$"),
        required=False,
        max_length=20,
        help_text="Integration tokens: the named checks it may record verifications as.",
    )


class TokenViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, OrgScopedViewSet):
    """Anyone in the organization manages their own tokens; admins see and revoke all."""

    # Self-service: a person may create and revoke their own tokens with the scopes they hold.
    scope_map = {"GET": "org:read", "POST": "tokens:write", "DELETE": "tokens:write"}
    queryset = ApiToken.objects.none()
    serializer_class = TokenSerializer
    lookup_url_kwarg = "id"

    def restrict(self, queryset):
        return tokens_visible_to(principal=self.principal, organization=self.organization)

    @extend_schema(request=TokenCreateSerializer, responses={201: TokenCreatedSerializer})
    def create(self, request, *args, **kwargs):
        data = TokenCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values = dict(data.validated_data)
        if values.get("projects") is not None:
            values["projects"] = self._visible_projects(values["projects"])
        token, plaintext = token_create(
            actor=self.principal, organization=self.organization, **values
        )
        body = TokenCreatedSerializer(token, context={"plaintext": plaintext}).data
        return Response(body, status=status.HTTP_201_CREATED, headers={"Cache-Control": "no-store"})

    def _visible_projects(self, ids: list[str]) -> list:
        """The named projects among those the caller sees. Through the organization's
        reverse relation: accounts names no tenancy module."""
        visible = self.organization.projects.visible_to(self.principal, self.organization)
        return named_among(visible, ids, field="projects", noun="project")

    def destroy(self, request, *args, **kwargs):
        token = token_revoke(actor=self.principal, token=self.get_object())
        return Response(TokenSerializer(token).data)
