"""Who requested an action, as they stand now.

A call runs on its requester's authority, and that authority can end while the call waits: a
token revoked (it leaked) or expired, a person deactivated or removed from the organization,
the single host's owner gone. A person's approval decides whether the call may run; it never
lends the call an authority its requester no longer has. So whatever would start a call
later than its request (an approval, signing its command, a control-tier worker taking it, a
workload's brokered call) asks ``requester_now`` first and refuses when it is None.
"""

from __future__ import annotations

from kestrel_one.accounts.backends import local_owner
from kestrel_one.accounts.models import ApiToken
from kestrel_one.accounts.principal import Principal, PrincipalKind, system_principal
from kestrel_one.common.errors import Conflict

REQUESTER_INACTIVE = "requester_inactive"
REQUESTER_INACTIVE_MESSAGE = (
    "Whoever requested this call can no longer act: its token was revoked or expired, or its "
    "person is no longer active in this organization. It does not run; request it again as "
    "someone who can."
)


class RequesterInactive(Conflict):
    code = REQUESTER_INACTIVE


# A token's public id, as ``requested_by`` keeps it even once the token row is deleted.
_TOKEN_ID_PREFIX = "tok_"  # noqa: S105 (a public id prefix, not a secret)


def requester_now(action) -> Principal | None:
    """``action``'s requester as a principal that may still act, or None when it may not."""
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
