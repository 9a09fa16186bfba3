"""The base viewset refuses subclasses that would override how tenancy is enforced."""

import pytest

from kestrel_one.api.base import OrgScopedViewSet, ProjectScopedViewSet


@pytest.mark.spec("TEN-1")
@pytest.mark.parametrize("method", ["get_queryset", "get_object", "initial", "check_permissions"])
def test_overriding_a_tenancy_method_is_refused(method):
    with pytest.raises(TypeError, match=method):
        type("Sneaky", (OrgScopedViewSet,), {method: lambda self, *a, **k: None})


@pytest.mark.spec("TEN-1")
def test_project_scoped_views_cannot_replace_project_resolution():
    with pytest.raises(TypeError, match="resolve_parents"):
        type("Sneaky", (ProjectScopedViewSet,), {"resolve_parents": lambda self, **k: None})


def test_narrowing_hook_is_allowed():
    type("Fine", (OrgScopedViewSet,), {"restrict": lambda self, qs: qs.none()})
