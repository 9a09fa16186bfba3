"""HTTP endpoints for threads and their ordered events."""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, serializers, status
from rest_framework.response import Response

from kestrel_one.api.base import ProjectScopedViewSet
from kestrel_one.api.params import page_limit, whole_number_param
from kestrel_one.api.serializers import RedactedSerializer, StrictSerializer
from kestrel_one.common.redaction import redact
from kestrel_one.threads.models import Thread, ThreadEvent
from kestrel_one.threads.services import thread_create, thread_end
from policies import Mode

MODES = [mode.value for mode in Mode]
EVENTS_PAGE_MAX = 500


class ThreadSerializer(serializers.ModelSerializer):
    id = serializers.CharField(source="public_id", read_only=True)
    project = serializers.CharField(source="project.public_id", read_only=True)
    last_event = serializers.IntegerField(source="last_event_sequence", read_only=True)

    class Meta:
        model = Thread
        fields = [
            "id",
            "project",
            "title",
            "mode",
            "status",
            "ended_at",
            "last_event",
            "created_by",
            "created_at",
        ]
        read_only_fields = ["status", "ended_at"]


class ThreadCreateSerializer(StrictSerializer):
    title = serializers.CharField(max_length=200)
    mode = serializers.ChoiceField(
        choices=MODES,
        default=Mode.ASK.value,
        help_text="ask (default) and plan are read-only; auto resolves each request to ask or "
        "plan; agent executes under policy and approvals.",
    )


class ThreadViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, ProjectScopedViewSet):
    scope_map = {"GET": "projects:read", "POST": "projects:write"}
    queryset = Thread.objects.none()
    serializer_class = ThreadSerializer
    lookup_url_kwarg = "thr"
    filterset_fields = {"mode": ["exact"]}

    def restrict(self, queryset):
        return queryset.filter(project=self.project).select_related("project")

    @extend_schema(request=ThreadCreateSerializer, responses={201: ThreadSerializer})
    def create(self, request, *args, **kwargs):
        data = ThreadCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        thread = thread_create(actor=self.principal, project=self.project, **data.validated_data)
        return Response(ThreadSerializer(thread).data, status=status.HTTP_201_CREATED)


class ThreadEndViewSet(ProjectScopedViewSet):
    """End a thread: no new actions or plans; runners drop its warm sandboxes.

    Needs the scope that creating threads and actions needs. Ending an ended thread answers
    200 with the thread as it is and does nothing else.
    """

    scope_map = {"POST": "projects:write"}
    queryset = Thread.objects.none()
    lookup_url_kwarg = "thr"

    def restrict(self, queryset):
        return queryset.filter(project=self.project).select_related("project")

    @extend_schema(request=None, responses={200: ThreadSerializer})
    def end(self, request, *args, **kwargs):
        thread = thread_end(actor=self.principal, thread=self.get_object())
        return Response(ThreadSerializer(thread).data)


class EventSerializer(RedactedSerializer):
    redacted_fields = {"data": redact}
    action = serializers.CharField(
        source="action.public_id", default=None, read_only=True, allow_null=True
    )

    class Meta:
        model = ThreadEvent
        fields = ["sequence", "kind", "action", "data", "created_at"]


class EventViewSet(ProjectScopedViewSet):
    """The thread's events in order; page with ``?after=SEQ`` (the last sequence you have)."""

    scope_map = {"GET": "projects:read"}
    queryset = ThreadEvent.objects.none()

    def restrict(self, queryset):
        return queryset.filter(thread=self.thread).select_related("action")

    @extend_schema(
        parameters=[
            OpenApiParameter("after", int, description="return events after this sequence"),
            OpenApiParameter("limit", int, description=f"at most this many (≤ {EVENTS_PAGE_MAX})"),
        ],
        responses={200: OpenApiTypes.OBJECT},
    )
    def list(self, request, *args, **kwargs):
        after = whole_number_param(request, "after", 0)
        limit = page_limit(request, default=100, maximum=EVENTS_PAGE_MAX)
        events = list(
            self.get_queryset().filter(sequence__gt=after).order_by("sequence")[: limit + 1]
        )
        more = len(events) > limit
        events = events[:limit]
        return Response(
            {
                "results": EventSerializer(events, many=True).data,
                "next_after": events[-1].sequence if more else None,
                "last_sequence": events[-1].sequence if events else after,
            }
        )
