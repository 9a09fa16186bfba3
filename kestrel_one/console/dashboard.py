"""Console: the team dashboard (SURF-1).

The organization's overview, a project's threads, and a thread's timeline (which updates in
place while the person watches), plus an artifact's download and share link. Every object is
read through the selectors and projections the API uses: ``Project.objects.visible_to`` for
projects, a thread only through its project, ``thread_actions`` and the API serializers for
actions, receipts, verifications and plans, ``artifacts_visible_to`` and the artifact
projections for artifacts and checkpoints. Nothing here reads ``sealed_args``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.core.cache import cache
from django.db.models import Count, Q
from django.db.models.functions import TruncDate
from django.http import Http404, HttpResponse
from django.urls import URLPattern, path
from django.utils import timezone

from kestrel_one.artifacts.api import artifact_download
from kestrel_one.artifacts.models import Artifact
from kestrel_one.artifacts.selectors import (
    artifact_projection,
    artifacts_visible_to,
    checkpoint_projection,
)
from kestrel_one.artifacts.services import share_create
from kestrel_one.common.addresses import mcp_endpoint_url, public_origin
from kestrel_one.common.errors import KestrelError
from kestrel_one.console.base import ConsoleView
from kestrel_one.console.paging import page_of
from kestrel_one.execution.api import (
    ActionSerializer,
    PlanSerializer,
    ReceiptSerializer,
    VerificationSerializer,
)
from kestrel_one.execution.models import Action, ActionState, Verification
from kestrel_one.execution.selectors import (
    actions_awaiting_decision,
    plan_step_uses,
    thread_actions,
)
from kestrel_one.mcp_endpoint.selectors import open_sessions
from kestrel_one.tenancy.models import Project
from kestrel_one.tenancy.selectors import project_visible
from kestrel_one.threads.api import EventSerializer
from kestrel_one.threads.models import Thread, ThreadEvent

THREADS_PER_PAGE = 50
# The timeline shows the newest events; older ones page back with ?before=SEQ.
TIMELINE_EVENTS = 50
TIMELINE_PLANS = 20
TIMELINE_ARTIFACTS = 50
OVERVIEW_APPROVALS = 5
OVERVIEW_ACTIVITY = 15
CHART_DAYS = 14
# How often the open timeline asks whether anything happened (seconds).
TIMELINE_POLL_SECONDS = 2
# The chart's outcomes, bottom to top, and which action states count as each.
OUTCOMES = (
    ("succeeded", "Succeeded", Q(state=ActionState.SUCCEEDED)),
    ("failed", "Failed", Q(state=ActionState.FAILED)),
    ("denied", "Denied", Q(state=ActionState.DENIED)),
    ("awaiting", "Awaiting approval", Q(state=ActionState.AWAITING_APPROVAL)),
    (
        "other",
        "Other (queued, running, cancelled, expired)",
        ~Q(
            state__in=[
                ActionState.SUCCEEDED,
                ActionState.FAILED,
                ActionState.DENIED,
                ActionState.AWAITING_APPROVAL,
            ]
        ),
    ),
)
# States in which an action of an ended thread may still change.
IN_FLIGHT = (ActionState.AWAITING_APPROVAL, ActionState.QUEUED, ActionState.RUNNING)
# Event data worth a word in a one-line summary; the whole (redacted) data is one click away.
SUMMARY_KEYS = ("tool", "outcome", "state", "exit_code", "accepted", "title", "mode")
SHARE_CHOICES = ((3600, "1 hour"), (86400, "1 day"), (7 * 86400, "7 days"), (30 * 86400, "30 days"))


def pretty(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, default=str, ensure_ascii=False)


def event_summary(data: Any) -> str:
    if not isinstance(data, dict):
        return ""
    return " · ".join(
        f"{key} {data[key]}" for key in SUMMARY_KEYS if data.get(key) not in (None, "", [])
    )


def event_rows(events) -> list[dict]:
    """Events through the API's projection (redacted again on the way out), with a summary."""
    rows = []
    for event, projected in zip(events, EventSerializer(events, many=True).data, strict=True):
        rows.append(
            {
                **projected,
                "summary": event_summary(projected["data"]),
                "data_pretty": pretty(projected["data"]),
                "thread_obj": event.thread,
                "at": event.created_at,
            }
        )
    return rows


