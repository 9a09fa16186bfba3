"""Console: the approvals pages (SURF-3).

The inbox lists what the signed-in person could decide now (``execution.selectors``, the
same rules ``approvals.approval_decide`` and ``plans.plan_accept`` enforce). An action page
shows exactly what a decision binds: tool, the redacted canonical arguments (the API's
``ActionSerializer`` projection, never the sealed ones), the digest, the policy version and
the scope. Its approve and deny forms post back what the person saw; if any of it differs
from the action as it is now, nothing is decided and the page says what changed. Values the
redaction hid (the serializer's ``hidden_args``) are listed, and approving a call or
accepting a plan with any of them needs a tick saying the person approves values they cannot
read. Decisions go through the same services as the API's, with the session as the actor.
"""

from __future__ import annotations

import json
from typing import Any

from django.contrib import messages
from django.http import Http404, HttpResponse, HttpResponseRedirect
from django.urls import path
from django.utils import timezone

from kestrel_one.common.errors import KestrelError
from kestrel_one.common.redaction import hidden_paths
from kestrel_one.console.base import ConsoleView
from kestrel_one.console.paging import page_of
from kestrel_one.execution.api import ActionSerializer, PlanSerializer, ReceiptSerializer
from kestrel_one.execution.approvals import approval_decide
from kestrel_one.execution.models import TERMINAL_STATES, ActionState, Receipt
from kestrel_one.execution.plans import plan_accept
from kestrel_one.execution.selectors import (
    actions_awaiting_decision,
    actions_visible_to,
    plans_awaiting_acceptance,
    plans_visible_to,
)
from kestrel_one.execution.services import action_scope
from runners.contract.canonical import digest

PAGE_SIZE = 50
# The inbox counts and pages through the newest 200 waiting ("200+" past that): the count
# runs on every view, and a person decides the newest first; older ones expire.
INBOX_LIMIT = 200
# What a row of the inbox shows (the template and ``action_requester``), and nothing more:
# an action row's JSON (arguments, decision, limits, result) and its datetimes cost more
# to decode than the row costs to render, on every row of every view.
INBOX_ROW_FIELDS = (
    "public_id",
    "tool",
    "flags",
    "created_at",
    "requested_by",
    "project__public_id",
    "project__name",
    "thread__public_id",
    "thread__title",
    "requested_by_token__public_id",
    "requested_by_token__name",
    "requested_by_token__user__email",
    "requested_by_user__email",
)
# What an action's approval binds, in the order a change is reported, with how to name it.
BOUND_FIELDS = (
    ("tool", "the tool"),
    ("args_digest", "the arguments (their digest)"),
    ("policy_version", "the policy version"),
    ("scope", "where it runs (organization, environment, project, thread)"),
)
SCOPE_KEYS = ("org", "env", "prj", "thr")


def pretty(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)


def requester(*, token, user, recorded: str) -> str:
    """Who asked, in words: a person's token, an integration token, a person, or the local
    agent (``recorded`` is the actor id the row keeps)."""
    if token is not None:
        if token.user_id is not None:
            return f"{token.user.email}, through their token “{token.name}” ({token.public_id})"
        return f"integration token “{token.name}” ({token.public_id})"
    if user is not None:
        return user.email
    return "the local agent" if recorded == "local-agent" else recorded


def action_requester(action) -> str:
    return requester(
        token=action.requested_by_token, user=action.requested_by_user, recorded=action.requested_by
    )


def decision_binding(action) -> dict[str, str]:
    """What the page shows and the forms post back: the digest and what it is made of."""
    scope = action_scope(action)
    return {
        "digest": action.action_digest,
        "tool": action.tool,
        "args_digest": action.args_digest,
        "policy_version": action.policy_version,
        "scope": "/".join(scope[key] or "" for key in SCOPE_KEYS),
    }


def _short(value: str) -> str:
    return value if len(value) <= 80 else value[:77] + "..."


