"""The one base view every organization page of the console uses.

Like the API's ``OrgScopedViewSet``: the organization comes from the URL and is resolved
*through* the signed-in person (``organization_addressed``), so an organization they
cannot see is the same 404 page as one that does not exist; then the method's scope is
checked (a 403 page only for members who lack it); then the sensitive methods ask for sudo
mode, as does every decision only a person may make, whichever page's service asks for one
(``execution.approvals.require_person``). Objects are always fetched through
``self.organization`` with the selectors the API uses. Overriding ``dispatch`` is refused
when the class is created, so no page skips this.
"""

from __future__ import annotations

import functools
import re
from typing import Any, ClassVar

from django.contrib.auth.views import redirect_to_login
from django.http import Http404, HttpRequest, HttpResponse
from django.template.loader import render_to_string
from django.views import View

from kestrel_one.accounts.principal import Principal, PrincipalKind, missing_scope_message
from kestrel_one.common.ids import url_names_storable
from kestrel_one.common.injection import hidden_revealed
from kestrel_one.console.paging import capped_count
from kestrel_one.console.sudo import sudo_fresh, sudo_redirect, sudo_seconds_left
from kestrel_one.execution.approvals import ReauthenticationRequired
from kestrel_one.execution.selectors import actions_awaiting_decision
from kestrel_one.tenancy.models import Organization
from kestrel_one.tenancy.selectors import organization_addressed


def session_principal(request: HttpRequest) -> Principal:
    return Principal(PrincipalKind.SESSION, user=request.user, reauthenticated=sudo_fresh(request))


# A character of a page that a person may not see: anything but printable ASCII, tab and line
# breaks. Only these are asked ``is_hidden`` (once each, cached): a page is mostly ASCII and
# is read whole on every view.
_MAYBE_HIDDEN = re.compile(r"[^\t\n\r\x20-\x7e]")
# What a form posts back, as the console's templates write it: a ``value`` attribute and a
# textarea's text. Django's autoescaping leaves no raw ``"`` in an attribute and no raw ``<``
# in text, so these match only what a template wrote as markup, never a value shown.
_POSTED = re.compile(r'\svalue="[^"]*"|<textarea\b[^>]*>[^<]*</textarea>')


@functools.lru_cache(maxsize=4096)
def _char_revealed(char: str) -> str:
    return hidden_revealed(char)


def _text_revealed(html: str) -> str:
    return _MAYBE_HIDDEN.sub(lambda found: _char_revealed(found.group()), html)


def page_revealed(html: str) -> str:
    """``html`` with every character a person cannot see (``injection.is_hidden``: bidi
    controls, zero-width and tag characters, variation selectors, ...) drawn as
    ``[U+XXXX]``, exactly as ``injection.hidden_revealed`` draws it, wherever on the page it
    came from, except in what a form posts back (an input's ``value``, a textarea's text),
    which stays exactly as given: revealed there, a typed argument or a saved document
    would come back changed. Applied to what Django rendered, after autoescaping: it only
    turns invisible code points into ASCII that is no markup."""
    drawn, at = [], 0
    for posted in _POSTED.finditer(html):
        drawn += [_text_revealed(html[at : posted.start()]), posted.group()]
        at = posted.end()
    drawn.append(_text_revealed(html[at:]))
    return "".join(drawn)


def page_drawn(
    request: HttpRequest | None, template: str, context: dict[str, Any], *, status: int = 200
) -> HttpResponse:
    """``template`` rendered (as ``render`` does), with every character a person could not
    see drawn as [U+XXXX] (``page_revealed``), so that an argument reordered by a
    right-to-left override or split by a zero-width space reads as what would run. Every
    console page is drawn so, and the whole page, not the values a template remembers to
    mark: an agent's title, a tool's output, a server's answer or a document shown tomorrow
    is covered too. Only what is drawn changes: what a form posts back stays as given, and
    what is stored and what the API returns keep the characters (with the
    ``hidden_characters`` flag beside them)."""
    html = render_to_string(template, context, request)
    return HttpResponse(page_revealed(html), status=status)


class ConsoleView(View):
    # HTTP method -> the scope the person must hold in the organization. A method with no
    # entry is refused (405), never allowed by default.
    scope_map: ClassVar[dict[str, str]] = {"GET": "org:read"}
    # HTTP method -> what the person is about to do, for the methods that need sudo mode
    # ("approve or deny this action"). Shown on the confirmation page.
    sudo_for: ClassVar[dict[str, str]] = {}
    # The navigation entry this page belongs to.
    section: ClassVar[str] = ""

    protected_methods = ("dispatch",)

    organization: Organization
    principal: Principal

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        overridden = [name for name in cls.protected_methods if name in cls.__dict__]
        if overridden:
            raise TypeError(
                f"{cls.__name__} overrides {', '.join(overridden)}, which enforces tenancy; "
                "resolve objects in resolve_parents() instead"
            )

    def dispatch(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if not request.user.is_authenticated:
            return redirect_to_login(request.get_full_path())
        if not url_names_storable(kwargs):
            raise Http404
        self.principal = session_principal(request)
        organization = organization_addressed(self.principal, kwargs.get("org"))
        if organization is None:
            raise Http404
        self.organization = organization
        # Before any refusal: the error page draws the navigation from them.
        self.scopes = self.principal.scopes_in(organization)
        method = "GET" if request.method == "HEAD" else (request.method or "GET")
        required = self.scope_map.get(method)
        if required is None:
            return self.page_error(
                405, "Not allowed", f"This page does not accept {method} requests."
            )
        if required not in self.scopes:
            return self.page_error(
                403, "Not allowed", missing_scope_message(self.principal, required, organization)
            )
        self.resolve_parents(**kwargs)
        what = self.sudo_for.get(method)
        if what is not None and not sudo_fresh(request):
            return sudo_redirect(request, back_to=self.back_to(), what=what)
        try:
            return super().dispatch(request, *args, **kwargs)
        except ReauthenticationRequired as needed:
            # A decision only a person may make, which this page's service asked for:
            # refused inside its transaction (nothing written), like a sudo_for method.
            return sudo_redirect(request, back_to=self.back_to(), what=needed.what)

    def resolve_parents(self, **kwargs: Any) -> None:
        """Fetch the objects named in the URL, always through ``self.organization``; raise
        ``Http404`` for one the person cannot see."""

    def back_to(self) -> str:
        """The page to return to after a sudo confirmation: this page, as a GET."""
        return self.request.path

    def can(self, scope: str) -> bool:
        return scope in self.scopes

    def console_context(self) -> dict[str, Any]:
        awaiting_count, awaiting_label = capped_count(
            actions_awaiting_decision(principal=self.principal, organization=self.organization)
        )
        return {
            "organization": self.organization,
            "role": self.principal.role_in(self.organization),
            "scopes": self.scopes,
            "section": self.section,
            # Counted up to 100 ("99+"): every page shows it, so it must not cost a full count.
            "awaiting_count": awaiting_count,
            "awaiting_label": awaiting_label,
            "sudo_seconds_left": sudo_seconds_left(self.request),
        }

    def drawn(self, template: str, context: dict[str, Any], *, status: int = 200) -> HttpResponse:
        return page_drawn(self.request, template, context, status=status)

    def page(
        self, template: str, context: dict[str, Any] | None = None, *, status: int = 200
    ) -> HttpResponse:
        return self.drawn(template, {**self.console_context(), **(context or {})}, status=status)

    def page_error(self, status: int, title: str, message: str) -> HttpResponse:
        return self.drawn(
            "console/error.html",
            {**self.console_context(), "status": status, "title": title, "message": message},
            status=status,
        )
