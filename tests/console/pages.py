"""The console's page catalogue, which the console walker uses.

Every console route of an organization must have an entry here, saying how to fill its URL
from the test world and what each kind of person gets. A route added without an entry fails
the walker (test_console_walker.py), so nobody has to remember to add a tenancy test.

Each part of the console keeps its entries in its own dictionary below; ``PAGES`` joins them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

MEMBERS = ("owner", "admin", "member", "viewer", "limited")
# Everyone in the organization may open the page.
EVERYONE = dict.fromkeys(MEMBERS, 200)
# Only owners and admins (org:admin pages); others get the 403 page.
ADMINS = {"owner": 200, "admin": 200, "member": 403, "viewer": 403, "limited": 403}


@dataclass(frozen=True)
class Post:
    """A write the page accepts: a valid form body, and what each person gets for it.
    Statuses not named are not probed (the write would change what later probes see)."""

    body: Callable[[object], dict]
    # Person -> status. The viewer's refusal is always probed; name others as needed.
    expect: dict[str, int] = field(default_factory=lambda: {"viewer": 403})
    # Needs sudo mode (a recent sign-in): without it the POST changes nothing and redirects.
    sudo: bool = False


@dataclass(frozen=True)
class Page:
    # URL keyword arguments besides ``org``, from the world (e.g. {"prj": ...}).
    fill: Callable[[object], dict[str, str]] = lambda world: {}
    # The same URL with objects of another organization put in: must be a 404 for everyone.
    foreign: Callable[[object], dict[str, str]] | None = None
    get: dict[str, int] = field(default_factory=lambda: dict(EVERYONE))
    posts: tuple[Post, ...] = ()
    # A page without GET (a form target only).
    post_only: bool = False


OVERVIEW: dict[str, Page] = {
    "console_overview": Page(),
}

DASHBOARD: dict[str, Page] = {}

APPROVALS: dict[str, Page] = {}


def _policy_pages() -> dict[str, Page]:
    """The policy console: for an environment and for a project, the editor (POST saves a
    draft), publish (sudo), discard, preview and explain."""
    narrower = json.dumps({"capabilities": {"fs.read": {"paths": ["src/**"]}}})
    owners = {
        "console_environment_policy": (
            lambda world: {"env": world.environment.public_id},
            lambda world: {"env": world.foreign_environment.public_id},
            dict(EVERYONE),
        ),
        "console_project_policy": (
            lambda world: {"prj": world.project.public_id},
            lambda world: {"prj": world.foreign_project.public_id},
            # The limited member sees only the other project: this one is a 404 for them.
            {**EVERYONE, "limited": 404},
        ),
    }
    refused = {"viewer": 403, "member": 403}
    pages = {"console_policy": Page()}
    for name, (fill, foreign, get) in owners.items():
        pages[name] = Page(
            fill=fill,
            foreign=foreign,
            get=get,
            posts=(
                Post(body=lambda world: {"document": narrower}, expect={**refused, "admin": 303}),
            ),
        )
        pages[f"{name}_publish"] = Page(
            fill=fill,
            foreign=foreign,
            post_only=True,
            posts=(Post(body=lambda world: {"draft_sha256": "0" * 64}, expect=refused, sudo=True),),
        )
        pages[f"{name}_discard"] = Page(
            fill=fill, foreign=foreign, post_only=True, posts=(Post(body=lambda world: {}),)
        )
        pages[f"{name}_preview"] = Page(fill=fill, foreign=foreign, get=get)
        pages[f"{name}_explain"] = Page(fill=fill, foreign=foreign, get=get)
    return pages


POLICY: dict[str, Page] = _policy_pages()

ADMINISTRATION: dict[str, Page] = {
    "console_tokens": Page(
        posts=(
            Post(
                body=lambda world: {"name": "walker", "scopes": ["org:read"]},
                expect={"viewer": 200},
            ),
        )
    ),
}

PAGES: dict[str, Page] = {**OVERVIEW, **DASHBOARD, **APPROVALS, **POLICY, **ADMINISTRATION}
