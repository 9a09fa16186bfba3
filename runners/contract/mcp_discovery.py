"""MCP discovery on the wire: the control plane's signed request, the runner's signed report.

Installing (or refreshing) an MCP server starts a discovery (docs/mcp.md): the control
plane signs a request (``sign_discovery_request``, typ ``kestrel-mcp-discover+jwt``, the
commands' key and ``kid``) and sends it as ``runner.mcp_discover`` (MCP_DISCOVER_TASK) on
the pool's queue. The runner verifies it (``verify_discovery_request``), starts the server
from the profile (a managed server's image resolved to its id on the runner's engine, a
custom one verified against it), lists its tools and answers with a report signed by its
own key (``sign_discovery_report``, typ ``kestrel-mcp-tools+jwt``) as
``control.mcp_discovered`` (MCP_DISCOVERED_TASK) on the reports queue; the control plane
finds the key by ``unverified_discovery_runner_id`` and checks it with
``verify_discovery_report``. Both sides check exact claim sets and strict types: nothing
unknown is acted on.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jsonschema
import jsonschema.exceptions
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from runners.contract.canonical import canonical_json, token_digest
from runners.contract.mcp import (
    DEFINITION_FIELDS,
    IMAGE_ID,
    MANAGED_SERVERS,
    MAX_DESCRIPTION_CHARS,
    MAX_SCHEMA_BYTES,
    MAX_TOOLS,
    PROFILE_SCHEMA,
    SERVER_ID,
)
from runners.contract.names import COMMAND_ISSUER, RESULT_AUDIENCE
from runners.contract.tokens import (
    CONTROL_KID,
    RESULT_LIFETIME_SECONDS,
    ProtocolError,
    _check_time_window,
    _is_int,
    _is_sha256,
    _is_text,
    _require,
    _require_claim_set,
    _sign,
    _unverified_header,
    _verified_control_plane_claims,
    _verified_parts,
    _with_lifetime,
)

__all__ = [
    "DISCOVERY_ID",
    "DISCOVERY_REPORT_CLAIMS",
    "DISCOVERY_REPORT_TYP",
    "DISCOVERY_REQUEST_CLAIMS",
    "DISCOVERY_REQUEST_TYP",
    "MAX_DISCOVERY_LIFETIME_SECONDS",
    "MAX_TOOL_DEFINITION_BYTES",
    "DiscoveryRefused",
    "DiscoveryReport",
    "DiscoveryRequest",
    "sign_discovery_report",
    "sign_discovery_request",
    "unverified_discovery_runner_id",
    "verify_discovery_report",
    "verify_discovery_request",
]

DISCOVERY_REQUEST_TYP = "kestrel-mcp-discover+jwt"
DISCOVERY_REPORT_TYP = "kestrel-mcp-tools+jwt"
# A discovery's public id (kestrel_one.common.ids, prefix "mdi").
DISCOVERY_ID = re.compile(r"mdi_[0-9A-HJKMNP-TV-Z]{26}")
_RUNNER_ID = re.compile(r"run_[A-Za-z0-9_-]{1,124}")
_PUBLIC_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")
MAX_DISCOVERY_LIFETIME_SECONDS = 3600
# One listed tool's definition in a report: its description and both schemas at their bounds.
MAX_TOOL_DEFINITION_BYTES = 2 * MAX_SCHEMA_BYTES + 4 * MAX_DESCRIPTION_CHARS + 8192
_MAX_INFO_CHARS = 256
_MAX_MESSAGE_CHARS = 4096

DISCOVERY_REQUEST_CLAIMS = frozenset(
    {"iss", "aud", "iat", "nbf", "exp", "jti", "org", "env", "profile", "managed"}
)
DISCOVERY_REPORT_CLAIMS = frozenset(
    {
        "iss",
        "aud",
        "iat",
        "exp",
        "jti",
        "discovery",
        "request_digest",
        "image",
        "server_info",
        "tools",
        "error",
    }
)


class DiscoveryRefused(ProtocolError):
    """A discovery request or report that must not be acted on. Codes: bad_signature,
    wrong_audience, wrong_runner, expired, not_yet_valid, malformed."""


def _strict_integer(_checker: Any, instance: Any) -> bool:
    return _is_int(instance)


_STRICT_TYPES = jsonschema.Draft202012Validator.TYPE_CHECKER.redefine("integer", _strict_integer)
_StrictValidator = jsonschema.validators.extend(  # type: ignore[no-untyped-call]
    jsonschema.Draft202012Validator, type_checker=_STRICT_TYPES
)
_PROFILE_VALIDATOR = _StrictValidator(PROFILE_SCHEMA)
_MANAGED_PROFILE_VALIDATOR = _StrictValidator(
    {
        **PROFILE_SCHEMA,
        "properties": {**PROFILE_SCHEMA["properties"], "image": {"type": "null"}},
    }
)


@dataclass(frozen=True)
class DiscoveryRequest:
    """A verified discovery request; field names are the claim names. ``profile["image"]``
    is None for a managed server (``managed`` names it): the runner resolves its image."""

    iss: str
    aud: str
    iat: int
    nbf: int
    exp: int
    jti: str
    org: str
    env: str
    profile: dict[str, Any]
    managed: str | None
    raw: str
    request_digest: str

    @property
    def discovery(self) -> str:
        return self.jti


@dataclass(frozen=True)
class DiscoveryReport:
    """A verified discovery report; field names are the claim names. Exactly one of
    ``tools`` (the listed tools' definitions) and ``error`` (``{"code", "message"}``)."""

    iss: str
    aud: str
    iat: int
    exp: int
    jti: str
    discovery: str
    request_digest: str
    image: str | None
    server_info: dict[str, str] | None
    tools: list[dict[str, Any]] | None
    error: dict[str, str] | None
    raw: str

    @property
    def runner_id(self) -> str:
        return self.iss


# --- the request -----------------------------------------------------------------------


def sign_discovery_request(
    claims: Mapping[str, Any],
    control_private_key: bytes | str | Ed25519PrivateKey,
    *,
    ttl: int = 600,
    now: int | None = None,
) -> str:
    """Sign a discovery request as the control plane. ``claims``: ``aud``
    (``command_audience(pool)``), ``jti`` (the mdi_ id), ``org``, ``env``, ``profile``,
    ``managed``; ``iss``, ``iat``, ``nbf`` and ``exp`` (``iat + ttl``) are filled in when
    absent. Signed as given: ``verify_discovery_request`` judges."""
    payload = _with_lifetime({"iss": COMMAND_ISSUER, **claims}, lifetime=ttl, now=now)
    return _sign(payload, control_private_key, typ=DISCOVERY_REQUEST_TYP, kid=CONTROL_KID)


def verify_discovery_request(
    token: Any,
    *,
    control_public_key: bytes | str | Ed25519PublicKey,
    pool: str,
    now: float | None = None,
) -> DiscoveryRequest:
    """The request in ``token`` if the control plane signed it for ``pool``'s runners:
    EdDSA and the signature, the header, the exact claim set and strict types (the profile
    against PROFILE_SCHEMA, integers not floats), the issuer, audience, lifetime and time
    window. Raises ``DiscoveryRefused``."""
    claims = _verified_control_plane_claims(
        token,
        control_public_key,
        pool=pool,
        now=now,
        typ=DISCOVERY_REQUEST_TYP,
        claim_set=DISCOVERY_REQUEST_CLAIMS,
        check_types=_check_request_types,
        max_lifetime=MAX_DISCOVERY_LIFETIME_SECONDS,
        refused=DiscoveryRefused,
        what="discovery request",
    )
    return DiscoveryRequest(**claims, raw=token, request_digest=token_digest(token))


def _check_request_types(claims: Mapping[str, Any]) -> None:
    def require(ok: bool, name: str, expected: str) -> None:
        _require(ok, name, expected, DiscoveryRefused)

    for name in ("iat", "nbf", "exp"):
        require(_is_int(claims[name]) and claims[name] >= 0, name, "a whole number of seconds")
    require(_is_text(claims["iss"]), "iss", "a string")
    require(_is_text(claims["aud"]), "aud", "a string")
    require(_fullmatch(DISCOVERY_ID, claims["jti"]), "jti", "a discovery id (mdi_...)")
    for name in ("org", "env"):
        require(_fullmatch(_PUBLIC_ID, claims[name]), name, "a public id")
    managed, profile = claims["managed"], claims["profile"]
    require(managed is None or managed in MANAGED_SERVERS, "managed", "null or a managed server")
    require(isinstance(profile, dict), "profile", "an object")
    validator = _MANAGED_PROFILE_VALIDATOR if managed is not None else _PROFILE_VALIDATOR
    error = jsonschema.exceptions.best_match(validator.iter_errors(profile))
    if error is not None:
        where = ".".join(str(part) for part in error.absolute_path)
        require(False, f"profile{'.' + where if where else ''}", f"valid ({error.message[:200]})")
    # jsonschema's patterns search, and "$" lets a trailing newline through: ids in full.
    require(_fullmatch(SERVER_ID, profile["server"]), "profile.server", "a server id")
    if managed is None:
        require(_fullmatch(IMAGE_ID, profile["image"]), "profile.image", "an image id")
    else:
        require(
            profile["network"] == "none" and profile["risk_acceptance"] is None,
            "profile.network",
            '"none" for a managed server',
        )
    if profile["network"] == "bridge":
        require(
            isinstance(profile["risk_acceptance"], str)
            and re.fullmatch(r"rsk_[0-9A-HJKMNP-TV-Z]{26}", profile["risk_acceptance"]) is not None,
            "profile.risk_acceptance",
            "a risk acceptance id with network bridge",
        )


# --- the report ------------------------------------------------------------------------


def sign_discovery_report(
    claims: Mapping[str, Any],
    runner_private_key: bytes | str | Ed25519PrivateKey,
    *,
    now: int | None = None,
) -> str:
    """Sign a discovery report as runner ``claims["iss"]`` (its ``kid``). ``aud``, ``iat``,
    ``exp`` (``iat + RESULT_LIFETIME_SECONDS``) and a random ``jti`` are filled in."""
    payload = _with_lifetime(
        {"aud": RESULT_AUDIENCE, **claims},
        lifetime=RESULT_LIFETIME_SECONDS,
        now=now,
        not_before=False,
    )
    payload.setdefault("jti", uuid.uuid4().hex)
    return _sign(payload, runner_private_key, typ=DISCOVERY_REPORT_TYP, kid=str(claims["iss"]))


def unverified_discovery_runner_id(token: Any) -> str:
    """The runner id a report claims (its ``kid``), NOT trusted: only to find the key."""
    header = _unverified_header(token, DiscoveryRefused)
    kid = header.get("kid")
    if not isinstance(kid, str) or not _RUNNER_ID.fullmatch(kid):
        raise DiscoveryRefused("malformed", "header kid must be a runner id (run_...)")
    return kid


def verify_discovery_report(
    token: Any,
    *,
    runner_public_key: bytes | str | Ed25519PublicKey,
    now: float | None = None,
) -> DiscoveryReport:
    """The report in ``token`` if the runner whose key this is signed it for the control
    plane: the signature, the header, ``kid`` == ``iss``, the exact claim set and strict
    types, the audience, lifetime and time window. The caller then checks that
    ``discovery`` and ``request_digest`` answer a request it sent to that runner's pool.
    Raises ``DiscoveryRefused``."""
    header, claims = _verified_parts(
        token, runner_public_key, refused=DiscoveryRefused, typ=DISCOVERY_REPORT_TYP
    )
    _require_claim_set(claims, DISCOVERY_REPORT_CLAIMS, DiscoveryRefused)
    _check_report_types(claims)
    if header.get("kid") != claims["iss"]:
        raise DiscoveryRefused("wrong_runner", "header kid is not the report's issuer")
    if claims["aud"] != RESULT_AUDIENCE:
        raise DiscoveryRefused("wrong_audience", f"a discovery report is for {RESULT_AUDIENCE!r}")
    if claims["exp"] - claims["iat"] > RESULT_LIFETIME_SECONDS:
        raise DiscoveryRefused("malformed", f"a report lives at most {RESULT_LIFETIME_SECONDS} s")
    _check_time_window(claims, now, DiscoveryRefused)
    return DiscoveryReport(**claims, raw=token)


def _check_report_types(claims: Mapping[str, Any]) -> None:
    def require(ok: bool, name: str, expected: str) -> None:
        _require(ok, name, expected, DiscoveryRefused)

    for name in ("iat", "exp"):
        require(_is_int(claims[name]) and claims[name] >= 0, name, "a whole number of seconds")
    require(_fullmatch(_RUNNER_ID, claims["iss"]), "iss", "a runner id")
    require(_is_text(claims["aud"]), "aud", "a string")
    require(_is_text(claims["jti"]), "jti", "a string")
    require(_fullmatch(DISCOVERY_ID, claims["discovery"]), "discovery", "a discovery id")
    require(_is_sha256(claims["request_digest"]), "request_digest", "a sha256 hex digest")
    image = claims["image"]
    require(image is None or _fullmatch(IMAGE_ID, image), "image", "an image id or null")
    info = claims["server_info"]
    require(
        info is None
        or (
            isinstance(info, dict)
            and set(info) == {"name", "version"}
            and all(isinstance(v, str) and len(v) <= _MAX_INFO_CHARS for v in info.values())
        ),
        "server_info",
        'null or {"name", "version"} strings',
    )
    tools, error = claims["tools"], claims["error"]
    require((tools is None) != (error is None), "tools", "set exactly when error is null")
    if tools is not None:
        require(
            isinstance(tools, list) and len(tools) <= MAX_TOOLS,
            "tools",
            f"a list of at most {MAX_TOOLS} tools",
        )
        for index, tool in enumerate(tools):
            require(_is_tool_definition(tool), f"tools[{index}]", "a tool definition, bounded")
    if error is not None:
        require(
            isinstance(error, dict)
            and set(error) == {"code", "message"}
            and _is_text(error["code"])
            and isinstance(error["message"], str)
            and len(error["message"]) <= _MAX_MESSAGE_CHARS,
            "error",
            'an object {"code", "message"}',
        )


def _is_tool_definition(tool: Any) -> bool:
    if not isinstance(tool, dict) or not set(tool) <= set(DEFINITION_FIELDS):
        return False
    name = tool.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= 1024:
        return False
    description = tool.get("description")
    if isinstance(description, str) and len(description) > MAX_DESCRIPTION_CHARS:
        return False
    try:
        for field in ("inputSchema", "outputSchema"):
            if field in tool and len(canonical_json(tool[field])) > MAX_SCHEMA_BYTES:
                return False
        return len(canonical_json(tool)) <= MAX_TOOL_DEFINITION_BYTES
    except (TypeError, ValueError):
        return False


def _fullmatch(pattern: re.Pattern[str], value: Any) -> bool:
    return isinstance(value, str) and pattern.fullmatch(value) is not None