# --- the overview -------------------------------------------------------------------------


@dataclass(frozen=True)
class Bar:
    outcome: str
    label: str
    count: int
    y: float
    height: float


@dataclass(frozen=True)
class Day:
    day: Any
    x: float
    total: int
    counts: dict[str, int]
    bars: tuple[Bar, ...]

    @property
    def count_list(self) -> list[int]:
        return list(self.counts.values())


class Chart:
    """Actions per day by outcome, as the numbers for an SVG drawn by the template."""

    bar_width = 26
    gap = 10
    left = 34
    top = 10
    plot_height = 140

    def __init__(self, rows: dict, *, today) -> None:
        self.first = today - timedelta(days=CHART_DAYS - 1)
        self.outcomes = [(key, label) for key, label, _ in OUTCOMES]
        dates = [self.first + timedelta(days=index) for index in range(CHART_DAYS)]
        self.peak = max([*(sum(rows.get(day, {}).values()) for day in dates), 1])
        self.days: list[Day] = []
        for index, day in enumerate(dates):
            counts = {key: rows.get(day, {}).get(key, 0) for key, _ in self.outcomes}
            bars, base = [], self.top + self.plot_height
            for key, label in self.outcomes:
                height = counts[key] * self.plot_height / self.peak
                if counts[key]:
                    base -= height
                    bars.append(Bar(key, label, counts[key], round(base, 2), round(height, 2)))
            self.days.append(
                Day(
                    day,
                    self.left + index * (self.bar_width + self.gap),
                    sum(counts.values()),
                    counts,
                    tuple(bars),
                )
            )
        self.width = self.left + CHART_DAYS * (self.bar_width + self.gap)
        self.height = self.top + self.plot_height + 24
        self.baseline = self.top + self.plot_height
        self.label_y = self.baseline + 16
        self.total = sum(day.total for day in self.days)
        self.sums = {key: sum(day.counts[key] for day in self.days) for key, _ in self.outcomes}
        self.legend = [(key, label, self.sums[key]) for key, label in self.outcomes]

    @property
    def description(self) -> str:
        parts = ", ".join(f"{self.sums[key]} {label.lower()}" for key, label in self.outcomes)
        return f"{self.total} actions in the last {CHART_DAYS} days: {parts}."


def actions_per_day_cached(*, organization, projects: list, since) -> dict:
    """``actions_per_day`` kept for ``KESTREL_CONSOLE_CHART_SECONDS`` per organization and
    set of visible projects: the aggregate reads every action of the window, so on a busy
    organization it would cost more than the rest of the page; a chart a minute old tells
    the same story. 0 turns the cache off."""
    seconds = settings.KESTREL_CONSOLE_CHART_SECONDS
    if seconds <= 0:
        return actions_per_day(projects=projects, since=since)
    visible = hashlib.sha256(",".join(str(p.pk) for p in projects).encode()).hexdigest()
    key = f"kestrel:console:chart:{organization.pk}:{since.date().isoformat()}:{visible}"
    return cache.get_or_set(
        key, lambda: actions_per_day(projects=projects, since=since), timeout=seconds
    )


def actions_per_day(*, projects, since) -> dict:
    """Day -> outcome -> count of the actions requested in ``projects`` since ``since``:
    one aggregate query, grouped by day in SQL."""
    rows = (
        Action.objects.filter(project__in=projects, created_at__gte=since)
        .annotate(day=TruncDate("created_at", tzinfo=UTC))
        .values("day")
        .annotate(**{key: Count("pk", filter=condition) for key, _, condition in OUTCOMES})
        .order_by("day")
    )
    return {row["day"]: {key: row[key] for key, _, _ in OUTCOMES} for row in rows}


