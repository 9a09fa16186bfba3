"""Console: the organization's installed MCP servers (MCP-1..5, POL-8; docs/mcp.md).

``/console/{org}/mcp-servers`` lists what is installed in each Environment and, for admins
(``mcp:write``), installs one: custom by ``REPO@sha256:DIGEST`` or managed by name. A
server's page shows its profile (and, for admins, the form that changes it as the API's
``PATCH`` does), its recorded tools (descriptions are untrusted text: shown
escaped, their injection flags marked, never followed), the tools waiting for a review with
the recorded and the new definition side by side, its egress entries (which never give it a
network: there is no trusted egress gateway yet) and its risk acceptances.

As everywhere in the console, every member reads what the API lets them read (``org:read``)
and every write goes through the service the API calls, with the API's scope; a service's
refusal is shown on the page with its status and every field it names. What a form
posts is given to the service as the API's JSON body would give it (``typed_value``, the
review and mark buttons' booleans), so one rule refuses it, in the same words. Accepting a
networking risk needs sudo mode.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from django import forms
from django.http import Http404, HttpResponseRedirect
from django.urls import URLPattern, path
from django.utils import timezone
from django.utils.http import urlencode

from kestrel_one.api.parsers import body_check, json_value
from kestrel_one.common.errors import KestrelError
from kestrel_one.common.injection import hidden_revealed
from kestrel_one.console.base import ConsoleView
from kestrel_one.console.paging import page_of
from kestrel_one.governance.drafts import DiffLine, policy_diff
from kestrel_one.mcp import services
from kestrel_one.mcp.models import McpServer, McpTool
from kestrel_one.mcp.profiles import (
    EGRESS_AWAITING_GATEWAY,
    EGRESS_VOID,
    network_of,
    risk_acceptance_in_force,
    risk_acceptances_in_force,
    server_profile,
)
from kestrel_one.mcp.selectors import (
    PENDING_REVIEW,
    mcp_servers_of,
    risk_acceptance_state,
    risk_acceptances_of,
    tool_body,
    tools_of,
)
from kestrel_one.tenancy.models import Environment
from runners.contract.mcp import (
    BRIDGE_BLOCKED_DESTINATIONS,
    DEFAULT_LIMITS,
    MANAGED_SERVERS,
    WORKSPACE_MOUNTS,
)

TEMPLATES = "console/mcp/"
SERVERS_PER_PAGE = 50
RISKS_PER_PAGE = 50
MANAGED_CHOICES = [(name, name) for name in sorted(MANAGED_SERVERS)]
# The most egress text a form takes (64 entries of the longest host are well under it).
MAX_EGRESS_TEXT = 32 * 1024
LIMIT_NAMES = tuple(DEFAULT_LIMITS)


def _back(url: str, **notice: str) -> HttpResponseRedirect:
    query = f"?{urlencode(notice)}" if notice else ""
    return HttpResponseRedirect(url + query, status=303)


def egress_from_text(raw: str) -> list[Any]:
    """The egress entries an admin typed: a JSON array, or one ``host port protocol`` per
    line (blank lines and ``#`` comments skipped). Only the shape of the text is read here;
    every entry is checked by the service's strict parser, which names each error at its
    path (``egress[2].port``), as it does the API's. A port is read as the API reads JSON
    (``typed_value``), so the parser takes and refuses what it takes and refuses from the
    API. JSON that cannot be read (nested too deeply, a number of too many digits) is a form
    error (``json_value``, the API's parser's reading)."""
    text = raw.strip()
    if not text:
        return []
    if text.startswith("["):
        try:
            value = json_value(text)
        except json.JSONDecodeError as error:
            raise forms.ValidationError(
                f"not valid JSON: {error.msg} (line {error.lineno})"
            ) from None
        if not isinstance(value, list):
            raise forms.ValidationError("must be a JSON array of {host, port, protocol}")
        return value
    entries: list[Any] = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 3:
            raise forms.ValidationError(
                f"line {number}: expected `host port protocol`, e.g. `api.example.com 443 https`"
            )
        host, port, protocol = parts
        entries.append({"host": host, "port": typed_value(port), "protocol": protocol})
    return entries


def typed_value(text: str) -> Any:
    """A value typed into a form (a port, a limit, a command) as the API would have it in
    its JSON body, read by the API's parser (``json_value``): ``443`` is the integer,
    ``443.0`` a number that is no integer, ``["a"]`` an array; text that is no JSON value
    (``0443``, ``+443``, ``NaN``, ``https``, digits too many to read) stays the text. The
    service then takes or refuses it with the API's one rule (a port is an integer 1 to
    65535), never a guess of this form; what it posts is ``body_check``ed first, as a body
    is."""
    try:
        return json_value(text)
    except json.JSONDecodeError:
        return text


def egress_as_text(entries: list[dict]) -> str:
    return "\n".join(f"{e.get('host')} {e.get('port')} {e.get('protocol')}" for e in entries)


class EgressField(forms.CharField):
    widget = forms.Textarea

    def __init__(self, **kwargs):
        super().__init__(required=False, max_length=MAX_EGRESS_TEXT, strip=False, **kwargs)

    def clean(self, value):
        return egress_from_text(super().clean(value) or "")


class InstallForm(forms.Form):
    # The name, the image and a risk's justification are the service's to check, as it
    # checks them from the API: a bound of the form's own would refuse in other words.
    name = forms.CharField(required=False, strip=False)
    environment = forms.ChoiceField(choices=())
    kind = forms.ChoiceField(choices=[("custom", "custom"), ("managed", "managed")])
    image = forms.CharField(required=False)
    managed = forms.ChoiceField(choices=[("", ""), *MANAGED_CHOICES], required=False)
    workspace = forms.ChoiceField(choices=[(m, m) for m in WORKSPACE_MOUNTS], required=False)
    command = forms.CharField(required=False, strip=True)
    egress = EgressField()

    def __init__(self, *args, environments=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["environment"].choices = [(e.public_id, e.name) for e in environments]


class EgressForm(forms.Form):
    egress = EgressField()


def _differs(value: Any, current: Any) -> bool:
    # ``True == 1``: a boolean typed for a number is sent, for the service to refuse.
    return isinstance(value, bool) or value != current


def limits_posted(posted, current: dict | None = None) -> dict[str, Any]:
    """The limits typed into a form (``memory_mb``, ...; empty: as they are), each as the
    API would have it (``typed_value``), those that differ from ``current`` only."""
    limits = {}
    for name in LIMIT_NAMES:
        text = posted.get(name, "").strip()
        if text:
            value = typed_value(text)
            if current is None or _differs(value, current.get(name)):
                limits[name] = value
    return limits


def command_posted(text: str) -> Any:
    """The server's argv typed as a JSON array of strings; empty: the image's own."""
    text = text.strip()
    return typed_value(text) if text else []


def server_changes(server: McpServer, posted) -> dict[str, Any]:
    """What the change form posted that differs from ``server``, as the API's ``PATCH``
    body: only the fields the form has, each as the API would have it. A field of a managed
    server's that is Kestrel's (image, command, workspace) is sent if posted, for the
    service to refuse."""
    changes: dict[str, Any] = {}
    if "image" in posted and posted["image"].strip() != server.reference:
        changes["image"] = posted["image"].strip()
    if "command" in posted:
        command = command_posted(posted["command"])
        if _differs(command, list(server.command)):
            changes["command"] = command
    if "workspace" in posted and posted["workspace"] != server.workspace:
        changes["workspace"] = posted["workspace"]
    limits = limits_posted(posted, dict(server.limits))
    if limits:
        changes["limits"] = limits
    return changes


# What the review and mark buttons post, as the API's booleans. Any other value is passed on
# as posted, for the service to refuse as it refuses it from the API: one rule, one message.
ACCEPT_POSTED = {"yes": True, "no": False}
DANGEROUS_POSTED = {"on": True, "off": False}


def _posted(request, field: str, words: dict[str, bool]) -> Any:
    value = request.POST.get(field)
    return words.get(value, value) if isinstance(value, str) else value


class RiskForm(forms.Form):
    justification = forms.CharField(required=False, strip=False)
    expires_at = forms.DateTimeField(input_formats=["%Y-%m-%dT%H:%M", "%Y-%m-%dT%H:%M:%S"])

    def clean_expires_at(self) -> datetime:
        # The browser's datetime-local has no zone and the page says UTC: the wall-clock
        # time typed is read as UTC whatever the server's current time zone.
        value = self.cleaned_data["expires_at"]
        typed = value if timezone.is_naive(value) else timezone.make_naive(value)
        return typed.replace(tzinfo=UTC)


def _form_errors(form) -> list[str]:
    return [
        f"{'' if field == '__all__' else field + ': '}{message}"
        for field, errors in form.errors.items()
        for message in errors
    ]


def _service_errors(error: KestrelError) -> list[str]:
    """The refusal's message and every field it names (``egress[2].port: ...``), each line
    once (a refusal of one field says it in its message too)."""
    lines = [error.message]
    if isinstance(error.details, dict):
        for field, messages in error.details.items():
            for message in messages if isinstance(messages, list) else [messages]:
                if f"{field}: {message}" not in lines:
                    lines.append(f"{field}: {message}")
    return lines


def servers_listed(organization, page_number: str | None) -> tuple[Any, list[dict[str, Any]]]:
    """One page of the installed servers, and each of them with its networking, in a fixed
    number of queries: the risk acceptances in force are read once for the page."""
    pages = page_of(
        mcp_servers_of(organization).order_by("environment__name", "name", "pk"),
        page_number,
        per_page=SERVERS_PER_PAGE,
    )
    servers = list(pages)
    in_force = risk_acceptances_in_force(servers)
    return pages, [
        {"server": server, "network": network_of(server, in_force.get(server.pk))}
        for server in servers
    ]


def danger_reasons(tool: McpTool) -> list[str]:
    """Why ``tool.dangerous`` is true (the POL-8 rule of ``McpTool.dangerous``)."""
    hints = tool.annotations
    reasons = []
    if tool.marked_dangerous:
        reasons.append("an admin marked it dangerous")
    if hints.get("destructiveHint") is True:
        reasons.append("its annotations say destructiveHint")
    if hints.get("readOnlyHint") is not True:
        reasons.append("its annotations do not say readOnlyHint")
    return reasons


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)


def _shown(text: Any) -> str:
    """A server's own text as the page shows it: every character a person could not see
    (a bidi control, a zero-width or tag character) as ``[U+XXXX]``, so that what an admin
    reads and accepts is all that an agent's model will read (``injection.hidden_revealed``)."""
    return hidden_revealed(text if isinstance(text, str) else "" if text is None else str(text))


