"""Discoveries: a runner starts a server once and lists its tools; the control plane pins them.

``discovery_start`` (install, image change, refresh) records a ``McpDiscovery`` and, once
the caller's transaction commits, sends the signed request (``runners.contract.
mcp_discovery``) to the organization's runner pool. The runner answers with a report signed
by its own key (``control.mcp_discovered``): ``discovery_ingest`` verifies it against the
enrolled runner's public key and the stored request digest before it records anything.

Recording (``tools_observe``): the first discovery records every listed tool enabled, except
those that cannot be used (a name policies cannot name, an input schema that is not a valid
JSON Schema, a definition over the bounds), recorded unusable with the reason. A later one
is a diff against the record: the same digest is unchanged; a different one is *changed*
(the listed definition pending, the tool disabled until an admin reviews it: a changed
description is how tool poisoning arrives); a tool listed for the first time is *new*
(pending too); one no longer listed is *removed* (forgotten if it was new or unusable, never
callable as recorded, unless an admin marked it dangerous: then it is kept with the marking,
and listed again it is recorded again as any tool listed after install). Descriptions and
schemas are untrusted text: flagged with the injection patterns
(``kestrel_one.common.injection``), shown, never followed. A failed first
discovery fails the server; a failed refresh of the same image keeps the recorded tools and
the server ready, with the error shown.

``mcp_sweep`` (beat) fails discoveries nobody answered by their deadline (``no_runner``) and
records each risk acceptance's expiry in the audit log once (``mcp.risk.expire``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from kestrel_one.accounts.principal import runner_principal, system_principal
from kestrel_one.audit.services import audit_record
from kestrel_one.celery import app
from kestrel_one.common.broker import broker_status
from kestrel_one.common.storable import json_storable, utf8_encodable
from kestrel_one.execution.control import mcp_risk_end_notice
from kestrel_one.execution.enrollment import call_pool_for
from kestrel_one.execution.keys import control_private_key
from kestrel_one.execution.models import Runner
from kestrel_one.mcp.models import McpDiscovery, McpRiskAcceptance, McpServer, McpTool
from kestrel_one.mcp.profiles import server_profile
from runners.contract.canonical import canonical_json, token_digest
from runners.contract.mcp import (
    IMAGE_ID,
    MAX_DESCRIPTION_CHARS,
    MAX_SCHEMA_BYTES,
    MAX_TOOLS,
    TOOL_NAME,
    profile_digest,
    tool_definition,
    tool_definition_digest,
)
from runners.contract.mcp_discovery import (
    sign_discovery_request,
    unverified_discovery_runner_id,
    verify_discovery_report,
)
from runners.contract.names import (
    COMMAND_ISSUER,
    MCP_DISCOVER_TASK,
    command_audience,
    runner_queue,
)
from runners.contract.tokens import ProtocolError

logger = logging.getLogger(__name__)

__all__ = [
    "DiscoveryRefused",
    "discovery_ingest",
    "discovery_start",
    "mcp_sweep",
    "tool_unusable_reason",
    "tools_observe",
]

# (code, message) of the errors the control plane itself ends discoveries with.
NO_RUNNER = ("no_runner", "No runner answered the discovery before its deadline.")
IMAGE_MISMATCH = "mcp_image_mismatch"
SUPERSEDED = ("superseded", "A newer discovery of this server was requested meanwhile.")
NO_TOOLS = ("mcp_protocol_error", "The runner's report carries neither tools nor an error.")


class DiscoveryRefused(Exception):
    """A discovery report that is not recorded: a stable ``code`` for the logs."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code


def _wire_profile(server: McpServer) -> dict[str, Any]:
    """The profile the runner is asked to start: the server's, except that a managed
    server's image is named by its managed entry (the runner resolves the tag to its
    engine's id, and the discovery records it), and a custom server's is the digest given."""
    profile = server_profile(server)
    if server.kind == McpServer.Kind.MANAGED:
        profile["image"] = None
    elif not profile["image"]:
        profile["image"] = server.reference.rpartition("@")[2] or None
    return profile


