"""Console: the administration pages (SURF-2): tokens, members, runners, the audit log,
retention and webhooks.

Each page reads through the selector the API reads through for the same objects, writes
through the service the API calls, and asks for the scope the API's viewset asks for: the
console never decides on its own who sees or changes what. A service's refusal
(``KestrelError``) is shown on the page with its status.
"""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta
from typing import Any

from django import forms
from django.conf import settings
from django.http import Http404, HttpResponse, HttpResponseRedirect
from django.urls import URLPattern, path
from django.utils import timezone
from django.utils.http import urlencode

from kestrel_one.accounts.scopes import PERSON_ONLY_SCOPES, SCOPES, Role
from kestrel_one.accounts.selectors import (
    MADE_BY_LISTED,
    integration_tokens_made_by,
    tokens_visible_to,
)
from kestrel_one.accounts.services import token_create, token_revoke
from kestrel_one.accounts.sign_in_links import sign_in_link_allowed
from kestrel_one.artifacts.api import MAX_RETENTION_DAYS
from kestrel_one.artifacts.retention import RETENTION_FIELDS, retention_update
from kestrel_one.artifacts.selectors import retention_for
from kestrel_one.audit.api import AuditQuerySerializer, AuditRecordSerializer
from kestrel_one.audit.heads import audit_head_sign
from kestrel_one.audit.selectors import (
    audit_chain_verify,
    audit_records_chained,
    audit_records_filter,
)
from kestrel_one.audit.services import audit_chain_settle
from kestrel_one.common.errors import KestrelError
from kestrel_one.console.base import ConsoleView
from kestrel_one.console.paging import page_of
from kestrel_one.console.sudo import sudo_fresh, sudo_redirect
from kestrel_one.execution.enrollment import runner_revoke_for_organization, runners_serving
from kestrel_one.tenancy import services as tenancy_services
from kestrel_one.tenancy.models import Project
from kestrel_one.tenancy.selectors import (
    MemberProjects,
    member_project_grants,
    member_projects_seen,
    memberships_of,
)
from kestrel_one.webhooks import services as webhook_services
from kestrel_one.webhooks.events import EVENT_TYPES
from kestrel_one.webhooks.models import DeliveryState
from kestrel_one.webhooks.selectors import deliveries_for_endpoint, webhook_endpoints_of

# Rows per page on every list here: the pages stay bounded however much an organization has.
PAGE_SIZE = 50
TEMPLATES = "console/administration/"


def _page_of(request, queryset, *, per_page: int = PAGE_SIZE):
    """One page of ``queryset`` (already ordered) from ``?page=``; an unknown page is the last."""
    return page_of(queryset, request.GET.get("page"), per_page=per_page)


def _no_store(response: HttpResponse) -> HttpResponse:
    """A page holding a secret shown once: no cache keeps it."""
    response["Cache-Control"] = "no-store"
    return response


def _back(url: str, **notice: str) -> HttpResponseRedirect:
    """After a write: back to the page (a GET), with what happened for the notice."""
    query = f"?{urlencode(notice)}" if notice else ""
    return HttpResponseRedirect(url + query, status=303)


# --- tokens ------------------------------------------------------------------------------------


class TokenForm(forms.Form):
    """A person's own token, made from the console: the only place (besides an operator's
    command) a token gets ``actions:approve``. A token made here is the root of its lineage.
    Every scope is a choice: the service refuses (403) one the person does not hold."""

    name = forms.CharField(max_length=200)
    scopes = forms.MultipleChoiceField(
        choices=sorted((scope, scope) for scope in SCOPES), widget=forms.CheckboxSelectMultiple
    )
    days = forms.IntegerField(
        required=False,
        min_value=1,
        max_value=settings.KESTREL_TOKEN_MAX_TTL.days,
        help_text="Lifetime in days; the default when empty.",
    )


def token_state(token, now) -> str:
    if token.revoked_at is not None:
        return "revoked"
    if token.expires_at <= now:
        return "expired"
    return "active"


