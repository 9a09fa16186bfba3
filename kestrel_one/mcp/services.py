"""MCP server writes: install, change, refresh, remove; tool reviews and marks; egress; risk.

Every write is one transaction with its one audit row. Values are checked here (the API's
serializers only refuse unknown fields), so the console and the API refuse the same things
with the same messages, each at its field's path.

Binding (MCP-2, MCP-4): an egress allowlist is approved, by authoring it, for the server's
image id and base profile at that moment (``egress_image_id``/``egress_profile_sha256``);
a risk acceptance is made for them too. Changing the image, command, workspace or limits
changes the base profile, so both stop applying (``egress: "void"``, the acceptance
``void``), for good: changing the server back revives neither, only an admin's new decision
does. Nothing here ever opens a network: that is ``profiles.server_profile``, under a risk
acceptance in force only.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from typing import Any, NoReturn

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone
from jsonschema import Draft202012Validator

from kestrel_one.audit.services import audit_record
from kestrel_one.common.errors import Conflict, ValidationFailed, echo
from kestrel_one.execution.approvals import require_person
from kestrel_one.execution.control import mcp_risk_end_notice
from kestrel_one.mcp.discovery import discovery_start, tool_unusable_reason
from kestrel_one.mcp.egress import egress_parse
from kestrel_one.mcp.models import McpRiskAcceptance, McpServer, McpTool
from kestrel_one.mcp.profiles import (
    EGRESS_AWAITING_GATEWAY,
    base_profile_sha256,
    egress_status,
    risk_acceptance_covers,
)
from runners.contract.mcp import (
    DEFAULT_LIMITS,
    IMAGE_ID,
    MANAGED_SERVERS,
    PROFILE_SCHEMA,
    SERVER_NAME,
    WORKSPACE_MOUNTS,
)

__all__ = [
    "ManagedServerNetwork",
    "image_reference_parse",
    "mcp_risk_accept",
    "mcp_risk_withdraw",
    "mcp_server_install",
    "mcp_server_refresh",
    "mcp_server_remove",
    "mcp_server_update",
    "mcp_tool_mark",
    "mcp_tool_review",
]

JUSTIFICATION_MAX_CHARS = 2000
# What a custom server's PATCH may change; a managed server's is Kestrel's but its limits.
UPDATABLE = ("egress", "image", "command", "workspace", "limits")
MANAGED_FIXED = ("image", "command", "workspace")
# What a server runs, and on what: the program a policy's grants (by server name) reach and
# the tools its discovery records. Installing a server or changing these is a person's
# decision (``require_person``), as is authoring an egress entry the grant in force does not
# hold (``_egress_widens``); an integration token may change limits, drop egress entries,
# and remove or refresh a server, which only narrow or ask for a review.
RUNNABLE = ("image", "command", "workspace")

# REPO[:TAG]@sha256:<64 hex>, the grammar of an OCI/Docker image reference
# (distribution/reference): an optional registry host (with a port), then lower case path
# components; the tag, if any, is informative only: the digest is what runs.
_DOMAIN_PART = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"{_DOMAIN_PART}(?:\.{_DOMAIN_PART})*(?::[0-9]+)?"
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*"
_REPOSITORY = rf"(?:{_DOMAIN}/)?{_COMPONENT}(?:/{_COMPONENT})*"
_TAG = r"[\w][\w.-]{0,127}"
_PINNED = re.compile(
    rf"(?P<repo>{_REPOSITORY})(?::(?P<tag>{_TAG}))?@sha256:(?P<hex>[0-9a-f]{{64}})"
)
_UNPINNED = re.compile(rf"{_REPOSITORY}(?::{_TAG})?")
MAX_REFERENCE_CHARS = 512
# A tool definition's digest, as ``pending.sha256`` shows it.
_SHA256 = re.compile(r"[0-9a-f]{64}")
PINNED_FORM = "REPO@sha256:<64 hex>"


class ManagedServerNetwork(ValidationFailed):
    """Unrestricted networking was asked for a managed server: it is never possible (MCP-4)."""

    code = "managed_server_network"


def _refuse(field: str, reason: str, *, error=ValidationFailed) -> NoReturn:
    raise error(f"{field}: {reason}", details={field: [reason]})


def _keyword_reason(keyword: str, bound: Any) -> str:
    if keyword == "type":
        return f"must be of type {bound}"
    if keyword == "minLength":
        return "must not be empty" if bound == 1 else f"must be at least {bound} long"
    if keyword == "maxLength":
        return f"must be at most {bound} characters"
    if keyword == "maxItems":
        return f"must hold at most {bound} items"
    if keyword == "minimum":
        return f"must be at least {bound}"
    if keyword == "maximum":
        return f"must be at most {bound}"
    if keyword == "exclusiveMinimum":
        return f"must be more than {bound}"
    if keyword == "pattern":
        return "must not contain a NUL character"
    if keyword == "enum":
        return f"must be one of: {', '.join(map(str, bound))}"
    return "is not valid here"


def _schema_problems(instance: Any, schema: dict, field: str) -> dict[str, list[str]]:
    """Every jsonschema error of ``instance`` at its path under ``field``, in words that
    never repeat a long value."""
    problems: dict[str, list[str]] = {}
    for error in Draft202012Validator(schema).iter_errors(instance):
        path = field
        for part in error.absolute_path:
            path += f"[{part}]" if isinstance(part, int) else f".{part}"
        keyword, bound = error.validator, error.validator_value
        reason = _keyword_reason(str(keyword), bound)
        if keyword == "additionalProperties":
            known = ", ".join(schema.get("properties", {}))
            for name in sorted(set(instance) - set(schema.get("properties", {}))):
                problems.setdefault(f"{path}.{echo(name)}", []).append(
                    f"unknown field; the fields are: {known}"
                )
            continue
        problems.setdefault(path, []).append(reason)
    return problems


def _raise_problems(problems: dict[str, list[str]]) -> None:
    if problems:
        summary = " ".join(f"{path}: {reasons[0]}" for path, reasons in problems.items())
        raise ValidationFailed(summary[:1000], details=problems)


# Checks of one field each -------------------------------------------------------------------


def image_reference_parse(raw: Any) -> tuple[str, str]:
    """``(reference, image_id)`` of a custom server's image, pinned by digest only: a tag
    can move, so a reference without ``@sha256:`` is refused saying what to send."""
    if not isinstance(raw, str) or not raw:
        _refuse("image", f"must be a string: {PINNED_FORM}")
    if len(raw) > MAX_REFERENCE_CHARS:
        _refuse("image", f"must be at most {MAX_REFERENCE_CHARS} characters")
    found = _PINNED.fullmatch(raw)
    if found is not None:
        return raw, f"sha256:{found['hex']}"
    if IMAGE_ID.fullmatch(raw):
        _refuse(
            "image",
            f"must name the image's repository too: {PINNED_FORM} (a bare id says nothing "
            "the engine can check the image against)",
        )
    if "@" not in raw:
        if _UNPINNED.fullmatch(raw):
            _refuse(
                "image",
                f"must be pinned by digest: {PINNED_FORM}; a tag can move "
                f"(docker image inspect --format '{{{{.Id}}}}' {echo(raw)} gives the digest)",
            )
        _refuse("image", f"is not an image reference; send {PINNED_FORM}")
    repository, _, _digest = raw.rpartition("@")
    if not _UNPINNED.fullmatch(repository):
        _refuse(
            "image",
            "the repository is not a valid image name (lower case path components, an "
            f"optional registry host first); send {PINNED_FORM}",
        )
    _refuse("image", f"the digest must be sha256: and 64 lower case hex digits ({PINNED_FORM})")


def _name_check(raw: Any) -> str:
    if not isinstance(raw, str) or not SERVER_NAME.fullmatch(raw):
        _refuse(
            "name",
            "must be 1 to 63 lower case letters, digits, '-' or '_', starting with a letter "
            "or digit (policies name the server by it)",
        )
    return raw


def _managed_check(raw: Any) -> str:
    if not isinstance(raw, str) or raw not in MANAGED_SERVERS:
        _refuse("managed", f"must be one of: {', '.join(MANAGED_SERVERS)}")
    return raw


def _command_check(raw: Any) -> list[str]:
    _raise_problems(_schema_problems(raw, PROFILE_SCHEMA["properties"]["command"], "command"))
    return list(raw)


def _workspace_check(raw: Any) -> str:
    if raw not in WORKSPACE_MOUNTS:
        _refuse("workspace", f"must be one of: {', '.join(WORKSPACE_MOUNTS)}")
    return raw


def _limits_merge(raw: Any, base: dict) -> dict:
    """``raw`` (any of memory_mb, cpus, pids, tmp_mb) over ``base``, within the profile's
    bounds; every problem at ``limits.<name>``."""
    schema = PROFILE_SCHEMA["properties"]["limits"]
    if not isinstance(raw, dict):
        _refuse("limits", f"must be an object with any of: {', '.join(schema['properties'])}")
    merged = {**base, **raw}
    _raise_problems(_schema_problems(merged, schema, "limits"))
    # One form for each number, as the profile's digest reads it: JSON Schema takes 512.0 as
    # an integer and 1 as a number, and a limit sent as another spelling of the value it has
    # must not move the base profile (which voids the egress grant and risk acceptances).
    kinds = {name: rule["type"] for name, rule in schema["properties"].items()}
    return {
        name: int(value) if kinds[name] == "integer" else float(value)
        for name, value in merged.items()
    }


def _justification_check(raw: Any) -> str:
    text = raw.strip() if isinstance(raw, str) else ""
    if not text:
        _refuse(
            "justification",
            "must say why this server needs unrestricted networking (a non-empty text)",
        )
    if len(text) > JUSTIFICATION_MAX_CHARS:
        _refuse("justification", f"must be at most {JUSTIFICATION_MAX_CHARS} characters")
    return text


def _expiry_check(expires_at: datetime, now: datetime) -> datetime:
    days = settings.KESTREL_MCP_RISK_MAX_DAYS
    if expires_at <= now:
        _refuse("expires_at", "must be in the future")
    if expires_at > now + timedelta(days=days):
        _refuse(
            "expires_at",
            f"must be at most {days} days ahead (KESTREL_MCP_RISK_MAX_DAYS): a risk "
            "acceptance is a decision to revisit",
        )
    return expires_at


def _locked_installed(server: McpServer) -> McpServer:
    """The server's row, locked; a removed server takes no change (it is a record now)."""
    server = McpServer.objects.select_for_update().get(pk=server.pk)
    if server.state == McpServer.State.REMOVED:
        raise Conflict("This MCP server is removed; install it again to use it.")
    return server


