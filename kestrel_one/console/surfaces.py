"""Console: the surface policies (POL-2).

``/console/{org}/surfaces`` shows, for each surface a request can come through (the REST API,
the console, the MCP endpoint), the organization's current policy of that surface, which is
one term of every effective policy of a call through it, and its recent versions. An admin
publishes a new one from the same page, in sudo mode as the policy editor publishes, through
the service the API's ``PUT .../surfaces/{surface}/policy`` calls; errors are shown at their
path in the document.
"""

from __future__ import annotations

from typing import Any

from django.http import HttpResponse, HttpResponseRedirect
from django.urls import path

from kestrel_one.common.errors import KestrelError
from kestrel_one.console.base import ConsoleView
from kestrel_one.console.policy import actor_names, error_view
from kestrel_one.governance import drafts, services
from kestrel_one.governance.models import Surface, SurfacePolicyVersion
from kestrel_one.governance.selectors import SURFACES, policy_of

READ, PUBLISH = "org:read", "policies:write"
# Versions shown per surface, newest first.
HISTORY_SHOWN = 10
WHAT_EACH_SURFACE_IS = {
    Surface.API: "Calls made with an API token or by the local agent through the REST API.",
    Surface.CONSOLE: "What the console judges for a signed-in person (its explain panel).",
    Surface.MCP: "Tool calls that MCP clients make through the project's MCP endpoint.",
}


class SurfacesPage(ConsoleView):
    """GET: every surface's current policy and history. POST (sudo): publish one surface's."""

    section = "surfaces"
    scope_map = {"GET": READ, "POST": PUBLISH}
    sudo_for = {"POST": "publish this surface policy"}

    def url(self) -> str:
        return f"/console/{self.organization.slug}/surfaces"

    def get(self, request, **kwargs):
        return self.render_surfaces()

    def post(self, request, **kwargs):
        surface = request.POST.get("surface", "")
        text = request.POST.get("document", "")
        try:
            services.surface_policy_publish(
                actor=self.principal,
                organization=self.organization,
                surface=surface,
                document=text.encode("utf-8", "surrogatepass"),
            )
        except KestrelError as error:
            return self.render_surfaces(
                surface=surface, text=text, error=error_view(error), status=error.status
            )
        return HttpResponseRedirect(
            f"{self.url()}?published={surface}#surface-{surface}", status=303
        )

    def render_surfaces(
        self,
        *,
        surface: str = "",
        text: str = "",
        error: dict | None = None,
        status: int = 200,
    ) -> HttpResponse:
        versions = list(
            SurfacePolicyVersion.objects.filter(organization=self.organization).order_by("-id")
        )
        names = actor_names(self.organization, {version.created_by for version in versions})
        rows: list[dict[str, Any]] = []
        for name in SURFACES:
            history = [version for version in versions if version.surface == name]
            for version in history:
                version.publisher = names.get(version.created_by, version.created_by)
            current = history[0] if history else None
            policy = policy_of(current)
            shown = drafts.pretty_document(current.document) if current else ""
            rows.append(
                {
                    "name": name,
                    "label": Surface(name).label,
                    "about": WHAT_EACH_SURFACE_IS[Surface(name)],
                    "current": current,
                    "grants": drafts.grants_view(policy),
                    "denied": drafts.denied_capabilities(policy),
                    "document_json": shown,
                    "history": history[:HISTORY_SHOWN],
                    "editor_text": text
                    if name == surface
                    else (shown or '{\n  "capabilities": {}\n}'),
                    "error": error if name == surface else None,
                }
            )
        published = self.request.GET.get("published", "")
        return self.page(
            "console/surfaces/index.html",
            {
                "surfaces": rows,
                "can_publish": self.can(PUBLISH),
                "published_notice": published if published in SURFACES else "",
                "unknown_surface_error": error if error and surface not in SURFACES else None,
            },
            status=status,
        )


urlpatterns = [
    path("console/<slug:org>/surfaces", SurfacesPage.as_view(), name="console_surfaces"),
]
