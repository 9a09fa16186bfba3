"""Signed tokens between the control plane and runners: commands, results, heartbeats.

Both directions are compact JWS tokens signed with Ed25519 ("EdDSA") through PyJWT. The
control plane signs a *command* for one call; a runner signs a *result* (a report) about
it. This module is shared by both sides (it is part of ``runners.contract``).

Verification is strict on purpose (RUN-1, RUN-2): only ``EdDSA`` is accepted (never
``none`` or an HMAC algorithm that could be fed the public key), the header and the claim
set must be exactly the documented ones, JSON with duplicate keys or NaN is refused, and
every failure raises one exception type carrying a stable ``code``. Payloads are signed as
canonical JSON, so the bytes that were signed are the bytes that were hashed.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import jwt
import jwt.exceptions
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from runners.contract.canonical import arguments_digest, canonical_json, token_digest
from runners.contract.errors import InvalidArguments, RunnerError, UnknownTool
from runners.contract.names import (
    COMMAND_ISSUER,
    RESULT_AUDIENCE,
    command_audience,
)
from runners.contract.registry import get_tool, validate_args
from runners.contract.toolspec import Tier

__all__ = [
    "ALGORITHM",
    "COMMAND_CLAIMS",
    "COMMAND_TYP",
    "CONTROL_CLAIMS",
    "CONTROL_KID",
    "CONTROL_TYP",
    "CONTROL_TYPES",
    "DEFAULT_MAX_REPORT_BYTES",
    "HEARTBEAT_CLAIMS",
    "HEARTBEAT_INTERVAL_SECONDS",
    "HEARTBEAT_LIFETIME_SECONDS",
    "HEARTBEAT_SANDBOXES",
    "HEARTBEAT_TYP",
    "LEEWAY_SECONDS",
    "LIMIT_KEYS",
    "MAX_COMMAND_LIFETIME_SECONDS",
    "MAX_CONTROL_LIFETIME_SECONDS",
    "RESULT_CLAIMS",
    "RESULT_LIFETIME_SECONDS",
    "RESULT_TYP",
    "Command",
    "CommandRefused",
    "ControlMessage",
    "ControlRefused",
    "Heartbeat",
    "ProtocolError",
    "ResultRefused",
    "RunnerReport",
    "generate_private_key_pem",
    "load_private_key",
    "load_public_key",
    "public_key_pem",
    "sign_command",
    "sign_control_message",
    "sign_heartbeat",
    "sign_result",
    "strict_json_loads",
    "unverified_call_id",
    "unverified_runner_id",
    "verify_command",
    "verify_control_message",
    "verify_heartbeat",
    "verify_result",
]

ALGORITHM = "EdDSA"
COMMAND_TYP = "kestrel-command+jwt"
RESULT_TYP = "kestrel-result+jwt"
# Control messages (control plane -> every runner of a pool) are a separate token type: a
# command verifier refuses them by typ and claim set, and the other way round.
CONTROL_TYP = "kestrel-control+jwt"
CONTROL_KID = "control"
# A runner's heartbeat (runner -> control plane): it is alive, and which sandbox backend it
# found. Its own type, so no verifier of reports or commands takes one for the other.
HEARTBEAT_TYP = "kestrel-heartbeat+jwt"

# Clock skew tolerated between the control plane and a runner host (both should run NTP).
LEEWAY_SECONDS = 5
# A command older than this cannot be valid even if its own exp says so; the control plane
# uses about 120 s. Single use of the call id is enforced far longer (runners.callstate).
MAX_COMMAND_LIFETIME_SECONDS = 3600
RESULT_LIFETIME_SECONDS = 3600
# A control message is a notice, not work: it is only worth acting on soon after it was sent
# (the control plane uses 120 s). A late one is refused and the runner's own cleanup applies.
MAX_CONTROL_LIFETIME_SECONDS = 600
# A heartbeat says something about now; one that arrives late is refused as expired.
HEARTBEAT_LIFETIME_SECONDS = 120
# How often a runner sends one; the control plane counts a runner silent after a few missed.
HEARTBEAT_INTERVAL_SECONDS = 30.0
# The largest token of any kind either side reads at all (a command carries a restore
# archive, about 1.4 MB of base64, at most).
MAX_TOKEN_BYTES = 4 * 1024 * 1024
# A report error's optional ``details`` (canonical JSON), e.g. a changed MCP tool's definition.
MAX_ERROR_DETAILS_BYTES = 64 * 1024
# The default size budget of one signed report: what a runner fits its reports into
# (KESTREL_MAX_REPORT_BYTES, runners.report_budget) and what the control plane records at
# most (the setting of the same name). A runner's budget must not exceed the control plane's.
DEFAULT_MAX_REPORT_BYTES = 4 * 1024 * 1024
# A report over the control plane's limit is still verified, so that the call it answers can
# be ended as failed rather than left to look untaken; past this many times the limit it is
# not even read (it cannot have come from a runner that budgets its reports).
REPORT_READ_FACTOR = 4

COMMAND_CLAIMS = frozenset(
    {
        "iss",
        "aud",
        "iat",
        "nbf",
        "exp",
        "jti",
        "org",
        "env",
        "prj",
        "thr",
        "tool",
        "args",
        "args_salt",
        "args_digest",
        "policy_version",
        "limits",
        "attempt",
    }
)
RESULT_CLAIMS = frozenset(
    {
        "iss",
        "aud",
        "iat",
        "exp",
        "jti",
        "call_id",
        "command_digest",
        "attempt",
        "event",
        "outcome",
        "result",
        "error",
        "sandbox",
        "started_at",
        "finished_at",
    }
)

CONTROL_CLAIMS = frozenset(
    {"iss", "aud", "iat", "nbf", "exp", "jti", "type", "org", "env", "prj", "thr", "rsk"}
)
# What a control message may ask. Anything else is refused (fail closed). "thread.end" names
# a thread; "project.delete" (remove the project's workspace) names none (``thr`` null);
# "mcp.risk.end" (an MCP server's risk acceptance ended: stop the containers it let reach
# the network) names the acceptance in ``rsk`` and no project. ``rsk`` is null otherwise.
CONTROL_TYPES = frozenset({"thread.end", "project.delete", "mcp.risk.end"})
_PROJECT_CONTROL_TYPES = frozenset({"project.delete"})
_ENVIRONMENT_CONTROL_TYPES = frozenset({"mcp.risk.end"})

HEARTBEAT_CLAIMS = frozenset({"iss", "aud", "iat", "exp", "jti", "pool", "sandbox"})
# The backend a runner's probe found for process tools, or "none" (they then fail closed).
HEARTBEAT_SANDBOXES = frozenset({"docker", "bubblewrap", "none"})

# The limits a command carries; they become runners.sandbox.ExecLimits. The first five are
# required, tmp_mb is optional. Sizes and counts are integers (the engine wants whole
# megabytes and processes); timeout_s and cpus may be fractional.
LIMIT_KEYS = frozenset({"timeout_s", "memory_mb", "cpus", "pids", "output_kb", "tmp_mb"})
_REQUIRED_LIMIT_KEYS = LIMIT_KEYS - {"tmp_mb"}
_INTEGER_LIMIT_KEYS = frozenset({"memory_mb", "pids", "output_kb", "tmp_mb"})
_LIMIT_MINIMUMS = {"memory_mb": 8, "pids": 4}

# Public ids (org_..., prj_..., act_...) and runner ids (run_...): one safe token each,
# so they can name a Redis key, a workspace directory and a container label as they are.
_PUBLIC_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")
_RUNNER_ID = re.compile(r"^run_[A-Za-z0-9_-]{1,124}$")
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_MAX_TEXT = 1024


class ProtocolError(RunnerError):
    """A token that was refused; ``code`` is stable and safe to log and to branch on."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class CommandRefused(ProtocolError):
    """A command the runner must not act on.

    Codes: bad_signature, wrong_audience, expired, not_yet_valid, malformed,
    digest_mismatch, unknown_tool, invalid_arguments, replayed.
    """


