"""HTTP endpoints for artifacts, checkpoints, share links, replay and retention.

Organization routes use the tenancy base viewsets (project visibility applies: a member
limited to other projects gets the same 404 as for a missing object). The public share
routes authenticate nothing: the token in the path opens its one object and nothing else,
and it is never accepted as a credential anywhere (TEN-6).
"""

from __future__ import annotations

from django.conf import settings
from django.http import FileResponse
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, serializers, status
from rest_framework.exceptions import NotFound
from rest_framework.response import Response
from rest_framework.views import APIView

from kestrel_one.api.base import OrgScopedViewSet, ProjectScopedViewSet
from kestrel_one.api.params import whole_number_param
from kestrel_one.api.permissions import AllowAny
from kestrel_one.api.serializers import StrictSerializer
from kestrel_one.artifacts.models import Artifact, Checkpoint, OrganizationRetention, ShareLink
from kestrel_one.artifacts.retention import RETENTION_FIELDS, retention_update
from kestrel_one.artifacts.selectors import (
    REPLAY_PAGE_DEFAULT,
    REPLAY_PAGE_MAX,
    artifact_projection,
    artifacts_visible_to,
    checkpoint_projection,
    retention_for,
    share_links_visible_to,
    share_resolve,
    thread_replay,
)
from kestrel_one.artifacts.services import (
    share_create,
    share_revoke,
    share_used,
)
from kestrel_one.artifacts.storage import artifact_storage
from kestrel_one.threads.models import Thread

MAX_RETENTION_DAYS = 3650


# --- projections and input ----------------------------------------------------------------


class ArtifactSerializer(serializers.Serializer):
    def to_representation(self, instance):
        return artifact_projection(instance)


class CheckpointSerializer(serializers.Serializer):
    def to_representation(self, instance):
        return checkpoint_projection(instance)


class ShareLinkSerializer(serializers.ModelSerializer):
    id = serializers.CharField(source="public_id", read_only=True)
    artifact = serializers.CharField(
        source="artifact.public_id", default=None, read_only=True, allow_null=True
    )
    thread = serializers.CharField(
        source="thread.public_id", default=None, read_only=True, allow_null=True
    )
    active = serializers.SerializerMethodField()

    class Meta:
        model = ShareLink
        fields = [
            "id",
            "artifact",
            "thread",
            "created_by",
            "created_at",
            "expires_at",
            "revoked_at",
            "revoked_by",
            "active",
            "uses",
            "last_used_at",
        ]

    def get_active(self, link) -> bool:
        return link.revoked_at is None and link.expires_at > timezone.now()


class ShareCreateSerializer(StrictSerializer):
    # The maximum is read once, at start, like every setting, so the schema states it too.
    expires_in = serializers.IntegerField(
        min_value=60,
        max_value=settings.KESTREL_SHARE_MAX_SECONDS,
        required=False,
        help_text="Seconds until the link stops working (at most KESTREL_SHARE_MAX_SECONDS, "
        "30 days by default).",
    )


class RetentionSerializer(StrictSerializer):
    events_days = serializers.IntegerField(min_value=1, max_value=MAX_RETENTION_DAYS)
    artifacts_days = serializers.IntegerField(min_value=1, max_value=MAX_RETENTION_DAYS)
    checkpoints_days = serializers.IntegerField(min_value=1, max_value=MAX_RETENTION_DAYS)
    audit_days = serializers.IntegerField(min_value=1, max_value=MAX_RETENTION_DAYS)


def _share_response(link: ShareLink, token: str):
    body = ShareLinkSerializer(link).data
    body["token"] = token
    body["url"] = f"/api/v1/shared/{token}"
    return Response(body, status=status.HTTP_201_CREATED)


def _share_expiry(request) -> int:
    data = ShareCreateSerializer(data=request.data or {})
    data.is_valid(raise_exception=True)
    return data.validated_data.get("expires_in", settings.KESTREL_SHARE_DEFAULT_SECONDS)


def artifact_download(artifact: Artifact) -> FileResponse:
    """Stream the bytes as an attachment that no browser renders or sniffs."""
    handle = artifact_storage().open(artifact.storage_name, "rb")
    response = FileResponse(
        handle, as_attachment=True, filename=artifact.name, content_type=artifact.content_type
    )
    response["Content-Length"] = str(artifact.size)
    response["X-Content-Type-Options"] = "nosniff"
    response["Content-Security-Policy"] = "sandbox; default-src 'none'; frame-ancestors 'none'"
    response["Cache-Control"] = "private, no-store"
    response["ETag"] = f'"{artifact.sha256}"'
    return response


# --- organization routes ------------------------------------------------------------------


class ArtifactViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, OrgScopedViewSet):
    """Artifacts of the projects the caller may see: metadata, and the content itself."""

    scope_map = {"GET": "projects:read"}
    queryset = Artifact.objects.none()
    serializer_class = ArtifactSerializer
    lookup_url_kwarg = "id"
    filterset_fields = {
        "kind": ["exact"],
        "project__public_id": ["exact"],
        "thread__public_id": ["exact"],
    }

    def restrict(self, queryset):
        return artifacts_visible_to(
            queryset, principal=self.principal, organization=self.organization
        )

    @extend_schema(responses={(200, "application/octet-stream"): OpenApiTypes.BINARY})
    def content(self, request, *args, **kwargs):
        return artifact_download(self.get_object())