class TokensView(ConsoleView):
    """``/console/{org}/tokens``: the person's own tokens and, for ``tokens:admin``, every
    token of the organization; a form to make one, whose secret is shown once, here."""

    # As the API's TokenViewSet: anyone reads their own; tokens:write makes one.
    scope_map = {"GET": "org:read", "POST": "tokens:write"}
    section = "tokens"

    def get(self, request, org: str):
        return self.tokens_page(TokenForm())

    def post(self, request, org: str):
        form = TokenForm(request.POST)
        if not form.is_valid():
            return self.tokens_page(form, status=400)
        data = form.cleaned_data
        if PERSON_ONLY_SCOPES & set(data["scopes"]) and not sudo_fresh(request):
            # Only this kind of token needs sudo mode, so the check is here, not sudo_for.
            return sudo_redirect(
                request, back_to=self.back_to(), what="create a token that can approve actions"
            )
        days = data.get("days")
        try:
            token, plaintext = token_create(
                actor=self.principal,
                organization=self.organization,
                name=data["name"],
                scopes=data["scopes"],
                expires_at=timezone.now() + timedelta(days=days) if days else None,
            )
        except KestrelError as error:
            form.add_error(None, error.message)
            return self.tokens_page(form, status=error.status)
        return _no_store(self.tokens_page(TokenForm(), created=token, plaintext=plaintext))

    def tokens_page(self, form, *, status: int = 200, error: str = "", **extra: Any):
        now = timezone.now()
        visible = tokens_visible_to(principal=self.principal, organization=self.organization)
        # A person's own tokens: the newest PAGE_SIZE (older ones are on the API's list).
        mine = list(
            visible.filter(user=self.principal.user).order_by("-created_at", "-pk")[:PAGE_SIZE]
        )
        others = None
        if self.can("tokens:admin"):
            others = _page_of(
                self.request,
                visible.exclude(user=self.principal.user).order_by("-created_at", "-pk"),
            )
        held = self.scopes
        context = {
            "form": form,
            "mine": [(token, token_state(token, now)) for token in mine],
            "mine_capped": len(mine) == PAGE_SIZE,
            "others": others,
            "others_rows": [(t, token_state(t, now)) for t in others] if others else [],
            "scope_choices": [(scope, SCOPES[scope]) for scope in sorted(held & set(SCOPES))],
            "chosen": set(form["scopes"].value() or []),
            "person_only": sorted(PERSON_ONLY_SCOPES),
            "max_days": settings.KESTREL_TOKEN_MAX_TTL.days,
            "default_days": settings.KESTREL_TOKEN_DEFAULT_TTL.days,
            "revoked": self.request.GET.get("revoked", "")[:40],
            "error": error,
            **extra,
        }
        return self.page(TEMPLATES + "tokens.html", context, status=status)


class TokenRevokeView(TokensView):
    """``POST /console/{org}/tokens/{tok}/revoke``: as the API's ``DELETE .../tokens/{id}``."""

    scope_map = {"POST": "tokens:write"}

    def resolve_parents(self, **kwargs: Any) -> None:
        # Among the tokens this person sees: someone else's token is a 404 to a non-admin.
        self.token = (
            tokens_visible_to(principal=self.principal, organization=self.organization)
            .filter(public_id=kwargs.get("tok"))
            .first()
        )
        if self.token is None:
            raise Http404

    def post(self, request, org: str, tok: str):
        try:
            token_revoke(actor=self.principal, token=self.token)
        except KestrelError as error:
            return self.tokens_page(TokenForm(), status=error.status, error=error.message)
        return _back(f"/console/{org}/tokens", revoked=self.token.public_id)


# --- members -----------------------------------------------------------------------------------

ROLE_CHOICES = [(role.value, role.value) for role in Role]
ACCESS_CHOICES = [("all", "Every project"), ("some", "Only the projects chosen below")]