def tool_view(tool: McpTool) -> dict[str, Any]:
    """What the page shows of one recorded tool, and of its pending definition. Everything
    the server wrote (name, title, description, schemas, annotations) is ``_shown``."""
    definition = tool.definition or {}
    # The API's body of the tool: its flags (read from the text now) and the fields that
    # differ are the API's, computed once.
    body = tool_body(tool)
    pending = None
    if tool.pending_definition is not None:
        new = tool.pending_definition
        pending = {
            "definition": new,
            "pretty": _shown(_pretty(new)),
            "description": _shown(new.get("description", "")),
            "sha256": tool.pending_sha256,
            "flags": body["pending"]["flags"],
            "seen_at": tool.pending_seen_at,
            "diff": [
                DiffLine(line.kind, _shown(line.text))
                for line in policy_diff(definition or None, new)
            ],
            # The definition fields that differ (the API's ``pending.diff``).
            "fields": sorted(body["pending"]["diff"]),
        }
    return {
        "tool": tool,
        "flags": body["flags"],
        "name": _shown(tool.name),
        "title": _shown(definition.get("title", "")),
        "description": _shown(definition.get("description", "")),
        "schema": _shown(_pretty(tool.input_schema)),
        "annotations": _shown(_pretty(tool.annotations)) if tool.annotations else "",
        "recorded": _shown(_pretty(definition)),
        "dangerous": tool.dangerous,
        "reasons": danger_reasons(tool),
        "pending": pending,
    }


