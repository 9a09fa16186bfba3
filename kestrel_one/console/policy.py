"""Console: the policy pages (SURF-2).

``/console/{org}/policy`` lists the environments and projects with their published versions.
``/console/{org}/environments/{env}/policy`` and ``/console/{org}/projects/{prj}/policy``
show the published version and its history, and edit a draft: saved (validated by the
parser the publish path uses), read as grants, diffed against the published version, checked
against the environment (a project draft's widenings) or against the projects (those an
environment draft would cap), replayed against the recorded decisions of the last days
(preview), judged on a call of one's choosing (explain), and published in sudo mode through
the publish service. Owners are fetched through the organization exactly as the API's
policy endpoints fetch them; writes go through ``kestrel_one.governance.services``.
"""

from __future__ import annotations

import json
from typing import Any

from django.conf import settings
from django.http import Http404, HttpResponse, HttpResponseRedirect
from django.urls import path

from kestrel_one.accounts.models import ApiToken, User
from kestrel_one.common.errors import KestrelError, ValidationFailed
from kestrel_one.common.jsontext import json_loads
from kestrel_one.console.base import ConsoleView
from kestrel_one.console.paging import page_of
from kestrel_one.execution.policy_preview import decisions_preview
from kestrel_one.governance import drafts, services
from kestrel_one.governance.judging import tool_call_admitted
from kestrel_one.governance.models import PolicyVersion
from kestrel_one.governance.selectors import (
    environment_ceiling,
    parse_mode,
    policy_of,
    project_exceeds,
)
from kestrel_one.tenancy.models import Environment, Project
from policies import Mode
from runners.contract.registry import TOOLS

READ, PUBLISH, CALLS = "org:read", "policies:write", "projects:read"
# Rows per page of the history and of the index's projects, newest or by name.
PAGE_SIZE = 50
# The most projects an environment draft is checked against on one page load (by name).
MAX_PROJECTS_CHECKED = 500
# The explain panel's arguments field: a tool call's arguments are small.
MAX_EXPLAIN_ARGS = 16 * 1024
# An action's arguments in the preview table: enough to recognise the call.
MAX_SHOWN_ARGS = 2000
DONE_NOTICES = {
    "saved": "Draft saved.",
    "discarded": "Draft discarded.",
    "published": "Published. The new version is in force for every new decision.",
}