class ControlRefused(ProtocolError):
    """A control message the runner must not act on.

    Codes: bad_signature, wrong_audience, expired, not_yet_valid, malformed, unknown_type.
    """


class ResultRefused(ProtocolError):
    """A runner report the control plane must not record.

    Codes: bad_signature, wrong_runner, wrong_audience, expired, not_yet_valid, malformed,
    too_large. ``signed_claims`` holds the claims (without ``result``) when the refusal came
    after the signature verified, so the caller can tell which call the runner answered;
    None otherwise.
    """

    def __init__(
        self, code: str, message: str, *, signed_claims: dict[str, Any] | None = None
    ) -> None:
        super().__init__(code, message)
        self.signed_claims = signed_claims


# --- keys ------------------------------------------------------------------------------


def generate_private_key_pem() -> bytes:
    """A new Ed25519 private key as unencrypted PKCS#8 PEM (store it 0600)."""
    return Ed25519PrivateKey.generate().private_bytes(
        encoding=serialization.Encoding.PEM,
        format=serialization.PrivateFormat.PKCS8,
        encryption_algorithm=serialization.NoEncryption(),
    )


def public_key_pem(private_pem: bytes | str | Ed25519PrivateKey) -> bytes:
    """The SubjectPublicKeyInfo PEM of a private key: what gets enrolled or distributed."""
    return (
        load_private_key(private_pem)
        .public_key()
        .public_bytes(
            encoding=serialization.Encoding.PEM,
            format=serialization.PublicFormat.SubjectPublicKeyInfo,
        )
    )