class McpServersView(ConsoleView):
    """``/console/{org}/mcp-servers``: the installed servers and, for admins, the install
    form (the API's ``POST .../mcp-servers``)."""

    scope_map = {"GET": "org:read", "POST": "mcp:write"}
    section = "mcp"

    def environments(self):
        return Environment.objects.filter(organization=self.organization).order_by("name")

    def get(self, request, org: str):
        return self.servers_page(InstallForm(environments=self.environments()))

    def post(self, request, org: str):
        environments = list(self.environments())
        form = InstallForm(request.POST, environments=environments)
        if not form.is_valid():
            return self.servers_page(form, status=400, errors=_form_errors(form))
        data = form.cleaned_data
        environment = next(e for e in environments if e.public_id == data["environment"])
        custom = data["kind"] == "custom"
        typed = {"limits": limits_posted(request.POST) or None, "egress": data["egress"]}
        typed["command"] = command_posted(data["command"]) if custom else None
        try:
            body_check(typed)
            server = services.mcp_server_install(
                actor=self.principal,
                organization=self.organization,
                name=data["name"],
                environment=environment,
                image=data["image"].strip() if custom else None,
                managed=None if custom else data["managed"],
                workspace=(data["workspace"] or None) if custom else None,
                command=typed["command"],
                limits=typed["limits"],
                egress=typed["egress"],
            )
        except KestrelError as error:
            return self.servers_page(form, status=error.status, errors=_service_errors(error))
        return _back(f"/console/{org}/mcp-servers/{server.public_id}", installed="1")

    def servers_page(self, form, *, status: int = 200, errors: list[str] | None = None):
        pages, rows = servers_listed(self.organization, self.request.GET.get("page"))
        context = {
            "form": form,
            "pages": pages,
            "rows": rows,
            "environments": self.environments(),
            "managed_choices": MANAGED_CHOICES,
            "workspace_choices": WORKSPACE_MOUNTS,
            "default_limits": DEFAULT_LIMITS,
            "can_write": self.can("mcp:write"),
            "errors": errors or [],
            "notice": {"removed": self.request.GET.get("removed", "")[:40]},
        }
        return self.page(TEMPLATES + "servers.html", context, status=status)


