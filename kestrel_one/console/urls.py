"""Console URLs (API.md, "Console"). Each part of the console keeps its own list of pages in
its module; this file only puts them together."""

from django.urls import path

from kestrel_one.console import (
    adapters,
    administration,
    approvals,
    credentials,
    dashboard,
    gateway,
    mcp,
    policy,
    surfaces,
    views,
)

urlpatterns = [
    path("console/", views.home, name="console_home"),
    path("console/sudo", views.SudoView.as_view(), name="console_sudo"),
    *dashboard.urlpatterns,
    *approvals.urlpatterns,
    *policy.urlpatterns,
    *surfaces.urlpatterns,
    *administration.urlpatterns,
    *gateway.urlpatterns,
    *credentials.urlpatterns,
    *adapters.urlpatterns,
    *mcp.urlpatterns,
]
