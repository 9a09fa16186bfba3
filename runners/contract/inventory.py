"""A runner's workspace inventory: the projects whose workspaces its host keeps.

A deleted project's workspace is removed by a ``project.delete`` control message, which is
a broadcast: a host that is down, or not yet subscribed, misses it. So every runner also
tells the control plane, when it starts and then every ``KESTREL_WORKSPACE_INVENTORY_SECONDS``,
which workspaces it keeps (``runners.inventory``), signed with its own key
(``sign_workspace_inventory``, typ ``kestrel-workspaces+jwt``), as task
``control.runner_workspaces`` (WORKSPACES_TASK) on the reports queue. The control plane
verifies it (``verify_workspace_inventory``) against the enrolled key, as a heartbeat, and
sends ``project.delete`` again, to the runner's pool, for every listed project it has
recorded as deleted. An inventory is never a permission: the answer can only ever be the
removal of a deleted project's files.

A host with more workspaces than one token lists (``MAX_INVENTORY_PROJECTS``) sends
several; ``part`` and ``parts`` number them, for the logs only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from runners.contract.tokens import (
    ResultRefused,
    _is_int,
    _is_public_id,
    _require,
    _sign_runner_notice,
    _verified_runner_notice,
)

__all__ = [
    "INVENTORY_CLAIMS",
    "INVENTORY_TYP",
    "MAX_INVENTORY_PROJECTS",
    "WorkspaceInventory",
    "sign_workspace_inventory",
    "verify_workspace_inventory",
]

INVENTORY_TYP = "kestrel-workspaces+jwt"
INVENTORY_CLAIMS = frozenset(
    {"iss", "aud", "iat", "exp", "jti", "pool", "projects", "part", "parts"}
)
# Project ids per token: about 30 bytes each, so a token stays well under 100 kB.
MAX_INVENTORY_PROJECTS = 2000


@dataclass(frozen=True)
class WorkspaceInventory:
    """A verified inventory: runner ``iss`` of ``pool`` keeps the workspaces of ``projects``."""

    iss: str
    aud: str
    iat: int
    exp: int
    jti: str
    pool: str
    projects: tuple[str, ...]
    part: int
    parts: int

    @property
    def runner_id(self) -> str:
        return self.iss


def sign_workspace_inventory(
    *,
    pool: str,
    projects: Sequence[str],
    part: int,
    parts: int,
    private_key_pem: bytes | str | Ed25519PrivateKey,
    runner_id: str,
    now: int | None = None,
) -> str:
    """Sign part ``part`` of ``parts`` of runner ``runner_id``'s workspace inventory."""
    return _sign_runner_notice(
        {"pool": pool, "projects": list(projects), "part": part, "parts": parts},
        typ=INVENTORY_TYP,
        private_key_pem=private_key_pem,
        runner_id=runner_id,
        now=now,
    )


def verify_workspace_inventory(
    token: str,
    *,
    runner_public_key: bytes | str | Ed25519PublicKey,
    runner_id: str,
    now: float | None = None,
) -> WorkspaceInventory:
    """The inventory in ``token`` if runner ``runner_id`` signed it; the key is looked up as
    for a report (``unverified_runner_id``). Raises ``ResultRefused``."""
    claims = _verified_runner_notice(
        token,
        runner_public_key=runner_public_key,
        runner_id=runner_id,
        typ=INVENTORY_TYP,
        claim_set=INVENTORY_CLAIMS,
        what="inventory",
        now=now,
    )
    _require(_is_project_list(claims["projects"]), "projects", _PROJECTS, ResultRefused)
    _require(
        _is_int(claims["parts"]) and claims["parts"] >= 1, "parts", "an integer >= 1", ResultRefused
    )
    _require(
        _is_int(claims["part"]) and 1 <= claims["part"] <= claims["parts"],
        "part",
        "an integer from 1 to parts",
        ResultRefused,
    )
    return WorkspaceInventory(**{**claims, "projects": tuple(claims["projects"])})


_PROJECTS = f"a list of at most {MAX_INVENTORY_PROJECTS} distinct project ids"


def _is_project_list(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) <= MAX_INVENTORY_PROJECTS
        and all(_is_public_id(item) for item in value)
        and len(set(value)) == len(value)
    )