def _user(actor):
    return getattr(actor, "user", None)


def _bind_egress(
    server: McpServer, entries: list[dict], actor, now, *, approving: bool = True
) -> None:
    """Authoring is approving: the entries hold for the image and base profile as they are.
    Entries that only narrow the grant in force (not ``approving``) keep its binding and
    who approved it."""
    server.egress = entries
    if entries and not approving:
        return
    if entries:
        server.egress_image_id = server.image_id
        server.egress_profile_sha256 = base_profile_sha256(server)
        server.egress_approved_by = _user(actor)
        server.egress_approved_at = now
    else:
        server.egress_image_id = ""
        server.egress_profile_sha256 = ""
        server.egress_approved_by = None
        server.egress_approved_at = None


def _egress_widens(server: McpServer, entries: list[dict]) -> bool:
    """Whether ``entries``, bound now, would allow what the server's grant in force does
    not: an entry it lacks, or any entry at all when the grant is void (a new image or
    profile) and binding it again is approving it again. Until a gateway exists no entry
    opens a network, but the grant is what the gateway will enforce (MCP-2), so approving one
    is a person's decision as a risk acceptance is; dropping entries only narrows."""
    if not entries:
        return False
    in_force = server.egress if egress_status(server) == EGRESS_AWAITING_GATEWAY else []
    held = {(entry["host"], entry["port"], entry["protocol"]) for entry in in_force}
    return any((entry["host"], entry["port"], entry["protocol"]) not in held for entry in entries)