def load_private_key(pem: bytes | str | Ed25519PrivateKey) -> Ed25519PrivateKey:
    """An Ed25519 private key from PEM; any other key type is refused with ``ValueError``."""
    if isinstance(pem, Ed25519PrivateKey):
        return pem
    key = serialization.load_pem_private_key(_as_bytes(pem), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError("expected an Ed25519 private key")
    return key


def load_public_key(pem: bytes | str | Ed25519PublicKey) -> Ed25519PublicKey:
    """An Ed25519 public key from PEM; any other key type is refused with ``ValueError``."""
    if isinstance(pem, Ed25519PublicKey):
        return pem
    key = serialization.load_pem_public_key(_as_bytes(pem))
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError("expected an Ed25519 public key")
    return key


def _as_bytes(pem: bytes | str) -> bytes:
    return pem.encode("ascii") if isinstance(pem, str) else bytes(pem)


# --- commands --------------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    """A verified command: the claims as signed, the token itself and its digest.

    Field names are the claim names. ``command_digest`` is sha256 hex of ``raw``; the
    runner's results carry it so the control plane can match them to what it issued.
    """

    iss: str
    aud: str
    iat: int
    nbf: int
    exp: int
    jti: str
    org: str
    env: str
    prj: str
    thr: str | None
    tool: str
    args: dict[str, Any]
    args_salt: str
    args_digest: str
    policy_version: str
    limits: dict[str, int | float]
    attempt: int
    raw: str
    command_digest: str

    @property
    def call_id(self) -> str:
        return self.jti


def _with_lifetime(
    claims: Mapping[str, Any], *, lifetime: int, now: int | None, not_before: bool = True
) -> dict[str, Any]:
    """``claims`` with ``iat`` (now), ``nbf`` (``iat``) and ``exp`` (``iat + lifetime``) added
    where absent. A given ``iat`` that is not an integer (tests of the verifiers sign such
    tokens on purpose) is kept, and the others count from now."""
    issued = int(time.time()) if now is None else int(now)
    payload = dict(claims)
    payload.setdefault("iat", issued)
    base = payload["iat"] if _is_int(payload["iat"]) else issued
    if not_before:
        payload.setdefault("nbf", base)
    payload.setdefault("exp", base + int(lifetime))
    return payload


def sign_command(
    claims: Mapping[str, Any],
    private_key_pem: bytes | str | Ed25519PrivateKey,
    *,
    ttl: int = 120,
    now: int | None = None,
) -> str:
    """Sign a command as the control plane.

    ``iat``, ``nbf`` and ``exp`` (``iat + ttl``), ``args_salt`` (none) and ``args_digest``
    are filled in when absent; everything else is signed exactly as given (this function
    does not judge the claims, ``verify_command`` does).
    """
    payload = _with_lifetime(claims, lifetime=ttl, now=now)
    if "args" in payload:
        payload.setdefault("args_salt", "")
        payload.setdefault(
            "args_digest", arguments_digest(payload["args"], str(payload["args_salt"]))
        )
    return _sign(payload, private_key_pem, typ=COMMAND_TYP, kid=CONTROL_KID)


def verify_command(
    token: str,
    *,
    control_public_key: bytes | str | Ed25519PublicKey,
    pool: str,
    now: float | None = None,
) -> Command:
    """The command in ``token`` if the control plane signed it for ``pool`` and it holds.

    Checks, in order: the algorithm is EdDSA, the signature, the header (typ, kid), the
    exact claim set and each claim's type, the audience, the time window (``now``, default
    the current time, with ``LEEWAY_SECONDS``), ``args_digest`` against the arguments, the
    tool against the registry and the arguments against its schema. Anything else raises
    ``CommandRefused``. Single use of ``jti`` is the caller's job (it needs shared state).
    """
    claims = _verified_control_plane_claims(
        token,
        control_public_key,
        pool=pool,
        now=now,
        typ=COMMAND_TYP,
        claim_set=COMMAND_CLAIMS,
        check_types=_check_command_claim_types,
        max_lifetime=MAX_COMMAND_LIFETIME_SECONDS,
        refused=CommandRefused,
        what="command",
    )
    if arguments_digest(claims["args"], claims["args_salt"]) != claims["args_digest"]:
        raise CommandRefused("digest_mismatch", "args_digest does not match the arguments")
    try:
        tool = get_tool(claims["tool"])
    except UnknownTool as error:
        raise CommandRefused("unknown_tool", str(error)) from None
    if tool.tier != Tier.RUNNER:
        # A control-tier tool needs what a runner never holds (a credential): even a command
        # signed for it is refused before anything runs.
        raise CommandRefused("control_tier_tool", f"{tool.name} runs in the control tier only")
    try:
        claims["args"] = validate_args(tool.name, claims["args"])
    except InvalidArguments as error:
        raise CommandRefused("invalid_arguments", str(error)) from None
    return Command(**claims, raw=token, command_digest=token_digest(token))


def _check_command_claim_types(claims: Mapping[str, Any]) -> None:
    for name in ("iat", "nbf", "exp"):
        _require(_is_int(claims[name]) and claims[name] >= 0, name, "a whole number of seconds")
    _require(_is_text(claims["iss"]), "iss", "a string")
    _require(_is_text(claims["aud"]), "aud", "a string")
    for name in ("jti", "org", "env", "prj"):
        _require(_is_public_id(claims[name]), name, "a public id (letters, digits, '_', '-')")
    _require(claims["thr"] is None or _is_public_id(claims["thr"]), "thr", "a public id or null")
    _require(_is_text(claims["tool"]), "tool", "a string")
    _require(isinstance(claims["args"], dict), "args", "an object")
    _require(
        claims["args_salt"] == "" or _is_sha256(claims["args_salt"]),
        "args_salt",
        "empty or 64 lowercase hex digits",
    )
    _require(_is_sha256(claims["args_digest"]), "args_digest", "a lowercase sha256 hex digest")
    _require(_is_text(claims["policy_version"]), "policy_version", "a non-empty string")
    _require(_is_int(claims["attempt"]) and claims["attempt"] >= 1, "attempt", "an integer >= 1")
    _check_limits(claims["limits"])


def _check_limits(limits: Any) -> None:
    _require(isinstance(limits, dict), "limits", "an object")
    unknown = sorted(set(limits) - LIMIT_KEYS)
    _require(not unknown, "limits", f"unknown keys {unknown}")
    missing = sorted(_REQUIRED_LIMIT_KEYS - set(limits))
    _require(not missing, "limits", f"missing keys {missing}")
    for name, value in limits.items():
        kind = "an integer" if name in _INTEGER_LIMIT_KEYS else "a number"
        number_ok = _is_int(value) if name in _INTEGER_LIMIT_KEYS else _is_number(value)
        _require(number_ok and value > 0, f"limits.{name}", f"{kind} > 0")
        minimum = _LIMIT_MINIMUMS.get(name)
        _require(minimum is None or value >= minimum, f"limits.{name}", f"at least {minimum}")


def _check_control_claim_types(claims: Mapping[str, Any]) -> None:
    for name in ("iat", "nbf", "exp"):
        _require(
            _is_int(claims[name]) and claims[name] >= 0,
            name,
            "a whole number of seconds",
            ControlRefused,
        )
    for name in ("iss", "aud", "type"):
        _require(_is_text(claims[name]), name, "a string", ControlRefused)
    for name in ("jti", "org", "env"):
        _require(
            _is_public_id(claims[name]),
            name,
            "a public id (letters, digits, '_', '-')",
            ControlRefused,
        )
    # Which of prj, thr and rsk a type names; the others must be null.
    kind = claims["type"]
    if kind in _ENVIRONMENT_CONTROL_TYPES:
        named = {"rsk"}
    elif kind in _PROJECT_CONTROL_TYPES:
        named = {"prj"}
    else:
        named = {"prj", "thr"}
    for name in ("prj", "thr", "rsk"):
        if name in named:
            _require(
                _is_public_id(claims[name]),
                name,
                "a public id (letters, digits, '_', '-')",
                ControlRefused,
            )
        else:
            _require(claims[name] is None, name, f"null for a {kind!r} message", ControlRefused)


def _verified_control_plane_claims(
    token: Any,
    public_key: bytes | str | Ed25519PublicKey,
    *,
    pool: str,
    now: float | None,
    typ: str,
    claim_set: frozenset[str],
    check_types: Callable[[Mapping[str, Any]], None],
    max_lifetime: int,
    refused: type[ProtocolError],
    what: str,
) -> dict[str, Any]:
    """The claims of a token the control plane signed for ``pool``'s runners (a command or
    a control message), after the checks both share, in this order: EdDSA and the
    signature, the header (``typ``, kid ``control``), the exact claim set and each claim's
    type, the issuer, the audience, the lifetime and the time window."""
    header, claims = _verified_parts(token, public_key, refused=refused, typ=typ)
    if header.get("kid") != CONTROL_KID:
        raise refused("malformed", f"header kid must be {CONTROL_KID!r}")
    _require_claim_set(claims, claim_set, refused)
    check_types(claims)
    if claims["iss"] != COMMAND_ISSUER:
        raise refused("malformed", f"iss must be {COMMAND_ISSUER!r}")
    if claims["aud"] != command_audience(pool):
        raise refused(
            "wrong_audience", f"{what} is for {claims['aud']!r}, not {command_audience(pool)!r}"
        )
    if claims["exp"] - claims["iat"] > max_lifetime:
        raise refused("malformed", f"a {what} may live at most {max_lifetime} s")
    _check_time_window(claims, now, refused)
    return claims


# --- control messages ------------------------------------------------------------------


@dataclass(frozen=True)
class ControlMessage:
    """A verified control message: ``type`` says what to do, the rest whom it concerns.

    ``thread.end``: the thread ``thr`` of project ``prj`` (in ``org``/``env``) has ended; a
    runner removes what it keeps warm for it. ``project.delete``: project ``prj`` was deleted
    (``thr`` is None); a runner removes its workspace. ``mcp.risk.end``: the MCP risk
    acceptance ``rsk`` (in ``org``/``env``; ``prj`` and ``thr`` None) was withdrawn, expired
    or voided; a runner stops every server container it started under it, so that none keeps
    the network it gave. Field names are the claim names.
    """

    iss: str
    aud: str
    iat: int
    nbf: int
    exp: int
    jti: str
    type: str
    org: str
    env: str
    prj: str | None
    thr: str | None
    rsk: str | None


def sign_control_message(
    claims: Mapping[str, Any],
    private_key_pem: bytes | str | Ed25519PrivateKey,
    *,
    ttl: int = 120,
    now: int | None = None,
) -> str:
    """Sign a control message as the control plane (same key and ``kid`` as commands).

    ``iss``, ``iat``, ``nbf``, ``exp`` (``iat + ttl``) and a random ``jti`` are filled in when
    absent; everything else is signed as given (``verify_control_message`` judges it).
    """
    payload = _with_lifetime({"iss": COMMAND_ISSUER, **claims}, lifetime=ttl, now=now)
    payload.setdefault("jti", f"ctl_{uuid.uuid4().hex}")
    return _sign(payload, private_key_pem, typ=CONTROL_TYP, kid=CONTROL_KID)


def verify_control_message(
    token: Any,
    *,
    control_public_key: bytes | str | Ed25519PublicKey,
    pool: str,
    now: float | None = None,
) -> ControlMessage:
    """The control message in ``token`` if the control plane signed it for ``pool``.

    The same checks as ``verify_command``, in the same order: EdDSA only, the signature,
    the header (typ ``kestrel-control+jwt``, kid ``control``), the exact claim set and types,
    the audience, the lifetime and time window; then the ``type`` must be one this runner
    knows. Anything else raises ``ControlRefused``. A replay within the lifetime repeats an
    idempotent notice (the thread stays ended), so there is no single-use check.
    """
    claims = _verified_control_plane_claims(
        token,
        control_public_key,
        pool=pool,
        now=now,
        typ=CONTROL_TYP,
        claim_set=CONTROL_CLAIMS,
        check_types=_check_control_claim_types,
        max_lifetime=MAX_CONTROL_LIFETIME_SECONDS,
        refused=ControlRefused,
        what="control message",
    )
    if claims["type"] not in CONTROL_TYPES:
        raise ControlRefused("unknown_type", f"unknown control message type {claims['type']!r}")
    return ControlMessage(**claims)


# --- results ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RunnerReport:
    """A verified runner report about one call; field names are the claim names.

    ``event`` is "started" (outcome, result and error null) or "finished" (outcome
    "succeeded" with a result, or "failed" with an error ``{"code", "message"}`` and,
    optionally, bounded ``details``).
    """

    iss: str
    aud: str
    iat: int
    exp: int
    jti: str
    call_id: str
    command_digest: str
    attempt: int
    event: str
    outcome: str | None
    result: dict[str, Any] | None
    error: dict[str, Any] | None
    sandbox: str | None
    started_at: str | None
    finished_at: str | None
    raw: str

    @property
    def runner_id(self) -> str:
        return self.iss


def sign_result(
    claims: Mapping[str, Any],
    private_key_pem: bytes | str | Ed25519PrivateKey,
    runner_id: str,
    *,
    now: int | None = None,
) -> str:
    """Sign a report as runner ``runner_id`` (its ``kid`` and ``iss``).

    ``iss``, ``aud``, ``iat``, ``exp`` (``iat + RESULT_LIFETIME_SECONDS``) and a random
    ``jti`` are filled in when absent.
    """
    payload = _with_lifetime(
        {"iss": runner_id, "aud": RESULT_AUDIENCE, **claims},
        lifetime=RESULT_LIFETIME_SECONDS,
        now=now,
        not_before=False,
    )
    payload.setdefault("jti", uuid.uuid4().hex)
    return _sign(payload, private_key_pem, typ=RESULT_TYP, kid=runner_id)


def unverified_runner_id(
    token: str, *, max_bytes: int = DEFAULT_MAX_REPORT_BYTES * REPORT_READ_FACTOR
) -> str:
    """The runner id a report claims to come from (its ``kid``), NOT yet trusted.

    Only for finding the enrolled key to verify with; ``verify_result`` then checks it.
    """
    header = _unverified_header(token, ResultRefused, max_bytes=max_bytes)
    kid = header.get("kid")
    if not isinstance(kid, str) or not _RUNNER_ID.fullmatch(kid):
        raise ResultRefused("malformed", "header kid must be a runner id (run_...)")
    return kid


def unverified_call_id(token: Any) -> str | None:
    """The ``jti`` a token claims, unverified and only when it looks like an id.

    For logs about refused commands and for looking up a call's state; never for a decision
    on its own.
    """
    try:
        payload = json.loads(_b64decode(str(token).split(".")[1]))
    except (ValueError, IndexError, UnicodeDecodeError, RecursionError):
        return None
    jti = payload.get("jti") if isinstance(payload, dict) else None
    return jti if _is_public_id(jti) else None


def verify_result(
    token: str,
    *,
    runner_public_key: bytes | str | Ed25519PublicKey,
    runner_id: str,
    now: float | None = None,
    max_bytes: int = DEFAULT_MAX_REPORT_BYTES,
) -> RunnerReport:
    """The report in ``token`` if runner ``runner_id`` signed it for the control plane.

    The caller looks the key up by ``unverified_runner_id`` among enrolled, unrevoked
    runners, and afterwards checks that ``call_id``/``command_digest`` answer a command it
    issued. Raises ``ResultRefused``; one raised after the signature verified carries the
    signed claims (``signed_claims``). A report longer than ``max_bytes`` is refused as
    ``too_large`` after its signature is checked (up to ``REPORT_READ_FACTOR`` times the
    limit; a longer one is not read at all).
    """
    header, claims = _verified_parts(
        token,
        runner_public_key,
        refused=ResultRefused,
        typ=RESULT_TYP,
        max_bytes=max(max_bytes, 1) * REPORT_READ_FACTOR,
    )
    try:
        if header.get("kid") != runner_id:
            raise ResultRefused("wrong_runner", "header kid is not the expected runner id")
        _require_claim_set(claims, RESULT_CLAIMS, ResultRefused)
        if len(token) > max_bytes:
            raise ResultRefused(
                "too_large",
                f"the report is {len(token)} bytes; the control plane records at most "
                f"{max_bytes} (KESTREL_MAX_REPORT_BYTES; a runner's budget must not exceed it)",
            )
        _check_result_claims(claims)
        if claims["iss"] != runner_id:
            raise ResultRefused("wrong_runner", "iss is not the expected runner id")
        if claims["aud"] != RESULT_AUDIENCE:
            raise ResultRefused("wrong_audience", f"a report is for {RESULT_AUDIENCE!r}")
        _check_time_window(claims, now, ResultRefused)
    except ResultRefused as refused:
        signed = {name: value for name, value in claims.items() if name != "result"}
        raise ResultRefused(refused.code, refused.message, signed_claims=signed) from None
    return RunnerReport(**claims, raw=token)


@dataclass(frozen=True)
class Heartbeat:
    """A verified heartbeat: runner ``iss`` of ``pool`` is up and its sandbox is ``sandbox``."""

    iss: str
    aud: str
    iat: int
    exp: int
    jti: str
    pool: str
    sandbox: str

    @property
    def runner_id(self) -> str:
        return self.iss


def sign_heartbeat(
    *,
    pool: str,
    sandbox: str,
    private_key_pem: bytes | str | Ed25519PrivateKey,
    runner_id: str,
    now: int | None = None,
) -> str:
    """Sign runner ``runner_id``'s heartbeat for the control plane."""
    return _sign_runner_notice(
        {"pool": pool, "sandbox": sandbox},
        typ=HEARTBEAT_TYP,
        private_key_pem=private_key_pem,
        runner_id=runner_id,
        now=now,
    )


