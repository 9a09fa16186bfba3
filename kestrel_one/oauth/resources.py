"""Which Kestrel URL names which Project: the MCP endpoint as an OAuth protected resource.

The resource a client asks for (RFC 8707 ``resource``) is the endpoint's absolute URL,
``<origin>/api/v1/orgs/{org}/projects/{prj}/mcp``; the origin is KESTREL_PUBLIC_URL when set,
else the request's own. The Project is looked up through the person, so one they cannot see is
the same "no such resource" as one that does not exist.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from kestrel_one.tenancy.models import Project
from kestrel_one.tenancy.selectors import organization_addressed

MCP_PATH = re.compile(
    r"^/api/v1/orgs/(?P<org>[-a-zA-Z0-9_]{1,100})/projects/(?P<prj>[A-Za-z0-9_]{1,64})/mcp/?$"
)


def resource_project(*, principal, resource: str, origin: str) -> Project | None:
    """The Project whose MCP endpoint ``resource`` is, among those the principal sees."""
    if len(resource) > 2000:
        return None
    parts = urlsplit(resource)
    if parts.query or parts.fragment or "#" in resource or parts.username or parts.password:
        return None
    if f"{parts.scheme}://{parts.netloc}".lower() != origin.lower():
        return None
    match = MCP_PATH.match(parts.path)
    if match is None:
        return None
    organization = organization_addressed(principal, match["org"])
    if organization is None:
        return None
    return (
        Project.objects.visible_to(principal, organization)
        .select_related("organization")
        .filter(public_id=match["prj"])
        .first()
    )