class _OneServer(ConsoleView):
    scope_map = {"GET": "org:read", "POST": "mcp:write"}
    section = "mcp"

    def resolve_parents(self, **kwargs: Any) -> None:
        server = (
            McpServer.objects.for_org(self.organization)
            .installed()
            .select_related("environment")
            .filter(public_id=kwargs.get("mcp"))
            .first()
        )
        if server is None:
            raise Http404
        self.server = server

    def back_to(self) -> str:
        return self.server_url()

    def server_url(self) -> str:
        return f"/console/{self.organization.slug}/mcp-servers/{self.server.public_id}"

    def server_page(self, *, status: int = 200, errors: list[str] | None = None, **extra: Any):
        server = self.server
        now = timezone.now()
        tools = [tool_view(tool) for tool in tools_of(server)]
        acceptances = risk_acceptances_of(server).select_related("accepted_by", "withdrawn_by")
        # In pages, newest first, as the API's list: none is left off the page.
        risk_pages = page_of(
            acceptances.order_by("-created_at", "-pk"),
            self.request.GET.get("page"),
            per_page=RISKS_PER_PAGE,
        )
        risks = [
            {"risk": risk, "state": risk_acceptance_state(risk, now=now)} for risk in risk_pages
        ]
        profile = server_profile(server, now=now)
        context = {
            "server": server,
            # A runner's words about the server, which may quote the server's own output.
            "error_message": _shown((server.error or {}).get("message", "")),
            "profile": _pretty(profile),
            "network": network_of(server, risk_acceptance_in_force(server, now=now)),
            "tools": tools,
            # A removed tool keeps what it last listed as pending, but nothing of it can be
            # reviewed (the service refuses): only the states the server's count names.
            "pending": [
                view
                for view in tools
                if view["pending"] is not None and view["tool"].state in PENDING_REVIEW
            ],
            "risks": risks,
            "risk_pages": risk_pages,
            "egress_text": extra.pop("egress_text", egress_as_text(server.egress)),
            "command_text": json.dumps(list(server.command)) if server.command else "",
            "workspace_choices": WORKSPACE_MOUNTS,
            "egress_awaiting": EGRESS_AWAITING_GATEWAY,
            "egress_void": EGRESS_VOID,
            "bridge_blocked": BRIDGE_BLOCKED_DESTINATIONS,
            "can_write": self.can("mcp:write"),
            "errors": errors or [],
            "notice": {
                key: _shown(self.request.GET.get(key, "")[:40])
                for key in (
                    "installed",
                    "changed",
                    "egress",
                    "refreshed",
                    "reviewed",
                    "marked",
                    "accepted",
                    "withdrawn",
                )
            },
            **extra,
        }
        return self.page(TEMPLATES + "server.html", context, status=status)