class OverviewView(ConsoleView):
    """``/console/{org}/``: the projects, pending approvals, recent activity and a chart."""

    section = "overview"

    def get(self, request, org: str):
        projects = Project.objects.visible_to(self.principal, self.organization)
        visible = list(projects.order_by("name"))
        context: dict[str, Any] = {"projects": visible}
        if self.can("projects:read"):
            awaiting = actions_awaiting_decision(
                principal=self.principal, organization=self.organization
            ).select_related("thread", "project")
            events = list(
                ThreadEvent.objects.filter(
                    organization=self.organization, thread__project__in=projects
                )
                .select_related("thread__project", "action")
                .order_by("-pk")[:OVERVIEW_ACTIVITY]
            )
            today = timezone.now().astimezone(UTC).date()
            first = today - timedelta(days=CHART_DAYS - 1)
            since = datetime(first.year, first.month, first.day, tzinfo=UTC)
            context.update(
                awaiting=list(awaiting[:OVERVIEW_APPROVALS]),
                activity=event_rows(events),
                chart=Chart(
                    actions_per_day_cached(
                        organization=self.organization,
                        projects=sorted(visible, key=lambda project: project.pk),
                        since=since,
                    ),
                    today=today,
                ),
            )
        return self.page("console/dashboard/overview.html", context)


# --- a project and its threads ------------------------------------------------------------


class ProjectPageMixin:
    """Resolves ``prj`` (and ``thr``) the way the API's ``ProjectScopedViewSet`` does: the
    project through the person's visible projects, the thread only through that project."""

    scope_map = {"GET": "projects:read"}

    def resolve_parents(self, **kwargs: Any) -> None:
        project = project_visible(self.principal, self.organization, kwargs.get("prj"))
        if project is None:
            raise Http404
        self.project = project
        if "thr" in kwargs:
            thread = Thread.objects.filter(public_id=kwargs["thr"], project=project).first()
            if thread is None:
                raise Http404
            thread.project = project
            self.thread = thread


# The project page lists this many of its open MCP sessions, most recently used first.
MCP_SESSIONS_SHOWN = 20


class ProjectView(ProjectPageMixin, ConsoleView):
    """``/console/{org}/projects/{prj}/``: the project's threads, newest first."""

    section = "overview"

    def get(self, request, org: str, prj: str):
        threads = Thread.objects.filter(project=self.project).order_by("-created_at", "-pk")
        page = page_of(threads, request.GET.get("page"), per_page=THREADS_PER_PAGE)
        return self.page(
            "console/dashboard/project.html",
            {
                "project": self.project,
                "threads": page,
                "mcp_url": mcp_endpoint_url(public_origin(request), org, self.project.public_id),
                "mcp_sessions": open_sessions(self.project)[:MCP_SESSIONS_SHOWN],
            },
        )


# --- a thread's timeline ------------------------------------------------------------------


def whole_number(raw: str | None) -> int | None:
    if raw is None or not raw.isdigit() or len(raw) > 18:
        return None
    return int(raw)