class PolicyOwnerView(ConsoleView):
    """A page about one environment's or one project's policy (the URL says which)."""

    section = "policy"
    owner: Environment | Project
    environment: Environment
    project: Project | None

    def resolve_parents(self, **kwargs: Any) -> None:
        if "prj" in kwargs:
            # The projects the API's ProjectScopedViewSet lets this person see.
            project = (
                Project.objects.visible_to(self.principal, self.organization)
                .select_related("environment__policy_version", "policy_version", "organization")
                .filter(public_id=kwargs["prj"])
                .first()
            )
            if project is None:
                raise Http404
            self.owner, self.project, self.environment = project, project, project.environment
        else:
            # As EnvironmentPolicyViewSet: every environment of the organization.
            environment = (
                Environment.objects.filter(organization=self.organization, public_id=kwargs["env"])
                .select_related("policy_version", "organization")
                .first()
            )
            if environment is None:
                raise Http404
            self.owner, self.project, self.environment = environment, None, environment

    @property
    def is_project(self) -> bool:
        return self.project is not None

    def policy_url(self) -> str:
        if self.project is not None:
            return f"/console/{self.organization.slug}/projects/{self.project.public_id}/policy"
        return f"/console/{self.organization.slug}/environments/{self.environment.public_id}/policy"

    def back_to(self) -> str:
        return self.policy_url()

    def owner_context(self) -> dict[str, Any]:
        return {
            "owner": self.owner,
            "project": self.project,
            "environment": self.environment,
            "is_project": self.is_project,
            "policy_url": self.policy_url(),
        }

    def draft_layers(self, draft_policy) -> dict[str, Any]:
        """The draft in the layer it replaces, as the preview and explain take it."""
        if self.is_project:
            return {"project_draft": draft_policy}
        return {"environment_draft": draft_policy}

    def render_editor(
        self,
        *,
        text: str | None = None,
        save_error: dict | None = None,
        publish_error: dict | None = None,
        status: int = 200,
    ) -> HttpResponse:
        published = self.owner.policy_version
        published_policy = policy_of(published)
        draft = drafts.policy_draft_of(self.owner)
        draft_policy = drafts.draft_policy(draft)
        history = self.history()
        names = actor_names(
            self.organization,
            {version.created_by for version in history["versions"]}
            | {published.created_by if published else "", draft.updated_by if draft else ""},
        )
        for version in history["versions"]:
            version.publisher = names.get(version.created_by, version.created_by)
        context: dict[str, Any] = {
            **self.owner_context(),
            "published": published,
            "published_grants": drafts.grants_view(published_policy),
            "published_denied": drafts.denied_capabilities(published_policy),
            "published_json": drafts.pretty_document(published.document if published else None),
            "history": history,
            "published_by": names.get(published.created_by, published.created_by)
            if published
            else "",
            "draft": draft,
            "draft_grants": drafts.grants_view(draft_policy),
            "draft_denied": drafts.denied_capabilities(draft_policy),
            "save_error": save_error,
            "publish_error": publish_error,
            "can_publish": self.can(PUBLISH),
            "can_read_calls": self.can(CALLS),
            "notice": DONE_NOTICES.get(self.request.GET.get("done", "")),
            "preview_days": settings.KESTREL_POLICY_PREVIEW_DAYS,
            "preview_max": settings.KESTREL_POLICY_PREVIEW_MAX_ACTIONS,
        }
        context["editor_text"] = text if text is not None else self.editor_text(draft)
        if draft is not None:
            context["stale_base"] = draft.base_sha256 != (published.sha256 if published else "")
            context["draft_by"] = names.get(draft.updated_by, draft.updated_by)
            # A project without a policy of its own uses its environment's: that is what the
            # draft changes for it.
            base = published
            if base is None and self.is_project:
                base = self.environment.policy_version
                context["diff_base"] = "environment"
            context["diff"] = drafts.policy_diff(base.document if base else None, draft.document)
        if self.is_project:
            assert self.project is not None
            context["exceeds_now"] = project_exceeds(self.project)
            context["environment_published"] = self.environment.policy_version
            if draft_policy is not None:
                context["widenings"] = drafts.project_draft_widenings(self.project, draft_policy)
        else:
            projects = self.environment_projects()
            context["projects_truncated"] = len(projects) > MAX_PROJECTS_CHECKED
            projects = projects[:MAX_PROJECTS_CHECKED]
            context["project_count"] = len(projects)
            if draft_policy is not None:
                capped, inheriting = drafts.projects_capped(projects, draft_policy)
                context["capped"], context["inheriting"] = capped, inheriting
        context.update(explain_form_context(self, {}))
        return self.page("console/policy/editor.html", context, status=status)

    def editor_text(self, draft) -> str:
        """What the editor starts from: the draft, else the published document, else (a
        project without its own) the environment's, which it may only narrow."""
        if draft is not None:
            return draft.text
        published = self.owner.policy_version
        if published is not None:
            return drafts.pretty_document(published.document)
        if self.is_project and self.environment.policy_version is not None:
            return drafts.pretty_document(self.environment.policy_version.document)
        return '{\n  "capabilities": {}\n}'

    def environment_projects(self) -> list[Project]:
        return list(
            Project.objects.visible_to(self.principal, self.organization)
            .filter(environment=self.environment)
            .select_related("policy_version")
            .order_by("name")[: MAX_PROJECTS_CHECKED + 1]
        )

    def history(self):
        versions = PolicyVersion.objects.filter(
            organization=self.organization, **services.draft_owner(self.owner)
        ).order_by("-created_at", "-pk")
        page = page_of(versions, self.request.GET.get("page"), per_page=PAGE_SIZE)
        shown = list(page.object_list)
        return {"page": page, "versions": shown}


class PolicyPage(PolicyOwnerView):
    """The editor: published version, history, draft, diff, widenings or capped projects.
    POST saves the draft."""

    scope_map = {"GET": READ, "POST": PUBLISH}

    def get(self, request, **kwargs):
        return self.render_editor()

    def post(self, request, **kwargs):
        text = request.POST.get("document", "")
        try:
            services.policy_draft_save(actor=self.principal, owner=self.owner, text=text)
        except KestrelError as error:
            return self.render_editor(text=text, save_error=error_view(error), status=error.status)
        return HttpResponseRedirect(self.policy_url() + "?done=saved", status=303)