def discovery_start(*, server: McpServer, requested_by=None) -> McpDiscovery:
    """Record a discovery of ``server`` and send its signed request once the caller's
    transaction commits (install, image change, refresh: the caller audits that act). A
    request that cannot be sent is failed by the sweep at its deadline (``no_runner``)."""
    organization = server.organization
    pool = call_pool_for(organization)
    profile = _wire_profile(server)
    ttl = settings.KESTREL_MCP_DISCOVERY_SECONDS
    discovery = McpDiscovery.objects.create(
        organization=organization,
        server=server,
        profile_sha256=profile_digest(profile),
        pool=pool,
        requested_by=requested_by,
        deadline_at=timezone.now() + timedelta(seconds=ttl + settings.KESTREL_CALL_GRACE_SECONDS),
    )
    token = sign_discovery_request(
        {
            "iss": COMMAND_ISSUER,
            "aud": command_audience(pool),
            "jti": discovery.public_id,
            "org": organization.public_id,
            "env": server.environment.public_id,
            "profile": profile,
            "managed": server.managed or None,
        },
        control_private_key(),
        ttl=ttl,
    )
    discovery.request_digest = token_digest(token)
    McpDiscovery.objects.filter(pk=discovery.pk).update(request_digest=discovery.request_digest)
    transaction.on_commit(lambda: _discovery_send(discovery, token))
    return discovery


def _discovery_send(discovery: McpDiscovery, token: str) -> bool:
    if not broker_status().reachable:
        logger.warning("the broker does not answer; discovery %s waits", discovery.public_id)
        return False
    try:
        app.send_task(MCP_DISCOVER_TASK, args=[token], queue=runner_queue(discovery.pool))
    except Exception:
        logger.exception("discovery %s could not be sent", discovery.public_id)
        return False
    return True


# --- recording tools ------------------------------------------------------------------------


def _json_size(value: Any) -> int:
    return len(canonical_json(value))


def tool_unusable_reason(listed: Mapping[str, Any]) -> str | None:
    """Why a listed tool cannot be recorded as callable, or None: its name is not one a
    policy can name, its description or schemas are over the bounds, or its input schema is
    not a valid JSON Schema (2020-12) object schema."""
    name = listed.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        return "its name is not one a policy can name (runners.contract.mcp.TOOL_NAME)"
    description = listed.get("description")
    if description is not None and not isinstance(description, str):
        return "its description is not text"
    if isinstance(description, str) and len(description) > MAX_DESCRIPTION_CHARS:
        return f"its description is over {MAX_DESCRIPTION_CHARS} characters"
    for field in ("inputSchema", "outputSchema"):
        schema = listed.get(field)
        if schema is None and field == "outputSchema":
            continue
        if not isinstance(schema, Mapping):
            return f"its {field} is not a JSON object"
        try:
            size = _json_size(dict(schema))
        except (TypeError, ValueError):
            return f"its {field} is not JSON"
        if size > MAX_SCHEMA_BYTES:
            return f"its {field} is over {MAX_SCHEMA_BYTES} bytes"
        try:
            Draft202012Validator.check_schema(dict(schema))
        except SchemaError as error:
            return f"its {field} is not a valid JSON Schema: {error.message[:200]}"
        except Exception as error:  # a schema the validator cannot even read
            return f"its {field} is not a valid JSON Schema ({type(error).__name__})"
        if field == "inputSchema" and schema.get("type") != "object":
            return "its inputSchema does not describe an object (MCP: type object)"
        outside = reference_outside(schema)
        if outside is not None:
            return (
                f"its {field} refers to a schema outside itself ({outside[:200]!r}), which "
                "Kestrel never fetches"
            )
    annotations = listed.get("annotations")
    if annotations is not None and not isinstance(annotations, Mapping):
        return "its annotations are not a JSON object"
    try:
        if _json_size(tool_definition(listed)) > MAX_SCHEMA_BYTES * 3:
            return "its definition is over the size bound"
    except (TypeError, ValueError):
        return "its definition is not JSON"
    return None