class TimelineMixin(ProjectPageMixin):
    def timeline(self, *, before: int | None) -> dict[str, Any]:
        """Everything the timeline shows, in a number of queries that does not grow with it."""
        thread = self.thread
        events_qs = ThreadEvent.objects.filter(thread=thread).select_related("action", "thread")
        if before is not None:
            events_qs = events_qs.filter(sequence__lt=before)
        newest = list(events_qs.order_by("-sequence")[: TIMELINE_EVENTS + 1])
        earlier = len(newest) > TIMELINE_EVENTS
        events = list(reversed(newest[:TIMELINE_EVENTS]))
        # The actions these events tell of, in the order they first appear.
        order: list[int] = []
        for event in events:
            if event.action_id is not None and event.action_id not in order:
                order.append(event.action_id)
        loaded = {action.pk: action for action in thread_actions(thread).filter(pk__in=order)}
        actions = [loaded[pk] for pk in order if pk in loaded]
        # Each kind serialized as one list: a serializer per row would build its fields anew
        # for every row, which is most of the page's time.
        verifications: dict[int, list] = {pk: [] for pk in loaded}
        found = list(
            Verification.objects.filter(action__in=actions)
            .select_related("action")
            .order_by("created_at", "pk")
        )
        for verification, shown in zip(
            found, VerificationSerializer(found, many=True).data, strict=True
        ):
            verifications[verification.action_id].append(shown)
        receipts = [action.receipt for action in actions if hasattr(action, "receipt")]
        receipt_rows = {
            receipt.action_id: shown
            for receipt, shown in zip(
                receipts, ReceiptSerializer(receipts, many=True).data, strict=True
            )
        }
        action_rows = []
        for action, projected in zip(
            actions, ActionSerializer(actions, many=True).data, strict=True
        ):
            decision = projected["decision"] or {}
            action_rows.append(
                {
                    **projected,
                    "outcome": decision.get("outcome"),
                    "reasons": decision.get("reasons") or [],
                    "args_pretty": pretty(projected["args"]),
                    "result_pretty": pretty(projected["result"])
                    if projected["result"] is not None
                    else "",
                    "error_pretty": pretty(projected["error"])
                    if projected["error"] is not None
                    else "",
                    "at": action.created_at,
                    "receipt_row": receipt_rows.get(action.pk),
                    "verifications": verifications[action.pk],
                }
            )
        plans = list(
            thread.plans.select_related("thread", "accepted_by").order_by("-created_at", "-pk")[
                :TIMELINE_PLANS
            ]
        )
        plan_rows = PlanSerializer(
            plans, many=True, context={"step_uses": plan_step_uses(plans)}
        ).data
        for plan in plan_rows:
            for step in plan["steps"]:
                step["args_pretty"] = pretty(step.get("args"))
        artifacts = artifacts_visible_to(
            Artifact.objects.filter(organization=self.organization, thread=thread),
            principal=self.principal,
            organization=self.organization,
        ).order_by("-created_at", "-pk")[:TIMELINE_ARTIFACTS]
        checkpoints = thread.checkpoints.select_related(
            "artifact", "project", "thread", "action"
        ).order_by("-created_at", "-pk")[:TIMELINE_ARTIFACTS]
        last_sequence = events[-1].sequence if events else 0
        # An ended thread whose calls have all settled changes no more: nothing to poll for.
        live = before is None and (
            thread.status == Thread.Status.OPEN
            or thread.actions.filter(state__in=IN_FLIGHT).exists()
        )
        return {
            "project": self.project,
            "thread": thread,
            "events": event_rows(events),
            "earlier": events[0].sequence if earlier and events else None,
            "before": before,
            "live": live,
            "last_sequence": max(last_sequence, thread.last_event_sequence)
            if before is None
            else last_sequence,
            "actions": action_rows,
            "plans": plan_rows,
            "artifacts": [artifact_projection(artifact) for artifact in artifacts],
            "checkpoints": [checkpoint_projection(checkpoint) for checkpoint in checkpoints],
            "can_share": self.can("projects:write"),
            "share_choices": share_choices(),
            "share_default": share_default(),
            "poll_seconds": TIMELINE_POLL_SECONDS,
        }


class ThreadView(TimelineMixin, ConsoleView):
    """``/console/{org}/projects/{prj}/threads/{thr}``: the thread's timeline."""

    section = "overview"

    def get(self, request, org: str, prj: str, thr: str):
        before = whole_number(request.GET.get("before"))
        return self.page("console/dashboard/thread.html", self.timeline(before=before))


class TimelineFragmentView(TimelineMixin, ConsoleView):
    """``.../threads/{thr}/timeline?after=SEQ``: the open timeline's poll. Nothing new since
    ``after`` is a 204, which htmx leaves alone; otherwise the whole live part, again."""

    def get(self, request, org: str, prj: str, thr: str):
        after = whole_number(request.GET.get("after"))
        if after is not None and self.thread.last_event_sequence <= after:
            return HttpResponse(status=204)
        # Opened in the browser itself (not by htmx): the whole page, not a bare fragment.
        template = "timeline.html" if request.htmx else "thread.html"
        return self.page(f"console/dashboard/{template}", self.timeline(before=None))


