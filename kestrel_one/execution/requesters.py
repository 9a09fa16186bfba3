"""Who requested an action, as they stand now.

A call runs on its requester's authority, and that authority can end while the call waits: a
token revoked (it leaked) or expired, a person deactivated or removed from the organization,
demoted to a role that may not request calls or no longer shown the call's project, the
single host's owner gone. A person's approval decides whether the call may run; it never
lends the call an authority its requester no longer has. So whatever would start a call
later than its request (an approval, signing its command, a control-tier worker taking it, a
workload's brokered call) asks ``requester_now`` first and refuses when it is None.
"""

from __future__ import annotations

from kestrel_one.accounts.backends import local_owner
from kestrel_one.accounts.models import ApiToken
from kestrel_one.accounts.principal import Principal, PrincipalKind, system_principal
from kestrel_one.common.errors import Conflict
from kestrel_one.tenancy.models import Project

REQUESTER_INACTIVE = "requester_inactive"
REQUESTER_INACTIVE_MESSAGE = (
    "Whoever requested this call can no longer act: its token was revoked or expired, its "
    "person is no longer active in this organization, or it no longer holds projects:write "
    "in this call's project. It does not run; request it again as someone who can."
)
# What requesting a call takes (governance.selectors.token_mask): without it, every call is
# denied, so a call waiting for its approval or its signing needs it still.
REQUEST_SCOPE = "projects:write"


class RequesterInactive(Conflict):
    code = REQUESTER_INACTIVE


# A token's public id, as ``requested_by`` keeps it even once the token row is deleted.
_TOKEN_ID_PREFIX = "tok_"  # noqa: S105 (a public id prefix, not a secret)


def requester_now(action) -> Principal | None:
    """``action``'s requester as a principal that may still act, or None when it may not:
    one that still exists and is active, still holds ``REQUEST_SCOPE`` in the organization
    (a person demoted to viewer holds it no more) and still sees the call's project."""
    principal = _requester(action)
    if principal is None or principal.kind == PrincipalKind.SYSTEM:
        return principal
    organization = action.organization
    if REQUEST_SCOPE not in principal.scopes_in(organization):
        return None
    visible = Project.objects.visible_to(principal, organization)
    if not visible.filter(pk=action.project_id).exists():
        return None
    return principal


def _requester(action) -> Principal | None:
    """``action``'s requester as a principal, or None when it is gone or inactive."""
    if action.requested_by_token_id is not None or action.requested_by.startswith(_TOKEN_ID_PREFIX):
        token = (
            ApiToken.objects.active()
            .select_related("user")
            .filter(pk=action.requested_by_token_id)
            .first()
            if action.requested_by_token_id is not None
            else None  # the token itself was deleted
        )
        if token is None or (token.user is not None and not token.user.is_active):
            return None
        return Principal(PrincipalKind.TOKEN, user=token.user, token=token)
    if action.requested_by.startswith("system:"):
        return system_principal(action.requested_by.removeprefix("system:"))
    if action.requested_by == "local-agent":
        owner = local_owner()
        return None if owner is None else Principal(PrincipalKind.LOCAL_AGENT, acting_for=owner)
    user = action.requested_by_user
    if (
        user is not None
        and user.is_active
        and user.memberships.filter(organization_id=action.organization_id).exists()
    ):
        return Principal(PrincipalKind.SESSION, user=user)
    return None
