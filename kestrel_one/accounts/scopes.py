"""Token scopes and what each organization role may hold.

A request is allowed an operation when the operation's scope is in the caller's effective
scopes: for a person, the role's scopes intersected with the token's; for an integration token
(no person), exactly the token's scopes, which could not exceed its creator's when it was made.
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
    "org:admin": "Manage members, tokens, environments, projects and policies.",
    "projects:read": "Read threads, actions, events and receipts in visible projects.",
    "projects:write": "Create threads and request actions in visible projects.",
    "actions:approve": "Approve or deny actions and accept plans (people only).",
    "audit:read": "Read the organization's audit log.",
}

ROLE_SCOPES: dict[Role, frozenset[str]] = {
    Role.OWNER: frozenset(SCOPES),
    Role.ADMIN: frozenset(SCOPES),
    Role.MEMBER: frozenset({"org:read", "projects:read", "projects:write", "actions:approve"}),
    Role.VIEWER: frozenset({"org:read", "projects:read"}),
    Role.AUDITOR: frozenset({"org:read", "audit:read"}),
}

# Who may grant a role: owners grant any role; admins any but owner.
# An auditor ranks with viewers: it holds no write scope, so it never grants anything, and
# an admin may appoint one.
ROLE_RANK = {Role.VIEWER: 0, Role.AUDITOR: 0, Role.MEMBER: 1, Role.ADMIN: 2, Role.OWNER: 3}


def unknown_scopes(scopes: list[str]) -> list[str]:
    return [scope for scope in scopes if scope not in SCOPES]