def reference_outside(schema: Any) -> str | None:
    """The first ``$ref`` or ``$dynamicRef`` in ``schema`` that does not point into the
    schema itself (``#...``), or None. Such a reference is a URL or file the schema's checker
    would have to fetch (``schema_worker`` never does, so no call could pass it)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, Mapping):
            for keyword in ("$ref", "$dynamicRef"):
                target = node.get(keyword)
                if isinstance(target, str) and not target.startswith("#"):
                    return target
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return None


def _definition(listed: Mapping[str, Any]) -> tuple[dict, str, str | None]:
    """(definition, digest, unusable reason) of a listed tool: what is stored is storable
    JSON; an unusable definition over the bounds is kept by name only."""
    reason = tool_unusable_reason(listed)
    try:
        definition = json_storable(utf8_encodable(tool_definition(listed)))
        sha = tool_definition_digest(listed)
    except (TypeError, ValueError):
        definition, sha = {}, ""
    if reason is not None and (not definition or "over" in reason):
        name = listed.get("name")
        definition = {"name": name if isinstance(name, str) else ""}
    return definition, sha, reason


def _record_new(server, name: str, listed, now, *, first: bool) -> tuple[McpTool, str]:
    definition, sha, reason = _definition(listed)
    if reason is not None:
        tool = McpTool(
            server=server,
            name=name,
            definition=definition,
            definition_sha256=sha,
            state=McpTool.State.UNUSABLE,
            unusable_reason=reason[:500],
            recorded_at=now,
        )
        return tool, "unusable"
    if first:
        return (
            McpTool(
                server=server,
                name=name,
                definition=definition,
                definition_sha256=sha,
                state=McpTool.State.ENABLED,
                recorded_at=now,
            ),
            "added",
        )
    # Listed after install: nothing is recorded as callable until an admin accepts it.
    return (
        McpTool(
            server=server,
            name=name,
            definition={},
            definition_sha256="",
            state=McpTool.State.NEW,
            pending_definition=definition,
            pending_sha256=sha,
            pending_seen_at=now,
            recorded_at=now,
        ),
        "added",
    )


def _observe_existing(tool: McpTool, listed, now) -> str | None:
    """Update ``tool`` (not saved) for what the server now lists (None: not listed);
    the change's name, or None when nothing changed."""
    if listed is None:
        if tool.state == McpTool.State.REMOVED:
            return None
        tool.state = McpTool.State.REMOVED
        return "removed"
    if tool.state == McpTool.State.REMOVED and _never_callable(tool):
        return _relisted(tool, listed, now)
    definition, sha, reason = _definition(listed)
    if tool.state == McpTool.State.UNUSABLE:
        if reason is None and sha != tool.definition_sha256:
            # Usable now: a definition nobody reviewed, so it waits like a new tool.
            tool.state = McpTool.State.NEW
            tool.unusable_reason = ""
            _pending(tool, definition, sha, reason, now)
            return "changed"
        return None
    if tool.state == McpTool.State.NEW:
        if sha == tool.pending_sha256:
            return None
        _pending(tool, definition, sha, reason, now)
        return "changed"
    if tool.definition_sha256 and sha == tool.definition_sha256:
        if tool.state == McpTool.State.ENABLED:
            return None
        tool.pending_definition, tool.pending_sha256, tool.pending_seen_at = None, "", None
        tool.pending_unusable_reason = ""
        if tool.unusable_reason:
            # Recorded unusable, then no longer listed (removed): listed again as it was, it
            # is unusable again, never callable (its digest is the recorded one all the same).
            tool.state = McpTool.State.UNUSABLE
            return "unusable"
        # The server lists the recorded (reviewed) definition again: callable as recorded.
        tool.state = McpTool.State.ENABLED
        return "reverted"
    if tool.state == McpTool.State.CHANGED and sha == tool.pending_sha256:
        return None
    tool.state = McpTool.State.CHANGED
    _pending(tool, definition, sha, reason, now)
    return "changed"


def _never_callable(tool: McpTool) -> bool:
    """Whether ``tool`` was never recorded callable: listed after install and never accepted
    (no recorded digest), or recorded unusable."""
    return not tool.definition_sha256 or bool(tool.unusable_reason)


def _relisted(tool: McpTool, listed, now) -> str:
    """``tool``, never recorded callable and kept (removed) for its admin's marking, listed
    again: recorded again as any tool listed after install (unusable, or new and pending),
    with its marking. What it was recorded as before is no review anyone made."""
    fresh, change = _record_new(tool.server, tool.name, listed, now, first=False)
    for field in _RECORDED_FIELDS:
        setattr(tool, field, getattr(fresh, field))
    return change