class McpServerView(_OneServer):
    """``/console/{org}/mcp-servers/{mcp}``: the server's page; its POST authors the egress
    entries (the API's ``PATCH`` with ``egress``: approving them for the current image and
    base profile)."""

    def get(self, request, org: str, mcp: str):
        return self.server_page()

    def post(self, request, org: str, mcp: str):
        form = EgressForm(request.POST)
        if not form.is_valid():
            return self.server_page(
                status=400, errors=_form_errors(form), egress_text=request.POST.get("egress", "")
            )
        changes = {"egress": form.cleaned_data["egress"]}
        try:
            body_check(changes)
            services.mcp_server_update(actor=self.principal, server=self.server, changes=changes)
        except KestrelError as error:
            return self.server_page(
                status=error.status,
                errors=_service_errors(error),
                egress_text=request.POST.get("egress", ""),
            )
        return _back(self.server_url(), egress="1")


class McpServerChangeView(_OneServer):
    """``POST .../mcp-servers/{mcp}/change``: the API's ``PATCH`` of what the server runs
    (image, command, workspace: a person's decision, so sudo mode) and its limits, with the
    fields that differ from the server's (``server_changes``). A new image or command is a
    new discovery; any change of them voids the egress grant and the risk acceptances."""

    scope_map = {"POST": "mcp:write"}

    def post(self, request, org: str, mcp: str):
        changes = server_changes(self.server, request.POST)
        if not changes:
            return self.server_page(
                status=400,
                errors=["Nothing to change: every field is as the server has it."],
            )
        try:
            body_check(changes)
            services.mcp_server_update(actor=self.principal, server=self.server, changes=changes)
        except KestrelError as error:
            return self.server_page(status=error.status, errors=_service_errors(error))
        return _back(self.server_url(), changed="1")


class McpServerRefreshView(_OneServer):
    """``POST .../mcp-servers/{mcp}/refresh``: a new discovery of its tools."""

    scope_map = {"POST": "mcp:write"}

    def post(self, request, org: str, mcp: str):
        try:
            services.mcp_server_refresh(actor=self.principal, server=self.server)
        except KestrelError as error:
            return self.server_page(status=error.status, errors=_service_errors(error))
        return _back(self.server_url(), refreshed="1")


class McpServerRemoveView(_OneServer):
    """``POST .../mcp-servers/{mcp}/remove``: as the API's ``DELETE`` (kept for the records,
    never callable again)."""

    scope_map = {"POST": "mcp:write"}

    def post(self, request, org: str, mcp: str):
        try:
            services.mcp_server_remove(actor=self.principal, server=self.server)
        except KestrelError as error:
            return self.server_page(status=error.status, errors=_service_errors(error))
        return _back(f"/console/{org}/mcp-servers", removed=self.server.public_id)


class _OneTool(_OneServer):
    scope_map = {"POST": "mcp:write"}

    def resolve_parents(self, **kwargs: Any) -> None:
        super().resolve_parents(**kwargs)
        tool = self.server.tools.filter(name=kwargs.get("tool")).first()
        if tool is None:
            raise Http404
        self.tool = tool