class PolicyPublish(PolicyOwnerView):
    """POST: publish the draft (sudo mode), through the publish service of the owner's kind."""

    scope_map = {"POST": PUBLISH}
    sudo_for = {"POST": "publish this policy"}

    def post(self, request, **kwargs):
        try:
            services.policy_draft_publish(
                actor=self.principal,
                owner=self.owner,
                expected_sha256=request.POST.get("draft_sha256", ""),
            )
        except KestrelError as error:
            return self.render_editor(publish_error=error_view(error), status=error.status)
        return HttpResponseRedirect(self.policy_url() + "?done=published", status=303)


class PolicyDiscard(PolicyOwnerView):
    """POST: throw the draft away."""

    scope_map = {"POST": PUBLISH}

    def post(self, request, **kwargs):
        services.policy_draft_discard(actor=self.principal, owner=self.owner)
        return HttpResponseRedirect(self.policy_url() + "?done=discarded", status=303)


class PolicyPreview(PolicyOwnerView):
    """GET: the recorded decisions of the last days that the draft would change."""

    scope_map = {"GET": CALLS}

    def get(self, request, **kwargs):
        draft = drafts.policy_draft_of(self.owner)
        context: dict[str, Any] = {**self.owner_context(), "draft": draft}
        if draft is not None:
            context["preview"] = decisions_preview(
                principal=self.principal,
                organization=self.organization,
                days=settings.KESTREL_POLICY_PREVIEW_DAYS,
                limit=settings.KESTREL_POLICY_PREVIEW_MAX_ACTIONS,
                environment=None if self.is_project else self.environment,
                project=self.project,
                **self.draft_layers(drafts.draft_policy(draft)),
            )
            context["changes"] = [
                {
                    "action": change.action,
                    "recorded": change.recorded,
                    "draft": change.draft,
                    "reasons": change.reasons,
                    "args_text": shown_arguments(change.action.args),
                }
                for change in context["preview"].changed
            ]
        if request.headers.get("HX-Request") == "true":
            return self.page("console/policy/preview_result.html", context)
        return self.page("console/policy/preview.html", context)


class PolicyExplain(PolicyOwnerView):
    """GET: one call judged under the published policy and under the draft, as the API's
    explain judges it (``call_judge``), for the signed-in person."""

    scope_map = {"GET": CALLS}

    def get(self, request, **kwargs):
        context: dict[str, Any] = {**self.owner_context()}
        context.update(explain_form_context(self, request.GET))
        status = 200
        fragment = request.headers.get("HX-Request") == "true"
        if "tool" in request.GET:
            try:
                context["explanation"] = self.explain(request.GET)
            except KestrelError as error:
                context["explain_error"] = error_view(error)
                # htmx swaps only a 2xx answer in; the fragment says what was wrong.
                status = 200 if fragment else error.status
        template = (
            "console/policy/explain_result.html" if fragment else "console/policy/explain.html"
        )
        return self.page(template, context, status=status)

    def explain(self, values) -> drafts.Explanation:
        mode = parse_mode(values.get("mode") or None)
        raw = values.get("args", "")
        if len(raw) > MAX_EXPLAIN_ARGS:
            raise ValidationFailed(f"The arguments are over {MAX_EXPLAIN_ARGS} characters.")
        try:
            args = json_loads(raw or "{}")
        except ValueError as error:
            raise ValidationFailed(f"The arguments are not valid JSON: {error}") from None
        project = self.project
        if project is None and values.get("project"):
            project = (
                Project.objects.visible_to(self.principal, self.organization)
                .filter(environment=self.environment, public_id=values["project"])
                .select_related("environment__policy_version", "policy_version", "organization")
                .first()
            )
            if project is None:
                raise ValidationFailed("That project is not in this environment.")
        # As the API's explain: admitted first where the policy request depends on it.
        _, canonical, policy_request = tool_call_admitted(
            values.get("tool", ""),
            args,
            project=project,
            user=self.principal.user,
            token=self.principal.token,
            judging_only=True,
        )
        draft = drafts.draft_policy(drafts.policy_draft_of(self.owner))
        return drafts.explain_published_and_draft(
            organization=self.organization,
            principal=self.principal,
            environment=self.environment,
            project=project,
            mode=mode,
            policy_request=policy_request,
            canonical=canonical,
            # The console judges what a call from the console would meet.
            surface="console",
            **(self.draft_layers(draft) if draft is not None else {}),
        )