def binding_changes(action, posted) -> list[str]:
    """What differs between what the person saw (``posted``) and the action now; empty when
    they saw exactly this action. The digest is required; the parts, when posted, name what
    changed."""
    current = decision_binding(action)
    seen_digest = posted.get("digest", "")
    if not seen_digest:
        return ["the form did not say which action digest you saw"]
    changes = [
        f"{label}: you saw {_short(posted[field])}, it is now {_short(current[field])}"
        for field, label in BOUND_FIELDS
        if field in posted and posted[field] != current[field]
    ]
    if seen_digest != current["digest"] and not changes:
        changes.append(
            f"the action digest: you saw {_short(seen_digest)}, it is now {current['digest']}"
        )
    return changes


# What a person ticks to approve values they were shown only masked.
HIDDEN_ACKNOWLEDGED = "approve_hidden"


def hidden_unacknowledged(hidden: list[str], posted, *, verb: str) -> str:
    """Why nothing was decided when ``hidden`` values were not acknowledged, or ''.

    Redaction hides secret-like values from everyone, the approver included, yet the call
    runs with the real ones (the digest binds them): a long random-looking string may as
    well be a payload as a key. So approving such a call says so on purpose."""
    if not hidden or posted.get(HIDDEN_ACKNOWLEDGED) == "yes":
        return ""
    return (
        f"Nothing was {verb}: {len(hidden)} value(s) are hidden from you because they look "
        f"like secrets ({', '.join(_short(path) for path in hidden[:10])}), and they run as "
        "they are. Tick the box to say you approve values you cannot read, or deny."
    )


def _action_queryset(view: ConsoleView):
    return actions_visible_to(
        principal=view.principal, organization=view.organization
    ).select_related(
        "organization",
        "environment",
        "project",
        "thread",
        "plan",
        "receipt",
        "approval__decided_by",
        "requested_by_token__user",
        "requested_by_user",
    )


def inbox_row(organization, action) -> dict[str, str]:
    """What one row of the inbox shows, as text, made here rather than in the template: each
    lookup and ``date`` filter a template makes costs more than the row's SQL, so a row's
    cost is kept to a few string operations (the page's time grows with its rows, not with
    the history)."""
    created = timezone.localtime(action.created_at)
    where = f"/console/{organization.slug}/projects/{action.project.public_id}"
    return {
        "public_id": action.public_id,
        "tool": action.tool,
        "flags": ", ".join(action.flags or ()),
        "thread_url": f"{where}/threads/{action.thread.public_id}",
        "where": f"{action.project.name} / {action.thread.title or action.thread.public_id}",
        "who": action_requester(action),
        "when_iso": created.isoformat(),
        "when": created.strftime("%Y-%m-%d %H:%M"),
    }


class InboxView(ConsoleView):
    """``/console/{org}/approvals``: actions awaiting this person's decision, newest first,
    and the plans awaiting their acceptance."""

    section = "approvals"

    def get(self, request, org: str):
        actions = (
            actions_awaiting_decision(principal=self.principal, organization=self.organization)
            .select_related("project", "thread", "requested_by_token__user", "requested_by_user")
            .only(*INBOX_ROW_FIELDS)
        )
        plans = plans_awaiting_acceptance(
            principal=self.principal, organization=self.organization
        ).select_related("thread__project", "proposed_by_token__user")
        action_page = page_of(
            actions, request.GET.get("page"), per_page=PAGE_SIZE, limit=INBOX_LIMIT
        )
        plan_page = page_of(
            plans, request.GET.get("plans_page"), per_page=PAGE_SIZE, limit=INBOX_LIMIT
        )
        return self.page(
            "console/approvals/inbox.html",
            {
                "action_page": action_page,
                "action_rows": [inbox_row(self.organization, a) for a in action_page],
                "plan_page": plan_page,
                "plan_rows": [
                    (
                        p,
                        requester(token=p.proposed_by_token, user=None, recorded=p.proposed_by),
                    )
                    for p in plan_page
                ],
                "may_approve": self.can("actions:approve"),
            },
        )


