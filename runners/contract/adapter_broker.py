"""The broker beside the sandbox (CRED-3): its signed request and the signed answer.

A workload calls an adapter through a Unix socket its runner mounts into the sandbox
(``runners.adapter_broker``). The runner's broker holds no credential and has no network:
it signs the request with the runner's key (``kestrel-adapter-request+jwt``: which runner,
which running call and command, a request id, the request as the workload made it) and
sends it to the control plane (task ``control.adapter_request``). The control plane
answers with a token signed by the control key (``kestrel-adapter-answer+jwt``), pushed
onto a Redis list in the runner's pool namespace (``reply_key``), bound to the request
id, the call and the pool's audience. Both tiers import this module.

Verification is as strict as for commands and reports (``runners.contract.tokens``): EdDSA
only, exact header and claim set, typed claims, a time window.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from runners.contract.broker_access import pool_namespace
from runners.contract.names import COMMAND_ISSUER, RESULT_AUDIENCE, command_audience
from runners.contract.tokens import (
    CONTROL_KID,
    ProtocolError,
    _check_time_window,
    _is_int,
    _is_public_id,
    _is_sha256,
    _is_text,
    _require_claim_set,
    _sign,
    _unverified_header,
    _verified_parts,
    _with_lifetime,
)

__all__ = [
    "ADAPTER_ANSWER_CLAIMS",
    "ADAPTER_ANSWER_TYP",
    "ADAPTER_REQUEST_CLAIMS",
    "ADAPTER_REQUEST_FIELDS",
    "ADAPTER_REQUEST_TYP",
    "ANSWER_OUTCOMES",
    "MAX_ADAPTER_REQUEST_BYTES",
    "MAX_ANSWER_BYTES",
    "MAX_REQUEST_LIFETIME_SECONDS",
    "AdapterAnswer",
    "AdapterBrokerRefused",
    "AdapterRequest",
    "check_adapter_request",
    "reply_key",
    "sign_adapter_answer",
    "sign_adapter_request",
    "unverified_request_runner_id",
    "verify_adapter_answer",
    "verify_adapter_request",
]

ADAPTER_REQUEST_TYP = "kestrel-adapter-request+jwt"
ADAPTER_ANSWER_TYP = "kestrel-adapter-answer+jwt"

# What the workload sends on the socket, as one JSON object; anything else is refused.
ADAPTER_REQUEST_FIELDS = frozenset(
    {"adapter", "operation", "args", "credential", "connection", "idempotency_key"}
)
# One request as the workload wrote it (the broker reads no more per connection).
MAX_ADAPTER_REQUEST_BYTES = 64 * 1024
# One answer as the control plane signs it: the adapter's bounded result and the JSON
# around it, in base64.
MAX_ANSWER_BYTES = 4 * 1024 * 1024
# A request is valid as long as the longest call could wait for it (a person deciding).
MAX_REQUEST_LIFETIME_SECONDS = 3600

ADAPTER_REQUEST_CLAIMS = frozenset(
    {"iss", "aud", "iat", "exp", "jti", "call_id", "command_digest", "request"}
)
ADAPTER_ANSWER_CLAIMS = frozenset(
    {
        "iss",
        "aud",
        "iat",
        "exp",
        "jti",
        "request_id",
        "call_id",
        "action",
        "outcome",
        "result",
        "error",
    }
)
# The child action's terminal state, or "refused" when the control plane took no action.
ANSWER_OUTCOMES = frozenset({"succeeded", "failed", "denied", "expired", "cancelled", "refused"})

_REQUEST_ID = re.compile(r"^req_[0-9a-f]{32}$")
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$")
_REFERENCE = {"credential": re.compile(r"^crd_[A-Za-z0-9]{1,64}$"),
              "connection": re.compile(r"^con_[A-Za-z0-9]{1,64}$")}  # fmt: skip
_IDEMPOTENCY_KEY = re.compile(r"^[\x21-\x7e]{1,255}$")


class AdapterBrokerRefused(ProtocolError):
    """A brokered adapter request or answer that must not be acted on.

    Codes: bad_signature, wrong_runner, wrong_audience, expired, not_yet_valid, malformed,
    invalid_request (the workload's request itself: its field names the part).
    """


@dataclass(frozen=True)
class AdapterRequest:
    """A verified brokered request; field names are the claim names. ``jti`` is the request
    id, ``call_id`` the running call (its command is ``command_digest``) it came from."""

    iss: str
    aud: str
    iat: int
    exp: int
    jti: str
    call_id: str
    command_digest: str
    request: dict[str, Any]

    @property
    def runner_id(self) -> str:
        return self.iss

    @property
    def request_id(self) -> str:
        return self.jti


@dataclass(frozen=True)
class AdapterAnswer:
    """A verified answer: the child action's outcome, its result or error."""

    iss: str
    aud: str
    iat: int
    exp: int
    jti: str
    request_id: str
    call_id: str
    action: str | None
    outcome: str
    result: Any
    error: dict[str, str] | None


def reply_key(pool: str, request_id: str) -> str:
    """The Redis list the answer to ``request_id`` is pushed on: in the pool's namespace,
    the only keys a runner's broker user may read (``runners.contract.broker_access``)."""
    return f"{pool_namespace(pool)}adapter-reply:{request_id}"


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


def check_adapter_request(request: Any) -> dict[str, Any]:
    """The workload's request, checked for shape only (the control plane judges the rest:
    the registry, the arguments, the credential, the policy). Raises
    ``AdapterBrokerRefused("invalid_request", ...)`` naming the field."""

    def refuse(field: str, reason: str) -> None:
        raise AdapterBrokerRefused("invalid_request", f"{field}: {reason}")

    if not isinstance(request, dict):
        refuse("request", "must be a JSON object")
    unknown = sorted(set(request) - ADAPTER_REQUEST_FIELDS)
    if unknown:
        refuse(unknown[0], f"unknown field (the fields are {sorted(ADAPTER_REQUEST_FIELDS)})")
    for name in ("adapter", "operation"):
        if not isinstance(request.get(name), str) or not _NAME.fullmatch(request[name]):
            refuse(name, "required, a name (letters, digits, _ . -)")
    if not isinstance(request.get("args", {}), dict):
        refuse("args", "must be an object")
    references = [name for name in _REFERENCE if name in request]
    if len(references) > 1:
        refuse("credential", "name a credential or a connection, not both")
    for name in references:
        if not isinstance(request[name], str) or not _REFERENCE[name].fullmatch(request[name]):
            refuse(name, f"must be a {name} id ({_REFERENCE[name].pattern[1:5]}...)")
    key = request.get("idempotency_key")
    if key is not None and (not isinstance(key, str) or not _IDEMPOTENCY_KEY.fullmatch(key)):
        refuse("idempotency_key", "1 to 255 printable ASCII characters")
    return {name: request[name] for name in sorted(request)}


# --- the request: runner -> control plane ----------------------------------------------


def sign_adapter_request(
    *,
    call_id: str,
    command_digest: str,
    request: Mapping[str, Any],
    private_key: bytes | str | Ed25519PrivateKey,
    runner_id: str,
    lifetime_s: int,
    request_id: str | None = None,
    now: int | None = None,
) -> str:
    """Sign a brokered request as runner ``runner_id``; its lifetime is the call's wait."""
    payload = _with_lifetime(
        {
            "iss": runner_id,
            "aud": RESULT_AUDIENCE,
            "jti": request_id or new_request_id(),
            "call_id": call_id,
            "command_digest": command_digest,
            "request": dict(request),
        },
        lifetime=max(1, min(int(lifetime_s), MAX_REQUEST_LIFETIME_SECONDS)),
        now=now,
        not_before=False,
    )
    return _sign(payload, private_key, typ=ADAPTER_REQUEST_TYP, kid=runner_id)


def unverified_request_runner_id(token: Any) -> str:
    """The runner id a request claims (its ``kid``), NOT yet trusted: only to find the
    enrolled key that ``verify_adapter_request`` then checks it with."""
    bound = 2 * MAX_ADAPTER_REQUEST_BYTES
    header = _unverified_header(token, AdapterBrokerRefused, max_bytes=bound)
    kid = header.get("kid")
    if not isinstance(kid, str) or not re.fullmatch(r"run_[A-Za-z0-9_-]{1,124}", kid):
        raise AdapterBrokerRefused("malformed", "header kid must be a runner id (run_...)")
    return kid


def verify_adapter_request(
    token: Any,
    *,
    runner_public_key: bytes | str | Ed25519PublicKey,
    runner_id: str,
    now: float | None = None,
) -> AdapterRequest:
    """The brokered request in ``token`` if runner ``runner_id`` signed it for the control
    plane; raises ``AdapterBrokerRefused``. Whether the call runs there is the caller's."""
    header, claims = _verified_parts(
        token,
        runner_public_key,
        refused=AdapterBrokerRefused,
        typ=ADAPTER_REQUEST_TYP,
        max_bytes=2 * MAX_ADAPTER_REQUEST_BYTES,
    )
    if header.get("kid") != runner_id:
        raise AdapterBrokerRefused("wrong_runner", "header kid is not the expected runner id")
    _require_claim_set(claims, ADAPTER_REQUEST_CLAIMS, AdapterBrokerRefused)
    for name in ("iat", "exp"):
        _claim(_is_int(claims[name]) and claims[name] >= 0, name, "a whole number of seconds")
    _claim(claims["iss"] == runner_id, "iss", "the signing runner's id")
    _claim(_is_text(claims["aud"]), "aud", "a string")
    _claim(isinstance(claims["jti"], str) and bool(_REQUEST_ID.fullmatch(claims["jti"])),
           "jti", "a request id (req_ and 32 hex digits)")  # fmt: skip
    _claim(_is_public_id(claims["call_id"]), "call_id", "a public id")
    _claim(_is_sha256(claims["command_digest"]), "command_digest", "a sha256 hex digest")
    if claims["aud"] != RESULT_AUDIENCE:
        raise AdapterBrokerRefused("wrong_audience", f"a request is for {RESULT_AUDIENCE!r}")
    if claims["exp"] - claims["iat"] > MAX_REQUEST_LIFETIME_SECONDS:
        raise AdapterBrokerRefused("malformed", "a request lives at most an hour")
    _check_time_window(claims, now, AdapterBrokerRefused)
    claims["request"] = check_adapter_request(claims["request"])
    return AdapterRequest(**claims)


# --- the answer: control plane -> runner ------------------------------------------------


def sign_adapter_answer(
    *,
    pool: str,
    request_id: str,
    call_id: str,
    action: str | None,
    outcome: str,
    result: Any,
    error: Mapping[str, str] | None,
    private_key: bytes | str | Ed25519PrivateKey,
    ttl: int = 300,
    now: int | None = None,
) -> str:
    """Sign the answer to a brokered request as the control plane (the command key)."""
    payload = _with_lifetime(
        {
            "iss": COMMAND_ISSUER,
            "aud": command_audience(pool),
            "jti": uuid.uuid4().hex,
            "request_id": request_id,
            "call_id": call_id,
            "action": action,
            "outcome": outcome,
            "result": result,
            "error": dict(error) if error is not None else None,
        },
        lifetime=ttl,
        now=now,
        not_before=False,
    )
    return _sign(payload, private_key, typ=ADAPTER_ANSWER_TYP, kid=CONTROL_KID)


def verify_adapter_answer(
    token: Any,
    *,
    control_public_key: bytes | str | Ed25519PublicKey,
    pool: str,
    request_id: str,
    call_id: str,
    now: float | None = None,
) -> AdapterAnswer:
    """The answer in ``token`` if the control plane signed it for this pool, this request
    and this call; raises ``AdapterBrokerRefused``."""
    header, claims = _verified_parts(
        token,
        control_public_key,
        refused=AdapterBrokerRefused,
        typ=ADAPTER_ANSWER_TYP,
        max_bytes=MAX_ANSWER_BYTES,
    )
    if header.get("kid") != CONTROL_KID:
        raise AdapterBrokerRefused("malformed", f"header kid must be {CONTROL_KID!r}")
    _require_claim_set(claims, ADAPTER_ANSWER_CLAIMS, AdapterBrokerRefused)
    for name in ("iat", "exp"):
        _claim(_is_int(claims[name]) and claims[name] >= 0, name, "a whole number of seconds")
    _claim(claims["iss"] == COMMAND_ISSUER, "iss", f"{COMMAND_ISSUER!r}")
    if claims["aud"] != command_audience(pool):
        raise AdapterBrokerRefused("wrong_audience", "the answer is for another pool")
    if claims["request_id"] != request_id or claims["call_id"] != call_id:
        raise AdapterBrokerRefused("malformed", "the answer is for another request")
    _claim(claims["action"] is None or _is_public_id(claims["action"]), "action", "an id")
    _claim(claims["outcome"] in ANSWER_OUTCOMES, "outcome", f"one of {sorted(ANSWER_OUTCOMES)}")
    error = claims["error"]
    if claims["outcome"] == "succeeded":
        _claim(error is None, "error", "null when the outcome is succeeded")
    else:
        _claim(
            isinstance(error, dict)
            and set(error) == {"code", "message"}
            and all(isinstance(value, str) for value in error.values()),
            "error",
            'an object {"code", "message"}',
        )
    _check_time_window(claims, now, AdapterBrokerRefused)
    return AdapterAnswer(**claims)


def _claim(ok: bool, name: str, expected: str) -> None:
    if not ok:
        raise AdapterBrokerRefused("malformed", f"claim {name!r} must be {expected}")
