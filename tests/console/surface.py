"""What the console's surface tests share: the catalogue's pages filled from the world, the
clients that open them, the htmx fragments a page links, and an HTML reader.

Everything here is generic over the page catalogue (pages.py), so a page added to it is
checked by the surface tests (test_surface.py) without anyone writing a test for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from urllib.parse import urlsplit

from django.test import Client

from kestrel_one.console.sudo import sudo_stamp
from tests.api.routes import console_org_routes
from tests.console.pages import PAGES

# The console's pages that belong to no organization, and the browser paths around them.
OUTSIDE_ORGANIZATIONS = ("/login", "/console/", "/console/sudo")
NOT_FOUND = "/console/no-such-organization/"


def fill(route, world, kwargs: dict[str, str], org: str = "acme") -> str:
    url = route.pattern.replace("<slug:org>", org)
    for name, value in kwargs.items():
        for converter in ("str", "slug", "path"):
            url = url.replace(f"<{converter}:{name}>", value)
    assert "<" not in url, f"{route.name}: the catalogue does not fill {url}"
    return "/" + url.lstrip("/")


@dataclass(frozen=True)
class CataloguePage:
    name: str
    url: str
    page: object  # pages.Page


def catalogue_pages(world) -> list[CataloguePage]:
    """Every organization page of the console (its catalogue entry and filled URL)."""
    return [
        CataloguePage(
            route.name, fill(route, world, PAGES[route.name].fill(world)), PAGES[route.name]
        )
        for route in console_org_routes()
    ]


def signed_in(user, *, sudo: bool = True, **client_options) -> Client:
    client = Client(**client_options)
    client.force_login(user)
    if sudo:
        session = client.session
        sudo_stamp(type("Request", (), {"session": session})())
        session.save()
    return client


def body_text(response) -> str:
    if getattr(response, "streaming", False):
        # A stream (server-sent events) is read only as far as its first chunk.
        first = next(iter(response.streaming_content), b"")
        return first.decode(errors="replace")
    return response.content.decode(errors="replace")


@dataclass
class Element:
    tag: str
    attrs: dict[str, str]
    text: str = ""


class Document(HTMLParser):
    """The parts of a page the surface tests look at: every element with its attributes,
    the text inside scripts and styles, and each form with the names of its inputs."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.elements: list[Element] = []
        self.forms: list[tuple[dict[str, str], list[str]]] = []
        self._raw: Element | None = None
        self._form: tuple[dict[str, str], list[str]] | None = None

    def handle_starttag(self, tag, attrs):
        element = Element(tag, {name: value or "" for name, value in attrs})
        self.elements.append(element)
        if tag in {"script", "style"}:
            self._raw = element
        if tag == "form":
            self._form = (element.attrs, [])
            self.forms.append(self._form)
        if tag in {"input", "button", "select", "textarea"} and self._form is not None:
            self._form[1].append(element.attrs.get("name", ""))

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag in {"script", "style"}:
            self._raw = None

    def handle_endtag(self, tag):
        if tag in {"script", "style"}:
            self._raw = None
        if tag == "form":
            self._form = None

    def handle_data(self, data):
        if self._raw is not None:
            self._raw.text += data


def parse(html: str) -> Document:
    document = Document()
    document.feed(html)
    document.close()
    return document


def fragment_urls(html: str) -> Iterator[str]:
    """The same-site URLs a page's htmx elements fetch with GET (``hx-get``)."""
    for element in parse(html).elements:
        target = element.attrs.get("hx-get") or element.attrs.get("data-hx-get")
        if target and not urlsplit(target).netloc and target.startswith("/"):
            yield target


def is_html(response) -> bool:
    return response.get("Content-Type", "").startswith("text/html")