def verify_heartbeat(
    token: str,
    *,
    runner_public_key: bytes | str | Ed25519PublicKey,
    runner_id: str,
    now: float | None = None,
) -> Heartbeat:
    """The heartbeat in ``token`` if runner ``runner_id`` signed it; the key is looked up as
    for a report (``unverified_runner_id``). Raises ``ResultRefused``."""
    claims = _verified_runner_notice(
        token,
        runner_public_key=runner_public_key,
        runner_id=runner_id,
        typ=HEARTBEAT_TYP,
        claim_set=HEARTBEAT_CLAIMS,
        what="heartbeat",
        now=now,
    )
    _require(
        claims["sandbox"] in HEARTBEAT_SANDBOXES,
        "sandbox",
        f"one of {sorted(HEARTBEAT_SANDBOXES)}",
        ResultRefused,
    )
    return Heartbeat(**claims)


def _sign_runner_notice(
    claims: Mapping[str, Any],
    *,
    typ: str,
    private_key_pem: bytes | str | Ed25519PrivateKey,
    runner_id: str,
    now: int | None,
) -> str:
    """Sign a runner's notice to the control plane (a heartbeat, a workspace inventory):
    ``claims`` with ``iss``, ``aud``, a two-minute lifetime and a fresh ``jti``."""
    payload = _with_lifetime(
        {"iss": runner_id, "aud": RESULT_AUDIENCE, **claims},
        lifetime=HEARTBEAT_LIFETIME_SECONDS,
        now=now,
        not_before=False,
    )
    payload["jti"] = uuid.uuid4().hex
    return _sign(payload, private_key_pem, typ=typ, kid=runner_id)


