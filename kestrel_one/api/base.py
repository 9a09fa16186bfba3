"""The one base viewset that every organization-scoped endpoint uses.

The organization comes from the URL and is resolved *through* the principal: an organization
the caller cannot address is the same 404 as one that does not exist. Then the method's scope
is checked (403 only for members who lack it). Querysets are always filtered by the resolved
organization after any subclass restriction, so a subclass can narrow what is visible but can
never widen it. Overriding the methods that enforce this is refused when the class is created.
"""

from __future__ import annotations

from django.db.models import Q
from rest_framework import exceptions, viewsets
from rest_framework.exceptions import NotFound

from kestrel_one.accounts.principal import missing_scope_message
from kestrel_one.common.errors import PermissionDenied
from kestrel_one.common.ids import url_names_storable
from kestrel_one.tenancy.selectors import organization_addressed, project_visible
from kestrel_one.threads.models import Thread


class OrgScopedViewSet(viewsets.GenericViewSet):
    # HTTP method -> the scope the caller must hold in the organization. A method with no
    # entry is refused, never allowed by default.
    scope_map: dict[str, str] = {}
    # The lookup from the model to its Organization.
    organization_field = "organization"
    # Also rows that belong to no organization (shared by all, like a platform runner), which
    # restrict() must then narrow to those that serve this one. Off unless a view needs it.
    dangerously_include_unowned = False
    lookup_field = "public_id"

    protected_methods = ("initial", "get_queryset", "get_object", "check_permissions")

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        protected = {
            name for base in cls.__mro__[1:] for name in base.__dict__.get("protected_methods", ())
        }
        overridden = sorted(name for name in protected if name in cls.__dict__)
        if overridden:
            raise TypeError(
                f"{cls.__name__} overrides {', '.join(overridden)}, which enforce tenancy; "
                "narrow visibility with restrict() instead"
            )

    def initial(self, request, *args, **kwargs):
        super().initial(request, *args, **kwargs)  # authentication (401) and IsPrincipal
        if not url_names_storable(kwargs):
            raise NotFound()
        principal = request.auth
        organization = organization_addressed(principal, kwargs.get("org"))
        if organization is None:
            raise NotFound()
        self.organization = organization
        method = "GET" if request.method == "HEAD" else request.method
        required = self.scope_map.get(method)
        if required is None:
            raise exceptions.MethodNotAllowed(request.method)
        if required not in principal.scopes_in(organization):
            raise PermissionDenied(missing_scope_message(principal, required, organization))
        self.resolve_parents(**kwargs)

    def resolve_parents(self, **kwargs) -> None:
        """Resolve parent objects named in the URL, always through ``self.organization``."""

    def restrict(self, queryset):
        """Narrow what the principal may see inside the organization (never widen)."""
        return queryset

    def get_queryset(self):
        queryset = self.restrict(self.queryset.model.objects.all())
        owned = Q(**{self.organization_field: self.organization})
        if self.dangerously_include_unowned:
            owned |= Q(**{f"{self.organization_field}__isnull": True})
        return queryset.filter(owned)

    def get_object(self):
        queryset = self.filter_queryset(self.get_queryset())
        lookup = self.kwargs.get(self.lookup_url_kwarg or self.lookup_field)
        obj = queryset.filter(**{self.lookup_field: lookup}).first()
        if obj is None:
            raise NotFound()
        self.check_object_permissions(self.request, obj)
        return obj

    @property
    def principal(self):
        return self.request.auth


class ProjectScopedViewSet(OrgScopedViewSet):
    """For routes under ``/projects/{prj}/`` (and ``/threads/{thr}/`` below it): the project
    must be visible to the principal, and the thread is fetched through that project.

    Parents further down the URL are declared, never looked up by the view: each entry of
    ``parent_lookups`` is ``(url kwarg, attribute, related name)``, fetched by public id
    through the related manager of the parent above it (the thread, or the previous entry),
    and a missing one is the same 404 as a missing project. For example
    ``(("act", "action", "actions"),)`` sets ``self.action`` from ``self.thread.actions``.
    """

    protected_methods = ("resolve_parents",)
    parent_lookups: tuple[tuple[str, str, str], ...] = ()

    def resolve_parents(self, **kwargs) -> None:
        project = project_visible(self.principal, self.organization, kwargs.get("prj"))
        if project is None:
            raise NotFound()
        self.project = project
        self.thread = None
        if "thr" in kwargs:
            self.thread = Thread.objects.filter(public_id=kwargs["thr"], project=project).first()
            if self.thread is None:
                raise NotFound()
            # The same rows, already loaded (the project with its environment and
            # organization), which every action request reads.
            self.thread.project = project
            if self.thread.organization_id == project.organization_id:
                self.thread.organization = project.organization
        parent = self.thread if self.thread is not None else project
        for kwarg, attribute, related_name in self.parent_lookups:
            # Through the parent's related manager: the child is found inside it or not at all,
            # and keeps the parent already loaded.
            child = getattr(parent, related_name).filter(public_id=kwargs.get(kwarg)).first()
            if child is None:
                raise NotFound()
            setattr(self, attribute, child)
            parent = child