class ActionPage(ConsoleView):
    """The action named in the URL, in a project the person may see (else a 404)."""

    def resolve_parents(self, **kwargs: Any) -> None:
        action = _action_queryset(self).filter(public_id=kwargs.get("act")).first()
        if action is None:
            raise Http404
        self.action = action

    def action_context(self, *, error: str = "", error_status: int = 0) -> dict[str, Any]:
        action = self.action
        shown = ActionSerializer(action).data
        try:
            receipt = ReceiptSerializer(action.receipt).data
        except Receipt.DoesNotExist:
            receipt = None
        return {
            "action": action,
            "shown": shown,
            "args_json": pretty(shown["args"]),
            "hidden": shown["hidden_args"],
            "reasons": (shown.get("decision") or {}).get("reasons") or [],
            "decision_json": pretty(shown["decision"]),
            "result_json": pretty(shown["result"]) if shown["result"] is not None else "",
            "error_json": pretty(shown["error"]) if shown["error"] is not None else "",
            "receipt": receipt,
            "receipt_json": pretty(receipt) if receipt else "",
            "binding": decision_binding(action),
            "requester": action_requester(action),
            "awaiting": action.state == ActionState.AWAITING_APPROVAL,
            "settled": action.state in TERMINAL_STATES,
            "may_decide": self.can("actions:approve")
            and action.state == ActionState.AWAITING_APPROVAL,
            "error": error,
            "error_status": error_status,
        }


class ActionView(ActionPage):
    """``/console/{org}/actions/{act}``: exactly what a decision on this action binds, and
    where it stands. While it is queued or running, its status part polls (htmx)."""

    section = "approvals"
    scope_map = {"GET": "projects:read"}

    def get(self, request, org: str, act: str):
        context = self.action_context()
        if request.headers.get("HX-Request") == "true":
            return self.drawn(
                "console/approvals/_action_status.html",
                {**context, "organization": self.organization},
            )
        return self.page("console/approvals/action.html", context)


class ActionDecisionView(ActionPage):
    """``POST /console/{org}/actions/{act}/approve`` (and ``/deny``): decide, as the API's
    approve endpoint does, only if the person saw the action as it is now."""

    section = "approvals"
    scope_map = {"POST": "actions:approve"}
    sudo_for = {"POST": "approve or deny this action"}
    approve = True

    def back_to(self) -> str:
        return f"/console/{self.organization.slug}/actions/{self.action.public_id}"

    def post(self, request, org: str, act: str):
        verb = "approve" if self.approve else "deny"
        changes = binding_changes(self.action, request.POST)
        if changes:
            message = (
                f"Nothing was decided: this action is not the one you saw. Changed: "
                f"{'; '.join(changes)}. Read it again below before you {verb} it."
            )
            return self.page(
                "console/approvals/action.html",
                self.action_context(error=message, error_status=409),
                status=409,
            )
        unacknowledged = self.approve and hidden_unacknowledged(
            ActionSerializer(self.action).data["hidden_args"], request.POST, verb="approved"
        )
        if unacknowledged:
            return self.page(
                "console/approvals/action.html",
                self.action_context(error=unacknowledged, error_status=400),
                status=400,
            )
        reason = request.POST.get("reason", "").strip()[:2000]
        try:
            # approval_decide queues the approved call's dispatch on commit, exactly as for
            # the API's approve endpoint, which does nothing else after it.
            approval_decide(
                actor=self.principal, action=self.action, approve=self.approve, reason=reason
            )
        except KestrelError as exc:
            self.resolve_parents(act=act)  # an expiry or a new denial may have been recorded
            return self.page(
                "console/approvals/action.html",
                self.action_context(error=exc.message, error_status=exc.status),
                status=exc.status,
            )
        messages.success(
            request, "Approved: the action is queued to run." if self.approve else "Denied."
        )
        return HttpResponseRedirect(self.back_to(), status=303)