def _verified_runner_notice(
    token: str,
    *,
    runner_public_key: bytes | str | Ed25519PublicKey,
    runner_id: str,
    typ: str,
    claim_set: frozenset[str],
    what: str,
    now: float | None,
) -> dict[str, Any]:
    """The claims of a runner's notice of type ``typ`` that runner ``runner_id`` signed,
    with exactly ``claim_set`` and the checks every notice shares (times, ``jti``, ``pool``,
    audience, lifetime); the caller checks the claims of its own. Raises ``ResultRefused``."""
    header, claims = _verified_parts(token, runner_public_key, refused=ResultRefused, typ=typ)
    if header.get("kid") != runner_id or claims.get("iss") != runner_id:
        raise ResultRefused("wrong_runner", f"the {what} is not from the expected runner")
    _require_claim_set(claims, claim_set, ResultRefused)
    for name in ("iat", "exp"):
        _require(
            _is_int(claims[name]) and claims[name] >= 0,
            name,
            "a whole number of seconds",
            ResultRefused,
        )
    _require(_is_text(claims["jti"]), "jti", "a string", ResultRefused)
    _require(_is_public_id(claims["pool"]), "pool", "a pool name", ResultRefused)
    if claims["aud"] != RESULT_AUDIENCE:
        raise ResultRefused("wrong_audience", f"a {what} is for {RESULT_AUDIENCE!r}")
    if claims["exp"] - claims["iat"] > HEARTBEAT_LIFETIME_SECONDS:
        raise ResultRefused("malformed", f"a {what} lives at most two minutes")
    _check_time_window(claims, now, ResultRefused)
    return claims