def _pending(tool: McpTool, definition: dict, sha: str, reason: str | None, now) -> None:
    """Set ``tool``'s pending definition (not saved). An unusable one keeps its reason, which
    accepting it records (a definition over the bounds is stored by name only, so the reason
    could not be found again from what is stored) and its flags name for the admin."""
    tool.pending_definition, tool.pending_sha256 = definition, sha
    tool.pending_unusable_reason = (reason or "")[:500]
    tool.pending_seen_at = now


_UPDATED_FIELDS = [
    "state",
    "unusable_reason",
    "pending_definition",
    "pending_sha256",
    "pending_seen_at",
    "pending_unusable_reason",
]
# What a discovery records of a tool (``_record_new``): all of it but the admin's marking
# and review, which are a person's and stay with the tool's name.
_RECORDED_FIELDS = ["definition", "definition_sha256", "recorded_at", *_UPDATED_FIELDS]


def _storable_name(name: Any) -> bool:
    """Whether ``name`` can be a recorded tool's name as it is listed: text, not empty, no
    longer than the column and nothing a database text refuses (a NUL). A name cut or
    changed to fit would be another tool's: the next listing would not find it again."""
    max_chars = McpTool._meta.get_field("name").max_length or 0
    return isinstance(name, str) and 0 < len(name) <= max_chars and json_storable(name) == name


def tools_observe(
    server: McpServer, observed: Mapping[str, Any], *, now, first: bool = False
) -> dict[str, str]:
    """Record what the server lists for the tools named in ``observed`` (name -> listed
    tool dict, or None: not listed); ``{name: change}`` of what changed (added, changed,
    removed, reverted, unusable). Tools not named are left as they are (a call's report
    names only those it saw differ; a discovery names them all: ``tools_record``)."""
    existing = {tool.name: tool for tool in server.tools.select_for_update()}
    changes: dict[str, str] = {}
    created: list[McpTool] = []
    updated: list[McpTool] = []
    dropped: list[int] = []
    for name, listed in sorted(observed.items()):
        if not _storable_name(name):
            continue  # no row holds it, so no row is it (``tools_record`` counts it skipped)
        tool = existing.get(name)
        if tool is None:
            if listed is None:
                continue
            new, change = _record_new(server, name, listed, now, first=first)
            created.append(new)
            changes[name] = change
            continue
        if (
            listed is None
            and tool.state in (McpTool.State.NEW, McpTool.State.UNUSABLE)
            and not tool.marked_dangerous
        ):
            # Not callable as recorded (never accepted, or unusable), and no longer listed:
            # forgotten (the discovery's summary names it), or a server listing new names at
            # each refresh would grow its recorded tools without bound. Listed again, it is
            # recorded again as any tool listed after install: unusable, or new (pending).
            # One an admin marked dangerous is kept, removed: the marking is a person's
            # decision, and the tool must not come back less guarded than they left it (the
            # kept ones are bounded by what admins marked, not by what the server lists).
            dropped.append(tool.pk)
            changes[name] = "removed"
            continue
        change = _observe_existing(tool, listed, now)
        if change is not None:
            updated.append(tool)
            changes[name] = change
    if created:
        McpTool.objects.bulk_create(created)
    if updated:
        McpTool.objects.bulk_update(updated, _RECORDED_FIELDS)
    if dropped:
        McpTool.objects.filter(pk__in=dropped).delete()
    return changes


def tools_record(server: McpServer, listed_tools: list, *, now) -> dict[str, list[str]]:
    """A discovery's whole list: the first one records, a later one diffs (module doc).
    Returns the summary ``{"added", "changed", "removed", "unusable"}`` (names)."""
    # The first discovery that succeeded, not the first that found tools: one that listed
    # none would otherwise let the next list's tools in enabled, unreviewed.
    first = server.discovered_at is None
    observed: dict[str, Any] = {}
    nameless = 0
    for listed in listed_tools[:MAX_TOOLS]:
        if not isinstance(listed, Mapping):
            continue
        name = listed.get("name")
        if not _storable_name(name) or name in observed:
            nameless += 1
            continue
        observed[name] = listed
    if not first:
        for name in server.tools.exclude(state=McpTool.State.REMOVED).values_list(
            "name", flat=True
        ):
            observed.setdefault(name, None)
    changes = tools_observe(server, observed, now=now, first=first)
    summary: dict[str, list[str]] = {"added": [], "changed": [], "removed": [], "unusable": []}
    for name, change in sorted(changes.items()):
        summary["changed" if change == "reverted" else change].append(name)
    if nameless:
        summary["skipped"] = [f"{nameless} listed tool(s) without a usable unique name"]
    return summary


