"""A runner's workspace inventory: the projects whose workspaces its host keeps.

A deleted project's workspace is removed by a ``project.delete`` control message, which is
a broadcast: a host that is down, or not yet subscribed, misses it. So every runner also
tells the control plane, when it starts and then every ``KESTREL_WORKSPACE_INVENTORY_SECONDS``,
which workspaces it keeps (``runners.inventory``), signed with its own key
(``sign_workspace_inventory``, typ ``kestrel-workspaces+jwt``), as task
``control.runner_workspaces`` (WORKSPACES_TASK) on the control queue. The control plane
verifies it (``verify_workspace_inventory``) against the enrolled key, as a heartbeat, and
sends ``project.delete`` again, to the runner's pool, for every listed project it has
recorded as deleted. An inventory is never a permission: the answer can only ever be the
removal of a deleted project's files.

A host with more workspaces than one token lists (``MAX_INVENTORY_PROJECTS``) sends
several; ``part`` and ``parts`` number them, for the logs only.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from runners.contract.names import RESULT_AUDIENCE
from runners.contract.tokens import (
    HEARTBEAT_LIFETIME_SECONDS,
    ResultRefused,
    _check_time_window,
    _is_int,
    _is_public_id,
    _is_text,
    _require,
    _require_claim_set,
    _sign,
    _verified_parts,
    _with_lifetime,
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
# It says what the host keeps now, like a heartbeat; a late one is refused as expired.
INVENTORY_LIFETIME_SECONDS = HEARTBEAT_LIFETIME_SECONDS


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
    payload = _with_lifetime(
        {
            "iss": runner_id,
            "aud": RESULT_AUDIENCE,
            "pool": pool,
            "projects": list(projects),
            "part": part,
            "parts": parts,
        },
        lifetime=INVENTORY_LIFETIME_SECONDS,
        now=now,
        not_before=False,
    )
    payload["jti"] = uuid.uuid4().hex
    return _sign(payload, private_key_pem, typ=INVENTORY_TYP, kid=runner_id)


def verify_workspace_inventory(
    token: str,
    *,
    runner_public_key: bytes | str | Ed25519PublicKey,
    runner_id: str,
    now: float | None = None,
) -> WorkspaceInventory:
    """The inventory in ``token`` if runner ``runner_id`` signed it; the key is looked up as
    for a report (``unverified_runner_id``). Raises ``ResultRefused``."""
    header, claims = _verified_parts(
        token, runner_public_key, refused=ResultRefused, typ=INVENTORY_TYP
    )
    if header.get("kid") != runner_id or claims.get("iss") != runner_id:
        raise ResultRefused("wrong_runner", "the inventory is not from the expected runner")
    _require_claim_set(claims, INVENTORY_CLAIMS, ResultRefused)
    for name in ("iat", "exp"):
        _require(
            _is_int(claims[name]) and claims[name] >= 0,
            name,
            "a whole number of seconds",
            ResultRefused,
        )
    _require(_is_text(claims["jti"]), "jti", "a string", ResultRefused)
    _require(_is_public_id(claims["pool"]), "pool", "a pool name", ResultRefused)
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
    if claims["aud"] != RESULT_AUDIENCE:
        raise ResultRefused("wrong_audience", f"an inventory is for {RESULT_AUDIENCE!r}")
    if claims["exp"] - claims["iat"] > INVENTORY_LIFETIME_SECONDS:
        raise ResultRefused("malformed", "an inventory lives at most two minutes")
    _check_time_window(claims, now, ResultRefused)
    return WorkspaceInventory(**{**claims, "projects": tuple(claims["projects"])})


_PROJECTS = f"a list of at most {MAX_INVENTORY_PROJECTS} distinct project ids"


def _is_project_list(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) <= MAX_INVENTORY_PROJECTS
        and all(_is_public_id(item) for item in value)
        and len(set(value)) == len(value)
    )