def _check_result_claims(claims: Mapping[str, Any]) -> None:
    def require(ok: bool, name: str, expected: str) -> None:
        if not ok:
            raise ResultRefused("malformed", f"claim {name!r} must be {expected}")

    for name in ("iat", "exp"):
        require(_is_int(claims[name]) and claims[name] >= 0, name, "a whole number of seconds")
    require(_is_text(claims["iss"]), "iss", "a string")
    require(_is_text(claims["aud"]), "aud", "a string")
    require(_is_text(claims["jti"]), "jti", "a string")
    require(_is_public_id(claims["call_id"]), "call_id", "a public id")
    require(_is_sha256(claims["command_digest"]), "command_digest", "a sha256 hex digest")
    require(_is_int(claims["attempt"]) and claims["attempt"] >= 1, "attempt", "an integer >= 1")
    require(claims["sandbox"] is None or _is_text(claims["sandbox"]), "sandbox", "text or null")
    for name in ("started_at", "finished_at"):
        require(claims[name] is None or _is_utc_timestamp(claims[name]), name, "UTC ISO 8601")
    event, outcome = claims["event"], claims["outcome"]
    result, error = claims["result"], claims["error"]
    if event == "started":
        require(outcome is None and result is None and error is None, "outcome", "null")
    elif event == "finished":
        if outcome == "succeeded":
            require(isinstance(result, dict) and error is None, "result", "an object")
        elif outcome == "failed":
            require(result is None or isinstance(result, dict), "result", "an object or null")
            require(
                isinstance(error, dict)
                and set(error) in ({"code", "message"}, {"code", "message", "details"})
                and _is_text(error["code"])
                and isinstance(error["message"], str)
                and _is_error_details(error.get("details", {})),
                "error",
                'an object {"code", "message"} with an optional "details" object of at most '
                f"{MAX_ERROR_DETAILS_BYTES} bytes",
            )
        else:
            require(False, "outcome", '"succeeded" or "failed"')
    else:
        require(False, "event", '"started" or "finished"')