# --- artifacts ----------------------------------------------------------------------------


def share_choices() -> list[tuple[int, str]]:
    """How long a new share link may work: the choices within KESTREL_SHARE_MAX_SECONDS."""
    most = settings.KESTREL_SHARE_MAX_SECONDS
    return [(seconds, label) for seconds, label in SHARE_CHOICES if seconds <= most]


def share_default() -> int:
    """The choice picked at first: the longest within KESTREL_SHARE_DEFAULT_SECONDS."""
    choices = [seconds for seconds, _ in share_choices()]
    within = [seconds for seconds in choices if seconds <= settings.KESTREL_SHARE_DEFAULT_SECONDS]
    return max(within) if within else min(choices, default=0)


class ArtifactMixin:
    def resolve_parents(self, **kwargs: Any) -> None:
        artifact = (
            artifacts_visible_to(
                Artifact.objects.filter(organization=self.organization),
                principal=self.principal,
                organization=self.organization,
            )
            .filter(public_id=kwargs.get("art"))
            .first()
        )
        if artifact is None:
            raise Http404
        self.artifact = artifact


class ArtifactContentView(ArtifactMixin, ConsoleView):
    """``/console/{org}/artifacts/{art}/content``: the bytes, streamed as an attachment
    (the API's download: nosniff, a sandboxing CSP, no caching)."""

    scope_map = {"GET": "projects:read"}

    def get(self, request, org: str, art: str):
        return artifact_download(self.artifact)


class ArtifactShareView(ArtifactMixin, ConsoleView):
    """``POST /console/{org}/artifacts/{art}/share``: make a share link (a write: members
    yes, viewers no) and show its address, once."""

    scope_map = {"POST": "projects:write"}
    section = "overview"

    def post(self, request, org: str, art: str):
        choices = dict(share_choices())
        seconds = whole_number(request.POST.get("expires_in"))
        context: dict[str, Any] = {"artifact": artifact_projection(self.artifact)}
        thread = self.artifact.thread
        if thread is not None:
            context["back"] = (
                f"/console/{self.organization.slug}/projects/{self.artifact.project.public_id}"
                f"/threads/{thread.public_id}"
            )
        if seconds not in choices:
            return self.page(
                "console/dashboard/share.html",
                {**context, "error": "Choose how long the link should work."},
                status=400,
            )
        try:
            link, token = share_create(
                actor=self.principal, artifact=self.artifact, expires_in=seconds
            )
        except KestrelError as error:
            return self.page(
                "console/dashboard/share.html",
                {**context, "error": str(error)},
                status=getattr(error, "status_code", 400),
            )
        context.update(
            link=link,
            share_url=request.build_absolute_uri(f"/api/v1/shared/{token}"),
            lasts=choices[seconds],
        )
        return self.page("console/dashboard/share.html", context, status=201)


urlpatterns: list[URLPattern] = [
    path("console/<slug:org>/", OverviewView.as_view(), name="console_overview"),
    path("console/<slug:org>/projects/<str:prj>/", ProjectView.as_view(), name="console_project"),
    path(
        "console/<slug:org>/projects/<str:prj>/threads/<str:thr>",
        ThreadView.as_view(),
        name="console_thread",
    ),
    path(
        "console/<slug:org>/projects/<str:prj>/threads/<str:thr>/timeline",
        TimelineFragmentView.as_view(),
        name="console_thread_timeline",
    ),
    path(
        "console/<slug:org>/artifacts/<str:art>/content",
        ArtifactContentView.as_view(),
        name="console_artifact_content",
    ),
    path(
        "console/<slug:org>/artifacts/<str:art>/share",
        ArtifactShareView.as_view(),
        name="console_artifact_share",
    ),
]