class PolicyIndex(ConsoleView):
    """``/console/{org}/policy``: every environment and (visible) project, with its version."""

    section = "policy"
    scope_map = {"GET": READ}

    def get(self, request, **kwargs):
        environments = list(
            Environment.objects.filter(organization=self.organization)
            .select_related("policy_version")
            .order_by("name")
        )
        projects = (
            Project.objects.visible_to(self.principal, self.organization)
            .select_related("policy_version", "environment")
            .order_by("name")
        )
        page = page_of(projects, request.GET.get("page"), per_page=PAGE_SIZE)
        return self.page(
            "console/policy/index.html",
            {"environments": environments, "projects": page},
        )


def explain_form_context(view: PolicyOwnerView, values) -> dict[str, Any]:
    projects = []
    if not view.is_project:
        projects = list(
            Project.objects.visible_to(view.principal, view.organization)
            .filter(environment=view.environment)
            .order_by("name")
            .values_list("public_id", "name")[:PAGE_SIZE]
        )
    return {
        "tools": sorted(TOOLS),
        "modes": [mode.value for mode in Mode],
        "explain_projects": projects,
        "explain_values": {
            "tool": values.get("tool", "fs.read"),
            "args": values.get("args", '{"path": "README.md"}'),
            "mode": values.get("mode", "agent"),
            "project": values.get("project", ""),
        },
        "lacks_write_scope": "projects:write" not in view.scopes,
        "environment_ceiling_empty": environment_ceiling(view.environment).capabilities
        == frozenset(),
    }


def shown_arguments(args) -> str:
    """An action's stored (redacted) arguments, pretty, bounded for a table cell."""
    text = json.dumps(args, indent=2, sort_keys=True, ensure_ascii=False)
    return text if len(text) <= MAX_SHOWN_ARGS else text[:MAX_SHOWN_ARGS] + "\n…"


def error_view(error: KestrelError) -> dict[str, Any]:
    """A service error as the page shows it: the message, and each problem at its path."""
    details = error.details if isinstance(error.details, dict) else {}
    problems = [
        {"path": item.get("path") or "(document)", "message": item.get("message", "")}
        for item in details.get("issues", details.get("widenings", []))
    ]
    if not problems and "field" in details:
        problems = [{"path": details["field"], "message": error.message}]
    return {"message": error.message, "problems": problems, "status": error.status}


def actor_names(organization, ids: set[str]) -> dict[str, str]:
    """Recorded actor ids as people read them: a member's email, a token's name (two
    queries, however many ids)."""
    ids = ids - {""}
    names = dict(
        User.objects.filter(public_id__in=ids, memberships__organization=organization).values_list(
            "public_id", "email"
        )
    )
    names.update(
        (public_id, f"token “{name}”")
        for public_id, name in ApiToken.objects.filter(
            public_id__in=ids, organization=organization
        ).values_list("public_id", "name")
    )
    return names


_OWNER_ROUTES = (
    ("environments/<str:env>/policy", "console_environment_policy"),
    ("projects/<str:prj>/policy", "console_project_policy"),
)
urlpatterns = [path("console/<slug:org>/policy", PolicyIndex.as_view(), name="console_policy")]
for _prefix, _name in _OWNER_ROUTES:
    urlpatterns += [
        path(f"console/<slug:org>/{_prefix}", PolicyPage.as_view(), name=_name),
        path(
            f"console/<slug:org>/{_prefix}/publish",
            PolicyPublish.as_view(),
            name=f"{_name}_publish",
        ),
        path(
            f"console/<slug:org>/{_prefix}/discard",
            PolicyDiscard.as_view(),
            name=f"{_name}_discard",
        ),
        path(
            f"console/<slug:org>/{_prefix}/preview",
            PolicyPreview.as_view(),
            name=f"{_name}_preview",
        ),
        path(
            f"console/<slug:org>/{_prefix}/explain",
            PolicyExplain.as_view(),
            name=f"{_name}_explain",
        ),
    ]