def _egress_record(server: McpServer) -> dict:
    return {
        "entries": server.egress,
        "image_id": server.egress_image_id,
        "profile_sha256": server.egress_profile_sha256,
        "status": egress_status(server),
    }


# Servers ------------------------------------------------------------------------------------


@transaction.atomic
def mcp_server_install(
    *,
    actor,
    organization,
    environment,
    name: Any,
    image: Any = None,
    managed: Any = None,
    egress: Any = None,
    command: Any = None,
    workspace: Any = None,
    limits: Any = None,
) -> McpServer:
    """Install a server into ``environment`` (state discovering) and start its discovery.

    ``image`` (custom, by digest) or ``managed`` (a name of MANAGED_SERVERS), never both. A
    managed server's command and workspace are Kestrel's, and it has no network at all."""
    if environment.organization_id != organization.pk:  # the serializer looked it up so too
        _refuse("environment", "no such environment in this organization")
    # Its first discovery records every usable tool enabled, under the grants that already
    # name the server: a token that could install (after removing) would choose them.
    require_person(actor, organization=organization, act="install", what="an MCP server")
    name = _name_check(name)
    if (image is None) == (managed is None):
        reason = "send exactly one of 'image' (a custom server, by digest) or 'managed'"
        raise ValidationFailed(reason, details={"image": [reason], "managed": [reason]})
    now = timezone.now()
    if managed is not None:
        managed = _managed_check(managed)
        for field, value in (("command", command), ("workspace", workspace)):
            if value is not None:
                _refuse(field, f"is fixed for the managed '{managed}' server")
        if egress:
            _refuse(
                "egress",
                "managed servers have no network at all: an egress allowlist is for custom servers",
            )
        spec = MANAGED_SERVERS[managed]
        kind, reference, image_id = McpServer.Kind.MANAGED, spec["image"], ""
        command, workspace = list(spec["command"]), spec["workspace"]
    else:
        reference, image_id = image_reference_parse(image)
        kind, managed = McpServer.Kind.CUSTOM, ""
        command = _command_check(command) if command is not None else []
        workspace = _workspace_check(workspace) if workspace is not None else "none"
    merged = _limits_merge(limits, dict(DEFAULT_LIMITS)) if limits is not None else None
    entries = egress_parse(egress) if egress is not None else []
    if McpServer.objects.installed().filter(environment=environment, name=name).exists():
        raise Conflict(
            f"A server named '{name}' is already installed in this environment; choose "
            "another name or remove it first.",
            details={"name": ["taken"]},
        )
    server = McpServer(
        organization=organization,
        environment=environment,
        name=name,
        kind=kind,
        managed=managed,
        reference=reference,
        image_id=image_id,
        command=command,
        workspace=workspace,
        limits=merged or dict(DEFAULT_LIMITS),
        state=McpServer.State.DISCOVERING,
        created_by=_user(actor),
    )
    _bind_egress(server, entries, actor, now)
    try:
        with transaction.atomic():
            server.save()
    except IntegrityError:
        # Another install took the name between the check above and this insert.
        raise Conflict(
            f"A server named '{name}' is already installed in this environment.",
            details={"name": ["taken"]},
        ) from None
    discovery = discovery_start(server=server, requested_by=_user(actor))
    audit_record(
        organization=organization,
        actor=actor,
        action="mcp.install",
        target=server,
        data={
            "name": name,
            "environment": environment.public_id,
            "kind": kind,
            "managed": managed or None,
            "reference": reference,
            "image_id": image_id or None,
            "command": command,
            "workspace": workspace,
            "limits": server.limits,
            "egress": _egress_record(server),
            "discovery": discovery.public_id,
        },
    )
    return server