class ArtifactShareViewSet(OrgScopedViewSet):
    scope_map = {"POST": "projects:write"}
    queryset = Artifact.objects.none()
    lookup_url_kwarg = "id"

    def restrict(self, queryset):
        return artifacts_visible_to(
            queryset, principal=self.principal, organization=self.organization
        )

    @extend_schema(request=ShareCreateSerializer, responses={201: ShareLinkSerializer})
    def create(self, request, *args, **kwargs):
        expires_in = _share_expiry(request)
        link, token = share_create(
            actor=self.principal, artifact=self.get_object(), expires_in=expires_in
        )
        return _share_response(link, token)


class ThreadShareViewSet(ProjectScopedViewSet):
    """A read-only link to one thread's replay."""

    scope_map = {"POST": "projects:write"}
    queryset = Thread.objects.none()

    @extend_schema(request=ShareCreateSerializer, responses={201: ShareLinkSerializer})
    def create(self, request, *args, **kwargs):
        expires_in = _share_expiry(request)
        link, token = share_create(actor=self.principal, thread=self.thread, expires_in=expires_in)
        return _share_response(link, token)


class ShareLinkViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, OrgScopedViewSet):
    """Share links of visible projects (tokens are never shown again); DELETE revokes one."""

    scope_map = {"GET": "projects:read", "DELETE": "projects:write"}
    queryset = ShareLink.objects.none()
    serializer_class = ShareLinkSerializer
    lookup_url_kwarg = "id"

    def restrict(self, queryset):
        return share_links_visible_to(
            queryset, principal=self.principal, organization=self.organization
        )

    @extend_schema(responses={200: ShareLinkSerializer})
    def destroy(self, request, *args, **kwargs):
        link = share_revoke(actor=self.principal, link=self.get_object())
        return Response(ShareLinkSerializer(link).data)


class ReplayViewSet(ProjectScopedViewSet):
    scope_map = {"GET": "projects:read"}
    queryset = Thread.objects.none()

    @extend_schema(
        parameters=[
            OpenApiParameter("after", int, description="start after this event sequence"),
            OpenApiParameter(
                "limit", int, description=f"at most this many events (≤ {REPLAY_PAGE_MAX})"
            ),
        ],
        responses={200: OpenApiTypes.OBJECT},
    )
    def retrieve(self, request, *args, **kwargs):
        after = whole_number_param(request, "after", 0)
        limit = whole_number_param(request, "limit", REPLAY_PAGE_DEFAULT)  # the replay clamps it
        return Response(thread_replay(thread=self.thread, after=after, limit=limit))


class CheckpointViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, ProjectScopedViewSet):
    scope_map = {"GET": "projects:read"}
    queryset = Checkpoint.objects.none()
    serializer_class = CheckpointSerializer
    lookup_url_kwarg = "chk"

    def restrict(self, queryset):
        return queryset.filter(project=self.project).select_related(
            "artifact", "project", "thread", "action"
        )


class RetentionViewSet(OrgScopedViewSet):
    """How long this organization keeps its records; admins change it, everyone may read."""

    scope_map = {"GET": "org:read", "PUT": "retention:write"}
    queryset = OrganizationRetention.objects.none()

    @extend_schema(responses={200: RetentionSerializer})
    def retrieve(self, request, *args, **kwargs):
        return Response(_retention_body(retention_for(self.organization)))

    @extend_schema(request=RetentionSerializer, responses={200: RetentionSerializer})
    def update(self, request, *args, **kwargs):
        data = RetentionSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        retention = retention_update(
            actor=self.principal, organization=self.organization, values=data.validated_data
        )
        return Response(_retention_body(retention))


def _retention_body(retention: OrganizationRetention) -> dict:
    return {name: getattr(retention, name) for name in RETENTION_FIELDS}


# --- public share routes ------------------------------------------------------------------


class SharedObjectView(APIView):
    """What a share link opens: one artifact's metadata, or one thread's replay.

    No authentication runs here: a credential sent along is ignored, and the token never
    authenticates anything else. Unknown, revoked and expired tokens are the same 404.
    """

    authentication_classes: list = []
    permission_classes = [AllowAny]

    @extend_schema(responses={200: OpenApiTypes.OBJECT}, auth=[])
    def get(self, request, token: str):
        link = share_resolve(token)
        if link is None:
            raise NotFound()
        share_used(link)
        if link.artifact_id is not None:
            body = {
                "kind": "artifact",
                "artifact": artifact_projection(link.artifact, shared=True),
                "content_url": f"/api/v1/shared/{token}/content",
                "expires_at": link.expires_at,
            }
        else:
            after = whole_number_param(request, "after", 0)
            body = {
                "kind": "thread",
                "replay": thread_replay(thread=link.thread, after=after, shared=True),
                "expires_at": link.expires_at,
            }
        return _private(Response(body))


class SharedContentView(APIView):
    authentication_classes: list = []
    permission_classes = [AllowAny]

    @extend_schema(responses={(200, "application/octet-stream"): OpenApiTypes.BINARY}, auth=[])
    def get(self, request, token: str):
        link = share_resolve(token)
        # A thread link opens the replay only, never the thread's artifacts.
        if link is None or link.artifact_id is None:
            raise NotFound()
        share_used(link)
        return _private(artifact_download(link.artifact))


def _private(response):
    response["Cache-Control"] = "private, no-store"
    # The token is in the URL: never hand it on to another site.
    response["Referrer-Policy"] = "no-referrer"
    return response