class PlanPage(ConsoleView):
    def resolve_parents(self, **kwargs: Any) -> None:
        plan = (
            plans_visible_to(principal=self.principal, organization=self.organization)
            .select_related("thread__project", "accepted_by", "proposed_by_token__user")
            .filter(public_id=kwargs.get("pln"))
            .first()
        )
        if plan is None:
            raise Http404
        self.plan = plan

    def plan_context(self, *, error: str = "", error_status: int = 0) -> dict[str, Any]:
        plan = self.plan
        shown = PlanSerializer(plan).data
        return {
            "plan": plan,
            "shown": shown,
            "hidden": plan_hidden_paths(shown),
            "steps": [
                {**step, "index": index, "args_json": pretty(step.get("args"))}
                for index, step in enumerate(shown["steps"])
            ],
            "steps_digest": digest(plan.steps),
            "proposer": requester(
                token=plan.proposed_by_token, user=None, recorded=plan.proposed_by
            ),
            "may_accept": self.can("actions:approve") and plan.state == "proposed",
            "error": error,
            "error_status": error_status,
        }


def plan_hidden_paths(shown: dict) -> list[str]:
    """``hidden_paths`` of every step's arguments, each named after its step."""
    return [
        f"step {index}: {path}"
        for index, step in enumerate(shown["steps"])
        for path in hidden_paths(step.get("args"))
    ]


class PlanView(PlanPage):
    """``/console/{org}/plans/{pln}``: a plan's steps in full, and accepting it."""

    section = "approvals"
    scope_map = {"GET": "projects:read"}

    def get(self, request, org: str, pln: str):
        return self.page("console/approvals/plan.html", self.plan_context())


class PlanAcceptView(PlanPage):
    """``POST /console/{org}/plans/{pln}/accept``: as the API's accept endpoint, only if the
    steps are the ones the person saw."""

    section = "approvals"
    scope_map = {"POST": "actions:approve"}
    sudo_for = {"POST": "accept this plan"}

    def back_to(self) -> str:
        return f"/console/{self.organization.slug}/plans/{self.plan.public_id}"

    def post(self, request, org: str, pln: str) -> HttpResponse:
        seen = request.POST.get("steps_digest", "")
        current = digest(self.plan.steps)
        if seen != current:
            message = (
                "Nothing was accepted: the plan's steps are not the ones you saw "
                f"(you saw steps with digest {_short(seen) or 'none'}, they are now {current}). "
                "Read them again below."
            )
            return self.page(
                "console/approvals/plan.html",
                self.plan_context(error=message, error_status=409),
                status=409,
            )
        unacknowledged = hidden_unacknowledged(
            plan_hidden_paths(PlanSerializer(self.plan).data), request.POST, verb="accepted"
        )
        if unacknowledged:
            return self.page(
                "console/approvals/plan.html",
                self.plan_context(error=unacknowledged, error_status=400),
                status=400,
            )
        try:
            plan_accept(actor=self.principal, plan=self.plan)
        except KestrelError as exc:
            return self.page(
                "console/approvals/plan.html",
                self.plan_context(error=exc.message, error_status=exc.status),
                status=exc.status,
            )
        messages.success(request, "Accepted: its steps may now run.")
        return HttpResponseRedirect(self.back_to(), status=303)


urlpatterns = [
    path("console/<slug:org>/approvals", InboxView.as_view(), name="console_approvals"),
    path("console/<slug:org>/actions/<str:act>", ActionView.as_view(), name="console_action"),
    path(
        "console/<slug:org>/actions/<str:act>/approve",
        ActionDecisionView.as_view(approve=True),
        name="console_action_approve",
    ),
    path(
        "console/<slug:org>/actions/<str:act>/deny",
        ActionDecisionView.as_view(approve=False),
        name="console_action_deny",
    ),
    path("console/<slug:org>/plans/<str:pln>", PlanView.as_view(), name="console_plan"),
    path(
        "console/<slug:org>/plans/<str:pln>/accept",
        PlanAcceptView.as_view(),
        name="console_plan_accept",
    ),
]