class ProjectAccessForm(forms.Form):
    """Which projects a member sees: every one, or the chosen ones (among the projects the
    person granting them sees: nobody grants what they cannot see)."""

    access = forms.ChoiceField(choices=ACCESS_CHOICES, widget=forms.RadioSelect, initial="all")
    projects = forms.ModelMultipleChoiceField(
        queryset=Project.objects.none(),
        to_field_name="public_id",
        required=False,
        widget=forms.CheckboxSelectMultiple,
    )

    def __init__(self, *args, projects, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["projects"].queryset = projects

    def chosen_projects(self) -> list[Project] | None:
        """None: every project; else exactly those chosen (possibly none)."""
        if self.cleaned_data["access"] == "all":
            return None
        return sorted(self.cleaned_data["projects"], key=lambda p: p.name)


class MemberAddForm(ProjectAccessForm):
    email = forms.EmailField()
    name = forms.CharField(max_length=200, required=False)
    role = forms.ChoiceField(choices=ROLE_CHOICES, initial=Role.MEMBER.value)

    field_order = ["email", "name", "role", "access", "projects"]


class MemberChangeForm(ProjectAccessForm):
    role = forms.ChoiceField(choices=ROLE_CHOICES)

    field_order = ["role", "access", "projects"]


class MembersView(ConsoleView):
    """``/console/{org}/members``: who belongs to the organization, their role and, for
    limited members, their projects; ``members:write`` adds a member (the one-time sign-in
    link shown once, here)."""

    # As the API's MembershipViewSet: everyone reads; members:write adds.
    scope_map = {"GET": "org:read", "POST": "members:write"}
    section = "members"

    def visible_projects(self):
        return Project.objects.visible_to(self.principal, self.organization).order_by("name")

    def get(self, request, org: str):
        return self.members_page(MemberAddForm(projects=self.visible_projects()))

    def post(self, request, org: str):
        form = MemberAddForm(request.POST, projects=self.visible_projects())
        if not form.is_valid():
            return self.members_page(form, status=400)
        data = form.cleaned_data
        try:
            added = tenancy_services.member_add(
                actor=self.principal,
                organization=self.organization,
                email=data["email"],
                name=data["name"],
                role=Role(data["role"]),
                projects=form.chosen_projects(),
                # As the API: the operator's public address when set, else this request's.
                base_url=settings.KESTREL_PUBLIC_URL or request.build_absolute_uri("/"),
            )
        except KestrelError as error:
            form.add_error(None, error.message)
            return self.members_page(form, status=error.status)
        fresh = MemberAddForm(projects=self.visible_projects())
        return _no_store(self.members_page(fresh, added=added))

    def projects_shown(self, memberships) -> dict[int, MemberProjects]:
        return member_projects_seen(memberships, self.principal, self.organization)

    def members_page(self, form, *, status: int = 200, **extra: Any):
        members = _page_of(self.request, memberships_of(self.organization).order_by("created_at"))
        rows = list(members)
        shown = self.projects_shown(rows)
        context = {
            "form": form,
            "members": members,
            "rows": [(m, shown.get(m.user_id)) for m in rows],
            "removed": self.request.GET.get("removed", "")[:200],
            **extra,
        }
        return self.page(TEMPLATES + "members.html", context, status=status)


class MemberView(MembersView):
    """``/console/{org}/members/{mem}``: one member; ``members:write`` changes their role and
    projects (POST here) or removes them (``.../remove``). The grant rules are the service's:
    nobody grants more than they hold, nor manages someone who outranks them."""

    scope_map = {"GET": "org:read", "POST": "members:write"}

    def resolve_parents(self, **kwargs: Any) -> None:
        self.membership = (
            memberships_of(self.organization).filter(public_id=kwargs.get("mem")).first()
        )
        if self.membership is None:
            raise Http404

    def granted(self) -> list[Project]:
        return member_project_grants([self.membership]).get(self.membership.user_id, [])

    def change_form(self, data=None) -> MemberChangeForm:
        initial = {
            "role": self.membership.role,
            "access": "all" if self.membership.all_projects else "some",
            "projects": [p.public_id for p in self.granted()],
        }
        return MemberChangeForm(data, initial=initial, projects=self.visible_projects())

    def get(self, request, org: str, mem: str):
        return self.member_page(self.change_form())

    def post(self, request, org: str, mem: str):
        form = self.change_form(request.POST)
        if not form.is_valid():
            return self.member_page(form, status=400)
        role = Role(form.cleaned_data["role"])
        chosen = form.chosen_projects()
        current = None if self.membership.all_projects else self.granted()
        projects_changed = (chosen is None) != (current is None) or (
            chosen is not None and {p.pk for p in chosen} != {p.pk for p in current or []}
        )
        if role == self.membership.role and not projects_changed:
            return _back(self.request.path, changed="nothing")
        try:
            tenancy_services.membership_update(
                actor=self.principal,
                membership=self.membership,
                role=role if role != self.membership.role else None,
                projects=chosen if projects_changed else None,
                all_projects=projects_changed and chosen is None,
            )
        except KestrelError as error:
            form.add_error(None, error.message)
            return self.member_page(form, status=error.status)
        return _back(self.request.path, changed="saved")

    def member_page(self, form, *, status: int = 200, error: str = "", **extra: Any):
        # Named only to whoever may see every token (tokens:admin), as on the tokens page.
        made = (
            integration_tokens_made_by(user=self.membership.user, organization=self.organization)
            if self.can("tokens:admin")
            else []
        )
        context = {
            **extra,
            "member": self.membership,
            "projects": self.projects_shown([self.membership]).get(self.membership.user_id),
            "form": form,
            "error": error,
            "changed": self.request.GET.get("changed", ""),
            "is_self": self.membership.user_id == self.principal.user.pk,
            # No password, no other organization: a one-time link is their way in.
            "no_way_in": sign_in_link_allowed(self.membership.user, self.organization),
            # They outlive the membership; whoever removes it should know of them.
            "integration_tokens_made": made,
            "integration_tokens_capped": len(made) == MADE_BY_LISTED,
        }
        return self.page(TEMPLATES + "member.html", context, status=status)


class MemberSignInLinkView(MemberView):
    """``POST /console/{org}/members/{mem}/sign-in-link``: a new one-time sign-in link for a
    member who still has no way in (one withheld from the integration that added them, or one
    that expired unused), shown once on the member page."""

    scope_map = {"POST": "members:write"}
    # As a token with actions:approve: the link carries a person's whole authority.
    sudo_for = {"POST": "make a sign-in link"}

    def back_to(self) -> str:
        return f"/console/{self.organization.slug}/members/{self.membership.public_id}"

    def post(self, request, org: str, mem: str):
        try:
            made = tenancy_services.member_sign_in_link(
                actor=self.principal,
                membership=self.membership,
                base_url=settings.KESTREL_PUBLIC_URL or request.build_absolute_uri("/"),
            )
        except KestrelError as error:
            return self.member_page(self.change_form(), status=error.status, error=error.message)
        return _no_store(self.member_page(self.change_form(), made=made))


class MemberRemoveView(MemberView):
    """``POST /console/{org}/members/{mem}/remove``: as the API's ``DELETE .../members/{id}``;
    the member's tokens in this organization stop working with it."""

    scope_map = {"POST": "members:write"}

    def post(self, request, org: str, mem: str):
        email = self.membership.user.email
        leaving = self.membership.user_id == self.principal.user.pk
        try:
            tenancy_services.membership_remove(actor=self.principal, membership=self.membership)
        except KestrelError as error:
            return self.member_page(self.change_form(), status=error.status, error=error.message)
        if leaving:
            return HttpResponseRedirect("/console/", status=303)
        return _back(f"/console/{org}/members", removed=email)


# --- runners -----------------------------------------------------------------------------------


def key_fingerprint(runner) -> str:
    """As the API's: SHA-256 of the runner's public key (PEM)."""
    return hashlib.sha256(runner.public_key.encode()).hexdigest()


class RunnersView(ConsoleView):
    """``/console/{org}/runners``: the runners that serve the organization (its own and the
    shared ones of the default pool), when each was last seen; revoke its own."""

    # As the API's RunnerViewSet: runners:write reads and revokes.
    scope_map = {"GET": "runners:write"}
    section = "runners"

    def get(self, request, org: str):
        return self.runners_page()

    def runners_page(self, *, status: int = 200, error: str = ""):
        runners = _page_of(
            self.request, runners_serving(self.organization).order_by("-enrolled_at", "-pk")
        )
        context = {
            "runners": runners,
            "rows": [(runner, key_fingerprint(runner)) for runner in runners],
            "revoked": self.request.GET.get("revoked", "")[:40],
            "error": error,
        }
        return self.page(TEMPLATES + "runners.html", context, status=status)


class RunnerRevokeView(RunnersView):
    """``POST /console/{org}/runners/{run}/revoke``: as the API's ``DELETE .../runners/{id}``."""

    scope_map = {"POST": "runners:write"}

    def resolve_parents(self, **kwargs: Any) -> None:
        self.runner = runners_serving(self.organization).filter(public_id=kwargs.get("run")).first()
        if self.runner is None:
            raise Http404

    def post(self, request, org: str, run: str):
        try:
            runner_revoke_for_organization(actor=self.principal, runner=self.runner)
        except KestrelError as error:
            return self.runners_page(status=error.status, error=error.message)
        return _back(f"/console/{org}/runners", revoked=self.runner.public_id)


# --- audit -------------------------------------------------------------------------------------

AUDIT_FILTERS = tuple(AuditQuerySerializer().fields)


class AuditView(ConsoleView):
    """``/console/{org}/audit``: the audit log newest first, filtered by actor, action,
    target, outcome and time (the API's filters, validated by its serializer), a page at a
    time, each record's data as the API projects it (redacted, bounded)."""

    # As the API's audit viewsets: audit:read (owners, admins, auditors).
    scope_map = {"GET": "audit:read"}
    section = "audit"

    def get(self, request, org: str):
        return self.audit_page()

    def audit_page(self, *, verification: dict | None = None):
        audit_chain_settle(self.organization)  # what is committed is listed, as in the API
        given = {name: self.request.GET.get(name, "").strip() for name in AUDIT_FILTERS}
        query = AuditQuerySerializer(data={k: v for k, v in given.items() if v})
        errors: dict[str, list[str]] = {}
        records: list[dict] = []
        older = None
        if query.is_valid():
            queryset = audit_records_filter(
                audit_records_chained(self.organization), **query.validated_data
            ).order_by("-sequence")
            before = self.request.GET.get("before", "")
            if before.isdigit():
                queryset = queryset.filter(sequence__lt=int(before))
            rows = list(queryset[: PAGE_SIZE + 1])
            if len(rows) > PAGE_SIZE:
                rows = rows[:PAGE_SIZE]
                older = urlencode(
                    {**{k: v for k, v in given.items() if v}, "before": rows[-1].sequence}
                )
            # Written as it reads (not \u escapes): a name keeps its letters, and a character
            # nobody can see is drawn as [U+XXXX] as on every page (``page_revealed``).
            records = [
                {
                    **item,
                    "data_json": json.dumps(
                        item["data"], indent=2, sort_keys=True, ensure_ascii=False
                    ),
                }
                for item in AuditRecordSerializer(rows, many=True).data
            ]
        else:
            errors = {name: [str(e) for e in messages] for name, messages in query.errors.items()}
        context = {
            "filters": given,
            "filter_errors": errors,
            "records": records,
            "older": older,
            "first_page": not self.request.GET.get("before"),
            "verification": verification,
        }
        return self.page(TEMPLATES + "audit.html", context, status=400 if errors else 200)


class AuditVerifyView(AuditView):
    """``POST /console/{org}/audit/verify``: walk the chain (``audit_chain_verify``, what
    ``manage.py audit_verify`` runs) and show the result with the signed head, what
    ``GET /api/v1/orgs/{org}/audit/head`` returns, for an auditor to keep."""

    scope_map = {"POST": "audit:read"}

    def post(self, request, org: str):
        audit_chain_settle(self.organization)
        result = audit_chain_verify(self.organization)
        head = audit_head_sign(self.organization)
        verification = {
            "result": result,
            "head": head,
            "head_json": json.dumps(head, indent=2),
        }
        if request.headers.get("HX-Request") == "true":
            return self.page(TEMPLATES + "audit_verification.html", {"verification": verification})
        return self.audit_page(verification=verification)


# --- retention ---------------------------------------------------------------------------------

RETENTION_LABELS = {
    "events_days": "Thread events and replay data",
    "artifacts_days": "Artifacts",
    "checkpoints_days": "Checkpoints",
    "audit_days": "Audit log",
}


class RetentionForm(forms.Form):
    """The API's bounds (artifacts.api.RetentionSerializer): 1 to MAX_RETENTION_DAYS days."""

    events_days = forms.IntegerField(min_value=1, max_value=MAX_RETENTION_DAYS)
    artifacts_days = forms.IntegerField(min_value=1, max_value=MAX_RETENTION_DAYS)
    checkpoints_days = forms.IntegerField(min_value=1, max_value=MAX_RETENTION_DAYS)
    audit_days = forms.IntegerField(min_value=1, max_value=MAX_RETENTION_DAYS)


class RetentionView(ConsoleView):
    """``/console/{org}/retention``: how many days the organization keeps each kind of
    record; ``retention:write`` changes it (the retention sweep deletes what is older)."""

    # As the API's RetentionViewSet: everyone reads; retention:write changes.
    scope_map = {"GET": "org:read", "POST": "retention:write"}
    section = "retention"

    def get(self, request, org: str):
        retention = retention_for(self.organization)
        initial = {name: getattr(retention, name) for name in RETENTION_FIELDS}
        return self.retention_page(RetentionForm(initial=initial), retention)

    def post(self, request, org: str):
        retention = retention_for(self.organization)
        form = RetentionForm(request.POST)
        if not form.is_valid():
            return self.retention_page(form, retention, status=400)
        try:
            retention_update(
                actor=self.principal, organization=self.organization, values=form.cleaned_data
            )
        except KestrelError as error:
            form.add_error(None, error.message)
            return self.retention_page(form, retention, status=error.status)
        return _back(self.request.path, saved="1")

    def retention_page(self, form, retention, *, status: int = 200):
        context = {
            "form": form,
            "rows": [
                (RETENTION_LABELS[name], form[name], getattr(retention, name))
                for name in RETENTION_FIELDS
            ],
            "retention": retention,
            "max_days": MAX_RETENTION_DAYS,
            "saved": self.request.GET.get("saved") == "1",
        }
        return self.page(TEMPLATES + "retention.html", context, status=status)


# --- webhooks ----------------------------------------------------------------------------------


class WebhookForm(forms.Form):
    url = forms.CharField(max_length=2048, label="URL")
    description = forms.CharField(max_length=200, required=False)
    event_types = forms.MultipleChoiceField(
        choices=sorted((name, name) for name in EVENT_TYPES), widget=forms.CheckboxSelectMultiple
    )
    enabled = forms.BooleanField(required=False, initial=True)


class WebhooksView(ConsoleView):
    """``/console/{org}/webhooks``: the endpoints events are sent to (the signing secret never
    shown again after creation; its fingerprint is); a form to add one."""

    # As the API's webhook viewsets: webhooks:write reads (it shows where events go) and writes.
    scope_map = {"GET": "webhooks:write", "POST": "webhooks:write"}
    section = "webhooks"

    def get(self, request, org: str):
        return self.webhooks_page(WebhookForm())

    def post(self, request, org: str):
        form = WebhookForm(request.POST)
        if not form.is_valid():
            return self.webhooks_page(form, status=400)
        try:
            endpoint, secret = webhook_services.webhook_endpoint_create(
                actor=self.principal, organization=self.organization, **form.cleaned_data
            )
        except KestrelError as error:
            form.add_error(None, error.message)
            return self.webhooks_page(form, status=error.status)
        return _no_store(self.webhooks_page(WebhookForm(), created=endpoint, secret=secret))

    def webhooks_page(self, form, *, status: int = 200, **extra: Any):
        # At most MAX_ENDPOINTS_PER_ORGANIZATION (20): one page.
        endpoints = webhook_endpoints_of(self.organization).order_by("-created_at", "-pk")
        context = {
            "form": form,
            "endpoints": endpoints,
            "event_types": sorted(EVENT_TYPES.items()),
            "chosen": set(form["event_types"].value() or []),
            **extra,
        }
        return self.page(TEMPLATES + "webhooks.html", context, status=status)


class WebhookView(ConsoleView):
    """``/console/{org}/webhooks/{whk}``: one endpoint and its deliveries, newest first, with
    their attempts and last answer; a finished delivery can be sent again. POST switches the
    endpoint on or off, as the API's ``PATCH {"enabled"}`` (switching on clears its failure
    record, so the deliveries of a disabled endpoint can be sent again)."""

    scope_map = {"GET": "webhooks:write", "POST": "webhooks:write"}
    section = "webhooks"

    def post(self, request, org: str, whk: str):
        enabled = request.POST.get("enabled")
        if enabled not in {"on", "off"}:
            return self.webhook_page(status=400, error="Choose to switch the endpoint on or off.")
        try:
            webhook_services.webhook_endpoint_update(
                actor=self.principal, endpoint=self.endpoint, enabled=enabled == "on"
            )
        except KestrelError as error:
            return self.webhook_page(status=error.status, error=error.message)
        return _back(self.request.path, switched=enabled)

    def resolve_parents(self, **kwargs: Any) -> None:
        self.endpoint = (
            webhook_endpoints_of(self.organization).filter(public_id=kwargs.get("whk")).first()
        )
        if self.endpoint is None:
            raise Http404

    def get(self, request, org: str, whk: str):
        return self.webhook_page()

    def webhook_page(self, *, status: int = 200, error: str = ""):
        deliveries = _page_of(
            self.request,
            deliveries_for_endpoint(endpoint=self.endpoint).order_by("-created_at", "-pk"),
        )
        context = {
            "endpoint": self.endpoint,
            "deliveries": deliveries,
            "finished": {DeliveryState.FAILED, DeliveryState.DELIVERED},
            "redelivered": self.request.GET.get("redelivered", "")[:40],
            "switched": self.request.GET.get("switched", ""),
            "error": error,
        }
        return self.page(TEMPLATES + "webhook.html", context, status=status)


class WebhookRedeliverView(WebhookView):
    """``POST /console/{org}/webhooks/{whk}/deliveries/{dlv}/redeliver``: as the API's
    ``POST .../deliveries/{dlv}/retry`` (same ``webhook-id``, a fresh schedule)."""

    scope_map = {"POST": "webhooks:write"}

    def resolve_parents(self, **kwargs: Any) -> None:
        super().resolve_parents(**kwargs)
        self.delivery = (
            deliveries_for_endpoint(endpoint=self.endpoint)
            .filter(public_id=kwargs.get("dlv"))
            .first()
        )
        if self.delivery is None:
            raise Http404

    def post(self, request, org: str, whk: str, dlv: str):
        try:
            webhook_services.delivery_retry(actor=self.principal, delivery=self.delivery)
        except KestrelError as error:
            return self.webhook_page(status=error.status, error=error.message)
        return _back(f"/console/{org}/webhooks/{whk}", redelivered=self.delivery.public_id)


ORG = "console/<slug:org>"

urlpatterns: list[URLPattern] = [
    path(f"{ORG}/tokens", TokensView.as_view(), name="console_tokens"),
    path(f"{ORG}/tokens/<str:tok>/revoke", TokenRevokeView.as_view(), name="console_token_revoke"),
    path(f"{ORG}/members", MembersView.as_view(), name="console_members"),
    path(f"{ORG}/members/<str:mem>", MemberView.as_view(), name="console_member"),
    path(
        f"{ORG}/members/<str:mem>/sign-in-link",
        MemberSignInLinkView.as_view(),
        name="console_member_sign_in_link",
    ),
    path(
        f"{ORG}/members/<str:mem>/remove", MemberRemoveView.as_view(), name="console_member_remove"
    ),
    path(f"{ORG}/runners", RunnersView.as_view(), name="console_runners"),
    path(
        f"{ORG}/runners/<str:run>/revoke", RunnerRevokeView.as_view(), name="console_runner_revoke"
    ),
    path(f"{ORG}/audit", AuditView.as_view(), name="console_audit"),
    path(f"{ORG}/audit/verify", AuditVerifyView.as_view(), name="console_audit_verify"),
    path(f"{ORG}/retention", RetentionView.as_view(), name="console_retention"),
    path(f"{ORG}/webhooks", WebhooksView.as_view(), name="console_webhooks"),
    path(f"{ORG}/webhooks/<str:whk>", WebhookView.as_view(), name="console_webhook"),
    path(
        f"{ORG}/webhooks/<str:whk>/deliveries/<str:dlv>/redeliver",
        WebhookRedeliverView.as_view(),
        name="console_webhook_redeliver",
    ),
]