# --- shared verification ---------------------------------------------------------------


def _sign(
    payload: Mapping[str, Any],
    private_key_pem: bytes | str | Ed25519PrivateKey,
    *,
    typ: str,
    kid: str,
) -> str:
    return jwt.api_jws.PyJWS().encode(
        canonical_json(dict(payload)),
        load_private_key(private_key_pem),
        algorithm=ALGORITHM,
        headers={"typ": typ, "kid": kid},
    )


def _unverified_header(
    token: Any, refused: type[ProtocolError], *, max_bytes: int = MAX_TOKEN_BYTES
) -> dict[str, Any]:
    if not isinstance(token, str) or token.count(".") != 2:
        raise refused("malformed", "not a compact JWS")
    if len(token) > max_bytes:
        raise refused("malformed", f"the token is longer than {max_bytes} bytes; not read")
    try:
        header = jwt.get_unverified_header(token)
    except jwt.exceptions.PyJWTError as error:
        raise refused("malformed", f"unreadable header: {error}") from None
    except RecursionError:  # JSON nested deeper than the decoder goes; PyJWT lets it through
        raise refused("malformed", "unreadable header: nested too deeply") from None
    return header


def _verified_parts(
    token: Any,
    public_key: bytes | str | Ed25519PublicKey,
    *,
    refused: type[ProtocolError],
    typ: str,
    max_bytes: int = MAX_TOKEN_BYTES,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The header and claims of a token whose EdDSA signature checks out."""
    header = _unverified_header(token, refused, max_bytes=max_bytes)
    # Decided from the header before any key is used: "none", HS256 keyed with the public
    # key bytes and every other algorithm never reach a verifier.
    if header.get("alg") != ALGORITHM:
        raise refused("bad_signature", f"algorithm {header.get('alg')!r} is not accepted")
    try:
        key = load_public_key(public_key)
    except ValueError as error:
        raise refused("bad_signature", f"unusable verification key: {error}") from None
    try:
        verified = jwt.api_jws.PyJWS().decode_complete(token, key, algorithms=[ALGORITHM])
    except jwt.exceptions.InvalidSignatureError:
        raise refused("bad_signature", "signature verification failed") from None
    except jwt.exceptions.PyJWTError as error:
        raise refused("bad_signature", f"not verifiable: {error}") from None
    if set(header) != {"alg", "typ", "kid"}:
        raise refused("malformed", "header must hold exactly alg, typ and kid")
    if header["typ"] != typ:
        raise refused("malformed", f"header typ must be {typ!r}")
    try:
        claims = strict_json_loads(verified["payload"])
    except (ValueError, UnicodeDecodeError, RecursionError) as error:
        raise refused("malformed", f"payload is not strict JSON: {error}") from None
    if not isinstance(claims, dict):
        raise refused("malformed", "payload must be a JSON object")
    return header, claims


def _require_claim_set(
    claims: Mapping[str, Any], expected: frozenset[str], refused: type[ProtocolError]
) -> None:
    missing = sorted(expected - set(claims))
    if missing:
        raise refused("malformed", f"missing claims {missing}")
    unknown = sorted(set(claims) - expected)
    if unknown:
        raise refused("malformed", f"unknown claims {unknown}")


def _check_time_window(
    claims: Mapping[str, Any], now: float | None, refused: type[ProtocolError]
) -> None:
    current = time.time() if now is None else now
    if claims["exp"] <= claims["iat"]:
        raise refused("malformed", "exp must be after iat")
    if current > claims["exp"] + LEEWAY_SECONDS:
        raise refused("expired", "the token has expired")
    not_before = max(claims["iat"], claims.get("nbf", claims["iat"]))
    if current + LEEWAY_SECONDS < not_before:
        raise refused("not_yet_valid", "the token is not valid yet (iat/nbf in the future)")


def _require(
    ok: bool, name: str, expected: str, refused: type[ProtocolError] = CommandRefused
) -> None:
    if not ok:
        raise refused("malformed", f"claim {name!r} must be {expected}")


def strict_json_loads(raw: str | bytes) -> Any:
    """JSON as the wire accepts it: no duplicate keys (two parsers could each pick another
    value) and no NaN or Infinity. Raises ValueError (or UnicodeDecodeError)."""
    return json.loads(raw, object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constants)


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _b64decode(segment: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4))
    except binascii.Error as error:
        raise ValueError(str(error)) from None


def _is_error_details(value: Any) -> bool:
    """A report error's optional ``details``: an object, bounded (a changed MCP tool's
    observed definitions, runners.mcp.errors.McpToolChanged)."""
    if not isinstance(value, dict):
        return False
    try:
        return len(canonical_json(value)) <= MAX_ERROR_DETAILS_BYTES
    except (TypeError, ValueError):
        return False


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _is_text(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= _MAX_TEXT


def _is_public_id(value: Any) -> bool:
    return isinstance(value, str) and _PUBLIC_ID.fullmatch(value) is not None


def _is_sha256(value: Any) -> bool:
    return isinstance(value, str) and _SHA256_HEX.fullmatch(value) is not None


def _is_utc_timestamp(value: Any) -> bool:
    if not isinstance(value, str) or len(value) > 64:
        return False
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return False
    return parsed.utcoffset() == timedelta(0)