# --- ingesting a runner's report ------------------------------------------------------------


def _last_done_checked(server: McpServer) -> tuple[str | None, str | None]:
    """The image id and the reference the server's last successful discovery checked (a
    discovery recorded before references were kept names none: nothing is taken as checked)."""
    done = (
        McpDiscovery.objects.filter(server=server, state=McpDiscovery.State.DONE)
        .order_by("-finished_at", "-pk")
        .values_list("summary", flat=True)
        .first()
    )
    done = done or {}
    return done.get("image"), done.get("reference")


def _discovery_fail(discovery: McpDiscovery, server: McpServer, error: dict, *, actor) -> None:
    """End ``discovery`` failed. The server keeps its recorded tools and stays ready when
    the failure is a refresh of the very image its tools were recorded from; otherwise (a
    first discovery, a new image) it is failed with the error."""
    now = timezone.now()
    error = {
        "code": str(error.get("code", "error"))[:64],
        "message": str(error.get("message", ""))[:2000],
    }
    McpDiscovery.objects.filter(pk=discovery.pk, state=McpDiscovery.State.PENDING).update(
        state=McpDiscovery.State.FAILED, error=error, finished_at=now
    )
    # A refresh of what was checked already: the image id and the reference it was checked
    # against (a new reference of the same digest was never checked, and a failure to check
    # it leaves the server failed, not ready under a name nobody verified).
    refresh = (
        server.discovered_at is not None
        and bool(server.image_id)
        and _last_done_checked(server) == (server.image_id, server.reference)
    )
    newest = _is_newest(discovery)
    if server.state != McpServer.State.REMOVED and newest:
        server.state = McpServer.State.READY if refresh else McpServer.State.FAILED
        server.error = error
        McpServer.objects.filter(pk=server.pk).update(state=server.state, error=error)
    audit_record(
        organization=discovery.organization,
        actor=actor,
        action="mcp.discovered",
        target=server,
        outcome="failed",
        data={"discovery": discovery.public_id, "error": error, "server_state": server.state},
    )


def _is_newest(discovery: McpDiscovery) -> bool:
    return not McpDiscovery.objects.filter(
        server_id=discovery.server_id, created_at__gt=discovery.created_at
    ).exists()


def discovery_ingest(token: str) -> str:
    """Verify a runner's signed discovery report and record it; what happened, for logs.

    Nothing is recorded before the signature (the enrolled, active runner's key), the
    runner's pool and organization, and the digest of the request we signed are checked."""
    try:
        runner_id = unverified_discovery_runner_id(token)
    except ProtocolError as refused:
        raise DiscoveryRefused(refused.code, str(refused)) from None
    runner = Runner.objects.filter(public_id=runner_id, revoked_at__isnull=True).first()
    if runner is None:
        raise DiscoveryRefused("unknown_runner", f"{runner_id} is not an enrolled, active runner")
    try:
        report = verify_discovery_report(token, runner_public_key=runner.public_key)
    except ProtocolError as refused:
        raise DiscoveryRefused(refused.code, str(refused)) from None
    with transaction.atomic():
        discovery = (
            McpDiscovery.objects.select_for_update()
            .select_related("organization")
            .filter(public_id=report.discovery)
            .first()
        )
        if discovery is None or discovery.request_digest != report.request_digest:
            raise DiscoveryRefused("unknown_request", "the report answers no request we signed")
        if runner.pool != discovery.pool or runner.organization_id not in (
            None,
            discovery.organization_id,
        ):
            raise DiscoveryRefused("wrong_runner", "this runner may not answer this discovery")
        if discovery.state != McpDiscovery.State.PENDING:
            return "duplicate"
        server = McpServer.objects.select_for_update().get(pk=discovery.server_id)
        McpDiscovery.objects.filter(pk=discovery.pk).update(runner=runner)
        return _record_report(discovery, server, runner, report)