@transaction.atomic
def mcp_server_update(*, actor, server: McpServer, changes: dict[str, Any]) -> McpServer:
    """Change what ``changes`` names (of UPDATABLE). A new image or command is a new
    discovery; any change of the base profile voids the egress grant and risk acceptances
    by binding, unless ``egress`` is authored again in the same change, and the runners stop
    the containers started under a voided acceptance."""
    server = _locked_installed(server)
    unknown = sorted(set(changes) - set(UPDATABLE))
    if unknown or not changes:
        reason = f"send at least one of: {', '.join(UPDATABLE)}"
        raise ValidationFailed(reason, details={name: [reason] for name in unknown} or None)
    if set(RUNNABLE) & set(changes):
        # A tool whose definition reads the same stays enabled on the new image or command.
        require_person(
            actor,
            organization=server.organization,
            act="change",
            what="an MCP server's image, command or workspace",
        )
    if server.kind == McpServer.Kind.MANAGED:
        for field in MANAGED_FIXED:
            if field in changes:
                _refuse(field, f"is fixed for the managed '{server.managed}' server")
        if changes.get("egress"):
            _refuse(
                "egress",
                "managed servers have no network at all: an egress allowlist is for custom servers",
            )
    now = timezone.now()
    bridging = _bridging(server)
    granted = egress_status(server) == EGRESS_AWAITING_GATEWAY
    before = {
        "reference": server.reference,
        "image_id": server.image_id,
        "command": list(server.command),
        "workspace": server.workspace,
        "limits": dict(server.limits),
    }
    if "image" in changes:
        server.reference, server.image_id = image_reference_parse(changes["image"])
    if "command" in changes:
        server.command = _command_check(changes["command"])
    if "workspace" in changes:
        server.workspace = _workspace_check(changes["workspace"])
    if "limits" in changes:
        server.limits = _limits_merge(changes["limits"], dict(server.limits))
    entries = egress_parse(changes["egress"]) if "egress" in changes else None
    widens = entries is not None and _egress_widens(server, entries)
    if widens:
        require_person(
            actor,
            organization=server.organization,
            act="approve",
            what="egress entries beyond the MCP server's grant in force",
        )
    after = {
        "reference": server.reference,
        "image_id": server.image_id,
        "command": list(server.command),
        "workspace": server.workspace,
        "limits": dict(server.limits),
    }
    changed = {key: after[key] for key in after if after[key] != before[key]}
    # A new reference is discovered again even for the same digest: the discovery is what
    # checks that the image is from the repository the reference names (mcp_image_mismatch).
    rediscover = bool({"reference", "image_id", "command"} & set(changed))
    if rediscover:
        server.state = McpServer.State.DISCOVERING
        server.error = None
    egress_voided = entries is None and granted and egress_status(server) != EGRESS_AWAITING_GATEWAY
    if entries is not None:
        _bind_egress(server, entries, actor, now, approving=widens)
    elif egress_voided:
        # Void for good, as a risk acceptance: changing the server back must not bring back
        # a grant only a person may make (whoever may change limits need not be one).
        server.egress_image_id = ""
        server.egress_profile_sha256 = ""
    server.save()
    discovery = discovery_start(server=server, requested_by=_user(actor)) if rediscover else None
    data: dict[str, Any] = {"changed": changed, "before": {k: before[k] for k in changed}}
    if entries is not None or egress_voided:
        data["egress"] = _egress_record(server)
    data["discovery"] = discovery.public_id if discovery is not None else None
    voided = _risk_void(server, bridging)
    if voided:
        data["risk_acceptances_voided"] = voided
    audit_record(
        organization=server.organization,
        actor=actor,
        # Authoring the allowlist alone is the egress decision; anything else is an update
        # (which records the allowlist too when it came with it): one row per change.
        action="mcp.egress.set" if entries is not None and not changed else "mcp.update",
        target=server,
        data=data,
    )
    return server


