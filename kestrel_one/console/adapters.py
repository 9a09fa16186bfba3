"""``/console/{org}/adapters``: the trusted host adapters, and which of their operations each
environment of the organization enables.

The registry is static (``kestrel_one.adapters.registry``); what an environment enables is
what its current policy names under ``adapter.invoke`` (a project can only narrow it). An
external operation shows that it always needs a person's approval and an idempotency key.
"""

from __future__ import annotations

from django.urls import path

from kestrel_one.adapters.selectors import adapters_describe
from kestrel_one.console.base import ConsoleView
from kestrel_one.governance.selectors import environment_ceiling
from kestrel_one.tenancy.models import Environment


def _enabled_by(environment) -> dict[str, frozenset[str]]:
    """adapter -> the operations the environment's current policy names."""
    grant = environment_ceiling(environment).grant("adapter.invoke")
    adapters = getattr(grant, "adapters", ())
    if grant is None or not isinstance(adapters, tuple):
        return {}
    return dict(adapters)


class AdaptersView(ConsoleView):
    section = "adapters"
    scope_map = {"GET": "org:read"}

    def get(self, request, org: str):
        environments = list(
            Environment.objects.filter(organization=self.organization)
            .select_related("policy_version")
            .order_by("name")
        )
        enabled = [(environment, _enabled_by(environment)) for environment in environments]
        adapters = adapters_describe()
        for adapter in adapters:
            for operation in adapter["operations"]:
                operation["enabled_in"] = [
                    environment
                    for environment, names in enabled
                    if operation["name"] in names.get(adapter["name"], ())
                ]
        return self.page("console/adapters/adapters.html", {"adapters": adapters})


urlpatterns = [
    path("console/<slug:org>/adapters", AdaptersView.as_view(), name="console_adapters"),
]