def _record_report(discovery: McpDiscovery, server: McpServer, runner: Runner, report) -> str:
    actor = runner_principal(runner.public_id)
    if server.state == McpServer.State.REMOVED or not _is_newest(discovery):
        code, message = SUPERSEDED
        _discovery_fail(discovery, server, {"code": code, "message": message}, actor=actor)
        return "superseded"
    if report.error is not None:
        _discovery_fail(discovery, server, dict(report.error), actor=actor)
        return "failed"
    image = report.image
    if server.kind == McpServer.Kind.CUSTOM:
        expected = server.image_id or server.reference.rpartition("@")[2]
        if image != expected:
            _discovery_fail(
                discovery,
                server,
                {
                    "code": IMAGE_MISMATCH,
                    "message": f"The runner ran image {str(image)[:80]}, not the digest "
                    f"installed ({expected}).",
                },
                actor=actor,
            )
            return "failed"
    elif not isinstance(image, str) or not IMAGE_ID.fullmatch(image):
        _discovery_fail(
            discovery,
            server,
            {"code": IMAGE_MISMATCH, "message": "The runner named no image id it ran."},
            actor=actor,
        )
        return "failed"
    if not isinstance(report.tools, list):
        code, message = NO_TOOLS
        _discovery_fail(discovery, server, {"code": code, "message": message}, actor=actor)
        return "failed"
    now = timezone.now()
    summary = tools_record(server, report.tools, now=now)
    server_info = report.server_info if isinstance(report.server_info, Mapping) else None
    recorded = {
        **summary,
        "image": image,
        "reference": server.reference,
        "tools": len(report.tools),
        "server_info": json_storable(utf8_encodable(dict(server_info))) if server_info else None,
    }
    McpDiscovery.objects.filter(pk=discovery.pk).update(
        state=McpDiscovery.State.DONE, summary=recorded, finished_at=now, error=None
    )
    McpServer.objects.filter(pk=server.pk).update(
        state=McpServer.State.READY, error=None, image_id=image, discovered_at=now
    )
    audit_record(
        organization=discovery.organization,
        actor=actor,
        action="mcp.discovered",
        target=server,
        data={"discovery": discovery.public_id, **recorded},
    )
    return "recorded"


# --- the sweep ------------------------------------------------------------------------------


def mcp_sweep(*, now=None) -> dict[str, int]:
    """Fail discoveries past their deadline; record each risk acceptance's expiry once."""
    now = now or timezone.now()
    counts = {"discoveries_failed": 0, "risk_expiries_recorded": 0}
    code, message = NO_RUNNER
    for discovery_id in McpDiscovery.objects.filter(
        state=McpDiscovery.State.PENDING, deadline_at__lt=now
    ).values_list("pk", flat=True):
        with transaction.atomic():
            discovery = (
                McpDiscovery.objects.select_for_update()
                .select_related("organization")
                .filter(pk=discovery_id, state=McpDiscovery.State.PENDING)
                .first()
            )
            if discovery is None:
                continue
            server = McpServer.objects.select_for_update().get(pk=discovery.server_id)
            _discovery_fail(
                discovery,
                server,
                {"code": code, "message": message},
                actor=system_principal("sweep"),
            )
            counts["discoveries_failed"] += 1
    for risk_id in McpRiskAcceptance.objects.filter(
        expires_at__lte=now,
        withdrawn_at__isnull=True,
        voided_at__isnull=True,
        expiry_recorded_at__isnull=True,
    ).values_list("pk", flat=True):
        with transaction.atomic():
            moved = McpRiskAcceptance.objects.filter(
                pk=risk_id,
                expiry_recorded_at__isnull=True,
                withdrawn_at__isnull=True,
                voided_at__isnull=True,
            ).update(expiry_recorded_at=now)
            if not moved:
                continue
            risk = McpRiskAcceptance.objects.select_related("organization", "server").get(
                pk=risk_id
            )
            audit_record(
                organization=risk.organization,
                actor=system_principal("sweep"),
                action="mcp.risk.expire",
                target=risk,
                data={
                    "server": risk.server.public_id,
                    "expires_at": risk.expires_at.isoformat(),
                    "image_id": risk.image_id,
                },
            )
            mcp_risk_end_notice(risk)
            counts["risk_expiries_recorded"] += 1
    return counts