def _bridging(server: McpServer) -> list[McpRiskAcceptance]:
    """The risk acceptances under which containers of ``server`` may have the network now:
    in force and covering what it runs (the newest one is what a new call gets)."""
    return [
        acceptance
        for acceptance in McpRiskAcceptance.objects.in_force(timezone.now()).filter(server=server)
        if risk_acceptance_covers(acceptance, server)
    ]


def _risk_void(server: McpServer, bridging: list[McpRiskAcceptance]) -> list[str]:
    """``bridging`` (``_bridging``) was read before a change of ``server`` in this
    transaction: each acceptance that no longer covers it, removed or changed, is void for
    good (a later change back does not revive a person's decision; whoever can change a
    server cannot always accept a risk), and the runners stop the containers started under
    it (they have the network it gave). The public ids of those voided."""
    now = timezone.now()
    voided = []
    for acceptance in bridging:
        if server.state == McpServer.State.REMOVED or not risk_acceptance_covers(
            acceptance, server
        ):
            acceptance.voided_at = now
            acceptance.save(update_fields=["voided_at"])
            mcp_risk_end_notice(acceptance)
            voided.append(acceptance.public_id)
    return voided


@transaction.atomic
def mcp_server_refresh(*, actor, server: McpServer) -> McpServer:
    """Start the server again to list its tools; not callable until that discovery ends."""
    server = _locked_installed(server)
    server.state = McpServer.State.DISCOVERING
    server.save(update_fields=["state", "updated_at"])
    discovery = discovery_start(server=server, requested_by=_user(actor))
    audit_record(
        organization=server.organization,
        actor=actor,
        action="mcp.refresh",
        target=server,
        data={"name": server.name, "discovery": discovery.public_id},
    )
    return server


