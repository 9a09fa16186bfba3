"""Who is making a request, and what they may do in a given organization.

Authority comes only from here: an authenticated token (and the person behind it, if any), a
signed-in person's session, or, in single-host mode, the local agent on loopback, which acts
in the local owner's organizations with ``LOCAL_AGENT_SCOPES`` only. Headers, query parameters
and client labels never add to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from kestrel_one.accounts.scopes import (
    BEYOND_SOME_PROJECTS,
    LOCAL_AGENT_SCOPES,
    ORGANIZATION_SCOPES,
    ROLE_SCOPES,
    SCOPES,
    Role,
    within_reach,
)


class PrincipalKind(StrEnum):
    TOKEN = "token"  # noqa: S105 - a kind of principal, not a secret
    # Single-host only: a local process (an agent) reaching the API on loopback without a
    # token, or with the configured server token (``anonymous`` tells the two apart). It is
    # not a person: it sees what the local owner sees but holds only LOCAL_AGENT_SCOPES.
    LOCAL_AGENT = "local_agent"
    # A browser session (console); never accepted by the REST API.
    SESSION = "session"
    # An operator's management command on the server itself (bootstrap, sweeps).
    SYSTEM = "system"
    # An enrolled runner, as the author of verified reports; never an API caller.
    RUNNER = "runner"


@dataclass(eq=False)
class Principal:
    """The authenticated caller of one request."""

    kind: PrincipalKind
    user: object | None = None
    token: object | None = None
    anonymous: bool = False
    # The local agent only: the owner whose organizations and projects it may address. Never a
    # source of authority (``user`` stays None, so nothing a person may do is open to it).
    acting_for: object | None = None
    system_name: str = ""
    # A console session only: whether its person signed in, or confirmed who they are, within
    # KESTREL_CONSOLE_SUDO_SECONDS (console sudo mode). A decision only a person may make
    # (``execution.approvals.require_person``) is refused to a session where it is False, so
    # every such decision asks for it, whichever page posts it. None: no surface asks.
    reauthenticated: bool | None = None
    _memberships: dict[int, object | None] = field(default_factory=dict, repr=False)

    @property
    def is_person(self) -> bool:
        """A person acting through their own token or signed-in session."""
        return self.user is not None and self.kind in {PrincipalKind.TOKEN, PrincipalKind.SESSION}

    @property
    def lineage(self) -> str:
        """The minting chain of the token this principal acts with ('' without a token)."""
        return self.token.lineage if self.token is not None else ""

    @property
    def member_user(self):
        """Whose memberships decide what this principal may address (and see)."""
        return self.user if self.user is not None else self.acting_for

    @property
    def actor_id(self) -> str:
        """The public identity recorded in audit rows."""
        if self.kind == PrincipalKind.SYSTEM:
            return f"system:{self.system_name}"
        if self.kind == PrincipalKind.RUNNER:
            return self.system_name
        if self.token is not None:
            return self.token.public_id
        if self.user is not None:
            return self.user.public_id
        if self.kind == PrincipalKind.LOCAL_AGENT:
            return "local-agent"
        return "anonymous"

    @property
    def agent_id(self) -> str:
        """Which agent this principal is: its token's lineage (a token minted by a token, or
        an OAuth client's refreshed one, is the same agent), else ``actor_id``."""
        return self.lineage or self.actor_id

    @property
    def holder_id(self) -> str:
        """Whoever holds the authority this principal acts with, which a bound per caller
        counts: the person (every token of theirs), an integration token with the tokens it
        minted (its lineage), else ``actor_id``. Per token, minting one would reset a bound."""
        if self.user is not None:
            return self.user.public_id
        if self.token is not None:
            return self.token.lineage
        return self.actor_id

    @property
    def actor_type(self) -> str:
        if self.kind in {PrincipalKind.SYSTEM, PrincipalKind.RUNNER}:
            return self.kind.value
        if self.token is not None:
            return "token"
        if self.kind == PrincipalKind.LOCAL_AGENT:
            return "local_agent"
        return "user" if self.user is not None else "anonymous"

    def membership_in(self, organization):
        """The person's membership in the organization (None for integration tokens); for the
        local agent, the local owner's."""
        if self.member_user is None:
            return None
        if organization.pk not in self._memberships:
            # Through the person's reverse relation (tenancy.Membership.user), so accounts,
            # below tenancy, names no tenancy module.
            self._memberships[organization.pk] = (
                self.member_user.memberships.filter(organization=organization)
                .select_related("user")
                .first()
            )
        return self._memberships[organization.pk]

    def membership_known(self, membership) -> None:
        """Keep ``membership``, the person's own read with its organization, so that
        ``membership_in`` asks nothing more for that organization."""
        if self.member_user is None or membership.user_id != self.member_user.pk:
            raise ValueError("not this principal's membership")
        self._memberships[membership.organization_id] = membership

    def role_in(self, organization) -> Role | None:
        membership = self.membership_in(organization)
        return Role(membership.role) if membership else None

    def scopes_in(self, organization) -> frozenset[str]:
        """Effective scopes: role ∩ token for a person, exactly the token's for an integration,
        the owner's role ∩ LOCAL_AGENT_SCOPES for the local agent; without
        ``ORGANIZATION_SCOPES`` for whoever sees only some of the organization's projects."""
        if self.kind == PrincipalKind.SYSTEM:
            return frozenset(SCOPES)
        if self.kind == PrincipalKind.LOCAL_AGENT:
            role = self.role_in(organization)
            return ROLE_SCOPES[role] & LOCAL_AGENT_SCOPES if role else frozenset()
        if self.token is not None and self.token.organization_id != organization.pk:
            return frozenset()
        token_scopes = frozenset(self.token.scopes) if self.token is not None else None
        if self.user is None:
            held = token_scopes or frozenset()
        else:
            membership = self.membership_in(organization)
            if membership is None:
                return frozenset()
            held = ROLE_SCOPES[Role(membership.role)]
            if token_scopes is not None:
                held &= token_scopes
        return within_reach(held, every_project=not self.limited_in(organization))

    def limited_in(self, organization) -> bool:
        """Whether this principal sees only some of the organization's projects: a member
        granted only some, a person's token limited to some, an integration token not given
        every project. The set itself is tenancy's ``ProjectQuerySet.limit_of``."""
        if self.kind == PrincipalKind.SYSTEM:
            return False
        if self.user is None and self.token is not None:
            return not self.token.all_projects
        membership = self.membership_in(organization)
        if membership is None:
            return True
        return not membership.all_projects or (
            self.token is not None and self.token.limited_to_projects
        )


def system_principal(name: str) -> Principal:
    """The actor recorded for a management command run by an operator on the server."""
    return Principal(PrincipalKind.SYSTEM, system_name=name)


def runner_principal(runner_id: str) -> Principal:
    """The actor recorded for a verified runner report; it holds no scope anywhere."""
    return Principal(PrincipalKind.RUNNER, system_name=runner_id)


def missing_scope_message(principal: Principal, scope: str, organization) -> str:
    """What a 403 says to a caller without ``scope`` in ``organization``: why it lacks it,
    where that is more than its role or token."""
    if principal.kind == PrincipalKind.LOCAL_AGENT:
        return (
            f"A local agent cannot do this: it needs the '{scope}' scope, which only a person "
            "holds. Sign in to the console, or use your own API token."
        )
    if scope in ORGANIZATION_SCOPES and principal.limited_in(organization):
        return f"This needs the '{scope}' scope, which {BEYOND_SOME_PROJECTS}."
    return (
        f"This needs the '{scope}' scope, which your role or token does not hold in this "
        "organization."
    )
