"""The console's model gateway pages: usage and budgets per project.

``/console/{org}/usage`` lists the projects the person sees with this UTC day's and month's
tokens against their budgets; ``/console/{org}/projects/{prj}/usage`` shows one project's
budget and recent model calls (sizes and hashes, never content), and lets whoever holds
``projects:manage`` (owners and admins) set the budget, as ``PUT .../model/budget`` does.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.http import Http404, HttpResponseRedirect
from django.urls import path
from django.utils.http import urlencode

from kestrel_one.common.errors import KestrelError
from kestrel_one.console.base import ConsoleView
from kestrel_one.console.paging import page_of
from kestrel_one.gateway.selectors import budget_view, usages_of
from kestrel_one.gateway.services import MAX_BUDGET_TOKENS, budget_set
from kestrel_one.tenancy.models import Project
from kestrel_one.tenancy.selectors import project_visible

TEMPLATES = "console/gateway/"
USAGES_PER_PAGE = 50
PROJECTS_LISTED = 200


class BudgetForm(forms.Form):
    """Empty is no limit on that period (the API's null)."""

    tokens_per_day = forms.IntegerField(min_value=0, max_value=MAX_BUDGET_TOKENS, required=False)
    tokens_per_month = forms.IntegerField(min_value=0, max_value=MAX_BUDGET_TOKENS, required=False)


class UsageIndexView(ConsoleView):
    """Every project the person sees, with its tokens today and this month."""

    scope_map = {"GET": "projects:read"}
    section = "usage"

    def get(self, request, org: str):
        projects = Project.objects.visible_to(self.principal, self.organization).order_by("name")
        rows = [(project, budget_view(project)) for project in projects[:PROJECTS_LISTED]]
        return self.page(TEMPLATES + "index.html", {"rows": rows})


class ProjectUsageView(ConsoleView):
    """One project's budget (a form for ``projects:manage``) and its recent model calls."""

    scope_map = {"GET": "projects:read", "POST": "projects:manage"}
    section = "usage"

    def resolve_parents(self, **kwargs: Any) -> None:
        project = project_visible(self.principal, self.organization, kwargs.get("prj"))
        if project is None:
            raise Http404
        self.project = project

    def get(self, request, org: str, prj: str):
        budget = budget_view(self.project)
        form = BudgetForm(
            initial={
                "tokens_per_day": budget["tokens_per_day"],
                "tokens_per_month": budget["tokens_per_month"],
            }
        )
        return self.usage_page(form)

    def post(self, request, org: str, prj: str):
        form = BudgetForm(request.POST)
        if not form.is_valid():
            return self.usage_page(form, status=400)
        try:
            budget_set(
                actor=self.principal,
                project=self.project,
                tokens_per_day=form.cleaned_data["tokens_per_day"],
                tokens_per_month=form.cleaned_data["tokens_per_month"],
            )
        except KestrelError as error:
            form.add_error(None, error.message)
            return self.usage_page(form, status=error.status)
        return HttpResponseRedirect(f"{request.path}?{urlencode({'saved': '1'})}", status=303)

    def usage_page(self, form, *, status: int = 200):
        usages = page_of(
            usages_of(self.project), self.request.GET.get("page"), per_page=USAGES_PER_PAGE
        )
        context = {
            "project": self.project,
            "budget": budget_view(self.project),
            "form": form,
            "usages": usages,
            "saved": self.request.GET.get("saved") == "1",
        }
        return self.page(TEMPLATES + "project.html", context, status=status)


urlpatterns = [
    path("console/<slug:org>/usage", UsageIndexView.as_view(), name="console_usage"),
    path(
        "console/<slug:org>/projects/<str:prj>/usage",
        ProjectUsageView.as_view(),
        name="console_project_usage",
    ),
]