@transaction.atomic
def mcp_server_remove(*, actor, server: McpServer) -> McpServer:
    """Uninstall: kept for the records, never callable again; its name is free again."""
    server = McpServer.objects.select_for_update().get(pk=server.pk)
    if server.state == McpServer.State.REMOVED:
        return server
    previous = server.state
    bridging = _bridging(server)
    server.state = McpServer.State.REMOVED
    server.save(update_fields=["state", "updated_at"])
    data = {"name": server.name, "reference": server.reference, "state": previous}
    voided = _risk_void(server, bridging)
    if voided:
        data["risk_acceptances_voided"] = voided
    audit_record(
        organization=server.organization, actor=actor, action="mcp.remove", target=server, data=data
    )
    return server


# Tools --------------------------------------------------------------------------------------


@transaction.atomic
def mcp_tool_review(*, actor, tool: McpTool, accept: Any, sha256: Any = None) -> McpTool:
    """An admin's decision on a changed or new definition: accepting adopts it (the tool is
    enabled with the new digest); refusing keeps the tool disabled, the definition pending.

    Accepting names the definition reviewed (``sha256``, the pending one's digest as shown):
    the server may list another one between the admin's reading and the decision (a refresh,
    a call's report), and only what a person read may be adopted.

    Accepting is a decision like an approval (``require_person``): a definition is untrusted
    text, which may be written to talk an agent into adopting it, so no integration token,
    local agent or token minted by a token accepts one, even holding ``mcp:write``. Refusing
    keeps the tool off, which anyone who may change servers may do."""
    if not isinstance(accept, bool):
        _refuse("accept", "must be true (adopt the pending definition) or false (keep it off)")
    if sha256 is not None and not (isinstance(sha256, str) and _SHA256.fullmatch(sha256)):
        _refuse(
            "sha256",
            "must be the digest of the definition you reviewed: 64 lower case hex digits, the "
            "tool's pending.sha256",
        )
    if accept:
        require_person(
            actor,
            organization=tool.server.organization,
            act="accept",
            what="an MCP tool's new definition",
        )
    if accept and not sha256:
        _refuse(
            "sha256",
            "name the definition you reviewed: its digest, the tool's pending.sha256",
        )
    tool = McpTool.objects.select_for_update().select_related("server").get(pk=tool.pk)
    _locked_installed(tool.server)
    if tool.state == McpTool.State.REMOVED:
        # A tool changed and then no longer listed keeps the definition it last listed as
        # pending; adopting it would record enabled a tool the server does not list. Listed
        # again, it is compared anew and waits for a review then.
        raise Conflict(
            f"Tool '{echo(tool.name)}' is no longer listed by the server: there is nothing "
            "to review. Refresh the server; if it lists the tool again, its definition waits "
            "for review then.",
            details={"accept": ["the tool is removed"]},
        )
    if tool.pending_definition is None:
        raise Conflict(
            f"Tool '{echo(tool.name)}' has no pending definition to review (state {tool.state}).",
            details={"accept": ["nothing to review"]},
        )
    if sha256 is not None and sha256 != tool.pending_sha256:
        raise Conflict(
            f"Tool '{echo(tool.name)}' now lists another definition than the one reviewed "
            f"({tool.pending_sha256[:12]}..., not {str(sha256)[:12]}...): read it again.",
            details={"sha256": ["not the pending definition's digest"]},
        )
    now = timezone.now()
    reviewed = {"sha256": tool.pending_sha256, "previous_sha256": tool.definition_sha256}
    if accept:
        tool.definition = tool.pending_definition
        tool.definition_sha256 = tool.pending_sha256
        tool.pending_definition = None
        tool.pending_sha256 = ""
        tool.pending_seen_at = None
        tool.recorded_at = now
        tool.unusable_reason = tool.pending_unusable_reason or (
            tool_unusable_reason(tool.definition) or ""
        )
        tool.pending_unusable_reason = ""
        tool.state = McpTool.State.UNUSABLE if tool.unusable_reason else McpTool.State.ENABLED
    tool.reviewed_by = _user(actor)
    tool.reviewed_at = now
    tool.save()
    audit_record(
        organization=tool.server.organization,
        actor=actor,
        action="mcp.tool.review",
        target=tool.server,
        data={"tool": tool.name, "accept": accept, "state": tool.state, **reviewed},
    )
    return tool