class McpToolReviewView(_OneTool):
    """``POST .../tools/{tool}/review``: accept the pending definition, or keep the tool
    disabled (the API's ``{"accept": true|false}``)."""

    def post(self, request, org: str, mcp: str, tool: str):
        try:
            services.mcp_tool_review(
                actor=self.principal,
                tool=self.tool,
                accept=_posted(request, "accept", ACCEPT_POSTED),
                # The definition the page showed (its hidden field): accepting adopts it,
                # never one listed since. Empty is none given, as the API's field left out.
                sha256=request.POST.get("sha256") or None,
            )
        except KestrelError as error:
            return self.server_page(status=error.status, errors=_service_errors(error))
        return _back(self.server_url(), reviewed=self.tool.name[:40])


class McpToolMarkView(_OneTool):
    """``POST .../tools/{tool}/mark``: an admin's dangerous marking (unmarking removes only
    that mark, never what the annotations declare)."""

    def post(self, request, org: str, mcp: str, tool: str):
        dangerous = _posted(request, "dangerous", DANGEROUS_POSTED)
        try:
            services.mcp_tool_mark(actor=self.principal, tool=self.tool, dangerous=dangerous)
        except KestrelError as error:
            return self.server_page(status=error.status, errors=_service_errors(error))
        return _back(self.server_url(), marked=self.tool.name[:40])


class McpRiskAcceptView(_OneServer):
    """``POST .../mcp-servers/{mcp}/risk-acceptances``: unrestricted networking for a custom
    server, justified and expiring (MCP-4). Needs sudo mode."""

    scope_map = {"POST": "mcp:write"}
    sudo_for = {"POST": "accept a networking risk for an MCP server"}

    def post(self, request, org: str, mcp: str):
        form = RiskForm(request.POST)
        if not form.is_valid():
            return self.server_page(status=400, errors=_form_errors(form))
        try:
            risk = services.mcp_risk_accept(
                actor=self.principal,
                server=self.server,
                justification=form.cleaned_data["justification"],
                expires_at=form.cleaned_data["expires_at"],
            )
        except KestrelError as error:
            return self.server_page(status=error.status, errors=_service_errors(error))
        return _back(self.server_url(), accepted=risk.public_id)


class McpRiskWithdrawView(_OneServer):
    """``POST .../risk-acceptances/{rsk}/withdraw``: back to network-off on the next start."""

    scope_map = {"POST": "mcp:write"}

    def resolve_parents(self, **kwargs: Any) -> None:
        super().resolve_parents(**kwargs)
        risk = self.server.risk_acceptances.filter(public_id=kwargs.get("rsk")).first()
        if risk is None:
            raise Http404
        self.risk = risk

    def post(self, request, org: str, mcp: str, rsk: str):
        try:
            services.mcp_risk_withdraw(actor=self.principal, acceptance=self.risk)
        except KestrelError as error:
            return self.server_page(status=error.status, errors=_service_errors(error))
        return _back(self.server_url(), withdrawn=self.risk.public_id)


ORG = "console/<slug:org>/mcp-servers"

urlpatterns: list[URLPattern] = [
    path(ORG, McpServersView.as_view(), name="console_mcp_servers"),
    path(f"{ORG}/<str:mcp>", McpServerView.as_view(), name="console_mcp_server"),
    path(f"{ORG}/<str:mcp>/change", McpServerChangeView.as_view(), name="console_mcp_change"),
    path(f"{ORG}/<str:mcp>/refresh", McpServerRefreshView.as_view(), name="console_mcp_refresh"),
    path(f"{ORG}/<str:mcp>/remove", McpServerRemoveView.as_view(), name="console_mcp_remove"),
    # A tool's name is the server's text and may hold "/" (the page percent-encodes it).
    path(
        f"{ORG}/<str:mcp>/tools/<path:tool>/review",
        McpToolReviewView.as_view(),
        name="console_mcp_tool_review",
    ),
    path(
        f"{ORG}/<str:mcp>/tools/<path:tool>/mark",
        McpToolMarkView.as_view(),
        name="console_mcp_tool_mark",
    ),
    path(
        f"{ORG}/<str:mcp>/risk-acceptances",
        McpRiskAcceptView.as_view(),
        name="console_mcp_risk_accept",
    ),
    path(
        f"{ORG}/<str:mcp>/risk-acceptances/<str:rsk>/withdraw",
        McpRiskWithdrawView.as_view(),
        name="console_mcp_risk_withdraw",
    ),
]
