"""Token scopes and what each organization role may hold.

A request is allowed an operation when the operation's scope is in the caller's effective
scopes: for a person, the role's scopes intersected with the token's; for an integration token
(no person), exactly the token's scopes, which could not exceed its creator's when it was made;
for the single-host local agent, the owner's scopes intersected with ``LOCAL_AGENT_SCOPES``.

Each administrative power is a scope of its own, so an integration can be given exactly one.
"""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    OWNER = "owner"
    ADMIN = "admin"
    MEMBER = "member"
    VIEWER = "viewer"
    # Reads the organization and its audit log; changes nothing (no retention, no members).
    AUDITOR = "auditor"


SCOPES: dict[str, str] = {
    "org:read": "Read the organization, its members, environments, projects and own tokens.",
    "projects:read": "Read threads, actions, events and receipts in visible projects.",
    "projects:write": "Create threads and request actions in visible projects.",
    "actions:approve": "Approve or deny actions and accept plans and tasks (people only; put "
    "on a token only from a console session or on the server).",
    "audit:read": "Read the organization's audit log.",
    "tokens:write": "Create and revoke your own tokens, never with a scope you lack.",
    "tokens:admin": "See and revoke everyone's tokens, and create integration tokens.",
    "members:write": "Add members, change their roles and projects, and remove them.",
    "environments:write": "Create, change and delete environments.",
    "projects:manage": "Create, change and delete projects.",
    "policies:write": "Publish environment and project policies.",
    "runners:write": "See and revoke the runners that serve the organization.",
    "webhooks:write": "Manage webhook endpoints, their secrets and deliveries.",
    "retention:write": "Change how long events, artifacts, checkpoints and audit are kept.",
    "credentials:read": "See the organization's credentials (names, adapters, fingerprints).",
    "credentials:write": "Create, rotate and revoke the organization's credentials.",
    "connections:write": "Create, see and revoke your own App connections (nobody else's).",
    "mcp:write": "Install, change and remove MCP servers, review their tools, author their "
    "egress and accept their network risk (accepting a tool's new definition or a network "
    "risk, and unmarking a dangerous tool, also take a person with actions:approve).",
}

# Scopes over what belongs to the whole organization, not to a project: its audit log,
# everyone's tokens, environments and every policy (the ceilings, the surfaces, and the
# org-admin policy console that edits projects' policies too), runners, webhooks (they carry
# every project's events), retention, credentials and MCP servers. A principal that sees only
# some projects never holds them, whatever its role or token says (``Principal.scopes_in``):
# a power over the organization would reach the projects it cannot see. What it keeps is
# project-sized: reading and working in its projects, approving there, its own tokens and
# connections, and members and projects within its own set (tenancy's grant checks).
ORGANIZATION_SCOPES = frozenset(
    {
        "audit:read",
        "tokens:admin",
        "environments:write",
        "policies:write",
        "runners:write",
        "webhooks:write",
        "retention:write",
        "credentials:read",
        "credentials:write",
        "mcp:write",
    }
)

ROLE_SCOPES: dict[Role, frozenset[str]] = {
    Role.OWNER: frozenset(SCOPES),
    Role.ADMIN: frozenset(SCOPES),
    Role.MEMBER: frozenset(
        {
            "org:read",
            "projects:read",
            "projects:write",
            "actions:approve",
            "tokens:write",
            "connections:write",
        }
    ),
    # Viewers and auditors make their own read tokens: without one they cannot use the API.
    Role.VIEWER: frozenset({"org:read", "projects:read", "tokens:write"}),
    Role.AUDITOR: frozenset({"org:read", "audit:read", "tokens:write"}),
}


# Why whoever sees only some projects lacks one of ``ORGANIZATION_SCOPES``: every refusal that
# says so says it in these words, after the scope's name.
BEYOND_SOME_PROJECTS = (
    "acts on the whole organization: nobody limited to some of its projects holds it, "
    "whatever their role or token says"
)


def within_reach(held: frozenset[str], *, every_project: bool) -> frozenset[str]:
    """``held`` as far as its holder may use it: all of it if they see every project, else
    what stays within projects (without ``ORGANIZATION_SCOPES``)."""
    return held if every_project else held - ORGANIZATION_SCOPES


def role_scopes(role: Role, *, every_project: bool) -> frozenset[str]:
    """What a member with ``role`` holds, seeing every project or only some."""
    return within_reach(ROLE_SCOPES[role], every_project=every_project)


# Single-host mode: what a loopback caller without a person's token (the local agent) may do.
# It reads, makes threads and requests actions; every power over authority (approving,
# accepting plans, policies, members, tokens, runners, webhooks, retention) needs a person.
LOCAL_AGENT_SCOPES = frozenset({"org:read", "projects:read", "projects:write"})

# Who may grant a role: owners grant any role; admins any but owner.
# An auditor ranks with viewers: it holds no scope that changes the organization, so it
# never grants anything, and an admin may appoint one.
ROLE_RANK = {Role.VIEWER: 0, Role.AUDITOR: 0, Role.MEMBER: 1, Role.ADMIN: 2, Role.OWNER: 3}


def outranks(actor_role: Role | None, target_role: Role) -> bool:
    """Whether a caller may change or remove someone holding ``target_role``: only from a
    higher rank, except that owners manage owners (an organization must be able to replace
    one). ``None`` is an integration token, which acts with an admin's rank.
    Equal ranks below owner may not: an admin never narrows or removes another admin."""
    actor = ROLE_RANK[actor_role] if actor_role is not None else ROLE_RANK[Role.ADMIN]
    if actor_role == Role.OWNER and target_role == Role.OWNER:
        return True
    return actor > ROLE_RANK[target_role]


# Scopes that carry a person's own authority: put on a token only from a signed-in console
# session or by an operator's command on the server, never by another token (POL-5).
PERSON_ONLY_SCOPES = frozenset({"actions:approve"})


def unknown_scopes(scopes: list[str]) -> list[str]:
    return [scope for scope in scopes if scope not in SCOPES]
