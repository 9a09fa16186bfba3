"""The console's page catalogue, which the console walker uses.

Every console route of an organization must have an entry here, saying how to fill its URL
from the test world and what each kind of person gets. A route added without an entry fails
the walker (test_console_walker.py), so nobody has to remember to add a tenancy test.

Each part of the console keeps its entries in its own dictionary below; ``PAGES`` joins them.
"""

from __future__ import annotations

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

POLICY: dict[str, Page] = {}


def _made(world, name: str, make: Callable[[], object]):
    """An object a page needs that the shared world does not hold, made once per world."""
    if not hasattr(world, name):
        setattr(world, name, make())
    return getattr(world, name)


def _webhook(world, organization):
    """An endpoint of ``organization`` with one failed delivery (which may be sent again)."""
    from kestrel_one.accounts.principal import system_principal
    from kestrel_one.webhooks.models import WebhookDelivery, WebhookMessage
    from kestrel_one.webhooks.services import webhook_endpoint_create

    endpoint, _ = webhook_endpoint_create(
        actor=system_principal("tests"),
        organization=organization,
        url=f"https://hooks.{organization.slug}.example.com/kestrel",
        event_types=["action.succeeded"],
    )
    message = WebhookMessage.objects.create(
        organization=organization, event_type="action.succeeded", body="{}"
    )
    delivery = WebhookDelivery.objects.create(
        organization=organization, endpoint=endpoint, message=message, state="failed", attempts=3
    )
    return endpoint, delivery


def acme_webhook(world) -> dict[str, str]:
    endpoint, delivery = _made(world, "acme_webhook", lambda: _webhook(world, world.org))
    return {"whk": endpoint.public_id, "dlv": delivery.public_id}


def foreign_webhook(world) -> dict[str, str]:
    endpoint, delivery = _made(world, "globex_webhook", lambda: _webhook(world, world.other_org))
    return {"whk": endpoint.public_id, "dlv": delivery.public_id}


def foreign_runner(world) -> dict[str, str]:
    from kestrel_one.accounts.principal import system_principal
    from kestrel_one.execution.enrollment import runner_enroll
    from runners.contract.tokens import generate_private_key_pem, public_key_pem

    runner = _made(
        world,
        "globex_runner",
        lambda: runner_enroll(
            actor=system_principal("tests"),
            organization=world.other_org,
            pool="globex-pool",
            public_key_pem=public_key_pem(generate_private_key_pem()).decode(),
        ),
    )
    return {"run": runner.public_id}


# Writes only owners and admins may make: the rest of the organization is refused.
NOT_MEMBERS = {"viewer": 403, "member": 403, "limited": 403}

ADMINISTRATION: dict[str, Page] = {
    # Everyone makes their own tokens (tokens:write), never with a scope they lack; one that
    # can approve needs sudo mode.
    "console_tokens": Page(
        posts=(
            Post(
                body=lambda world: {"name": "walker", "scopes": ["org:read"]},
                expect={"viewer": 200},
            ),
            Post(
                body=lambda world: {"name": "deciding", "scopes": ["org:read", "actions:approve"]},
                # A viewer lacks the scope (a 403, test_token_lineage.py); the viewer may still
                # make other tokens, so their page keeps its forms.
                expect={"member": 200},
                sudo=True,
            ),
        )
    ),
    # The owner's token: someone else's, which only tokens:admin sees, and an admin may not
    # revoke (an owner outranks them).
    "console_token_revoke": Page(
        fill=lambda world: {"tok": world["owner"].token.public_id},
        foreign=lambda world: {"tok": world["outsider"].token.public_id},
        post_only=True,
        posts=(Post(body=lambda world: {}, expect={"viewer": 404, "member": 404, "admin": 403}),),
    ),
    "console_members": Page(
        posts=(
            Post(
                body=lambda world: {
                    "email": "new-person@acme.example.com",
                    "role": "viewer",
                    "access": "all",
                },
                expect=dict(NOT_MEMBERS),
            ),
        )
    ),
    "console_member": Page(
        fill=lambda world: {"mem": world["member"].membership.public_id},
        foreign=lambda world: {"mem": world["outsider"].membership.public_id},
        posts=(
            Post(
                body=lambda world: {"role": "viewer", "access": "all"},
                expect=dict(NOT_MEMBERS),
            ),
        ),
    ),
    "console_member_remove": Page(
        fill=lambda world: {"mem": world["member"].membership.public_id},
        foreign=lambda world: {"mem": world["outsider"].membership.public_id},
        post_only=True,
        posts=(Post(body=lambda world: {}, expect=dict(NOT_MEMBERS)),),
    ),
    "console_runners": Page(get=dict(ADMINS)),
    "console_runner_revoke": Page(
        fill=lambda world: {"run": world.runner.public_id},
        foreign=foreign_runner,
        post_only=True,
        posts=(Post(body=lambda world: {}, expect={"viewer": 403, "member": 403}),),
    ),
    "console_audit": Page(get=dict(ADMINS)),
    "console_audit_verify": Page(
        post_only=True,
        posts=(Post(body=lambda world: {}, expect={"viewer": 403, "member": 403, "owner": 200}),),
    ),
    "console_retention": Page(
        posts=(
            Post(
                body=lambda world: {
                    "events_days": 30,
                    "artifacts_days": 30,
                    "checkpoints_days": 7,
                    "audit_days": 400,
                },
                expect=dict(NOT_MEMBERS),
            ),
        )
    ),
    "console_webhooks": Page(
        get=dict(ADMINS),
        posts=(
            Post(
                body=lambda world: {
                    "url": "https://hooks.example.com/new",
                    "event_types": ["action.failed"],
                    "enabled": "on",
                },
                expect={"viewer": 403, "member": 403},
            ),
        ),
    ),
    "console_webhook": Page(
        fill=lambda world: {"whk": acme_webhook(world)["whk"]},
        foreign=lambda world: {"whk": foreign_webhook(world)["whk"]},
        get=dict(ADMINS),
        posts=(Post(body=lambda world: {"enabled": "off"}, expect={"viewer": 403, "member": 403}),),
    ),
    "console_webhook_redeliver": Page(
        fill=acme_webhook,
        foreign=foreign_webhook,
        post_only=True,
        posts=(Post(body=lambda world: {}, expect={"viewer": 403, "member": 403}),),
    ),
}

PAGES: dict[str, Page] = {**OVERVIEW, **DASHBOARD, **APPROVALS, **POLICY, **ADMINISTRATION}