@transaction.atomic
def mcp_tool_mark(*, actor, tool: McpTool, dangerous: Any) -> McpTool:
    """An admin's marking: ``true`` makes the tool need the policy's dangerous opt-in
    whatever its annotations say; ``false`` removes only that marking (POL-8).

    Removing it lets a policy without the opt-in call the tool: a widening, so only a person
    may (``require_person``). Marking a tool dangerous only narrows."""
    if not isinstance(dangerous, bool):
        _refuse("dangerous", "must be true or false")
    if not dangerous:
        require_person(
            actor,
            organization=tool.server.organization,
            act="remove",
            what="an MCP tool's dangerous marking",
        )
    tool = McpTool.objects.select_for_update().select_related("server").get(pk=tool.pk)
    _locked_installed(tool.server)
    previous = tool.marked_dangerous
    tool.marked_dangerous = dangerous
    tool.save(update_fields=["marked_dangerous"])
    audit_record(
        organization=tool.server.organization,
        actor=actor,
        action="mcp.tool.mark",
        target=tool.server,
        data={
            "tool": tool.name,
            "marked_dangerous": dangerous,
            "previous": previous,
            "dangerous": tool.dangerous,
        },
    )
    return tool


# Risk acceptances (MCP-4) -------------------------------------------------------------------


@transaction.atomic
def mcp_risk_accept(
    *, actor, server: McpServer, justification: Any, expires_at: datetime
) -> McpRiskAcceptance:
    """Record an admin's acceptance of unrestricted (bridge) networking for a custom server,
    for its current image and base profile, until ``expires_at``.

    A decision like an approval (``require_person``): a person holding ``actions:approve``,
    never an integration token, the local agent or a token minted by another token, even
    one holding ``mcp:write``."""
    require_person(
        actor,
        organization=server.organization,
        act="accept",
        what="unrestricted networking for an MCP server",
    )
    server = _locked_installed(server)
    if server.kind == McpServer.Kind.MANAGED:
        raise ManagedServerNetwork(
            "Unrestricted networking is impossible for managed servers: Kestrel's own servers "
            "never get a network.",
            details={"server": ["managed"]},
        )
    justification = _justification_check(justification)
    now = timezone.now()
    expires_at = _expiry_check(expires_at, now)
    if server.state != McpServer.State.READY or not server.image_id:
        raise Conflict(
            f"The server is {server.state}, not ready: a risk acceptance binds the image a "
            "discovery verified. Wait for the discovery to succeed (or refresh), then accept.",
            details={"server": [server.state]},
        )
    acceptance = McpRiskAcceptance.objects.create(
        organization=server.organization,
        server=server,
        justification=justification,
        expires_at=expires_at,
        image_id=server.image_id,
        profile_sha256=base_profile_sha256(server),
        accepted_by=_user(actor),
    )
    audit_record(
        organization=server.organization,
        actor=actor,
        action="mcp.risk.accept",
        target=acceptance,
        data={
            "server": server.public_id,
            "name": server.name,
            "justification": justification,
            "expires_at": expires_at.isoformat(),
            "image_id": acceptance.image_id,
            "profile_sha256": acceptance.profile_sha256,
        },
    )
    return acceptance


@transaction.atomic
def mcp_risk_withdraw(*, actor, acceptance: McpRiskAcceptance) -> McpRiskAcceptance:
    """End an acceptance now: the server's next container has no network, and the runners
    that ran its calls stop the containers started under it."""
    acceptance = (
        McpRiskAcceptance.objects.select_for_update().select_related("server").get(pk=acceptance.pk)
    )
    if acceptance.withdrawn_at is not None:
        raise Conflict("This risk acceptance is already withdrawn.")
    if acceptance.voided_at is not None:
        raise Conflict(
            "This risk acceptance is already void: the server's image or profile changed "
            "after it was made, or the server was removed."
        )
    acceptance.withdrawn_at = timezone.now()
    acceptance.withdrawn_by = _user(actor)
    acceptance.save(update_fields=["withdrawn_at", "withdrawn_by"])
    audit_record(
        organization=acceptance.organization,
        actor=actor,
        action="mcp.risk.withdraw",
        target=acceptance,
        data={"server": acceptance.server.public_id, "name": acceptance.server.name},
    )
    mcp_risk_end_notice(acceptance)
    return acceptance
