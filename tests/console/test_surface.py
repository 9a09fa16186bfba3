"""The console's surface, checked over every page of the catalogue (pages.py): no secret
reaches a browser (API-4), every response sends a strict Content-Security-Policy, no page
needs inline script or style, and every form is protected against CSRF (SURF-4).

These tests walk the catalogue and the htmx fragments its pages link, so a page added there
is covered without a test of its own.
"""

from __future__ import annotations

import base64
import hashlib
import re
import secrets
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from cryptography.hazmat.primitives import serialization
from django.apps import apps
from django.conf import settings as django_settings
from django.contrib.sessions.models import Session
from django.test import Client
from django.utils import timezone
from oauth2_provider.models import AccessToken, Application, RefreshToken

from kestrel_one.accounts.models import ApiToken, User
from kestrel_one.accounts.principal import Principal, PrincipalKind, system_principal
from kestrel_one.accounts.services import token_create
from kestrel_one.accounts.tokens import hash_token
from kestrel_one.artifacts.models import ShareLink
from kestrel_one.artifacts.services import share_create, share_token_hash
from kestrel_one.credentials.services import connection_create, credential_create
from kestrel_one.execution.enrollment import runner_enroll
from kestrel_one.execution.models import Action, IdempotencyKey, Runner
from kestrel_one.execution.plans import plan_propose
from kestrel_one.execution.services import action_request
from kestrel_one.oauth.models import AuthorizationCode, OAuthGrant, RetiredRefreshToken
from kestrel_one.oauth.services import (
    authorization_code_create,
    client_register,
    consenting_person,
    oauth_tokens_issue,
    oauth_tokens_refresh,
)
from kestrel_one.webhooks.models import WebhookEndpoint
from kestrel_one.webhooks.secrets import secret_encrypt
from runners.contract.tokens import generate_private_key_pem, public_key_pem
from tests.api.routes import database_fingerprint, records_objects, webhook_objects
from tests.console.browser import PASSWORD
from tests.console.surface import (
    NOT_FOUND,
    OUTSIDE_ORGANIZATIONS,
    body_text,
    catalogue_pages,
    fragment_urls,
    is_html,
    parse,
    signed_in,
)

# One marker for this run, inside every planted secret: finding it anywhere is a leak.
CANARY = "QzCanary" + secrets.token_hex(4)


def canary(tag: str) -> str:
    return f"{CANARY}-{tag}"


# Every model field whose name says it holds a secret, and what this test does with it.
# test_every_secret_field_is_planted fails when a model gains such a field that is in neither
# list, so a new secret cannot be added without this test looking for it.
PLANTED_FIELDS = {
    "accounts.User.password": "each person's password is a canary; the stored hash too",
    "accounts.ApiToken.secret_hash": "every token's hash, and the plaintexts the test knows",
    "artifacts.ShareLink.token_hash": "share links of an artifact and a thread, token and hash",
    "execution.Runner.broker_password_sha256": "a canary broker password and its digest",
    "execution.Action.sealed_args": "a shell.exec awaiting approval with a canary env value",
    "execution.IdempotencyKey.key": "a canary Idempotency-Key",
    "webhooks.WebhookEndpoint.secret_encrypted": "a canary signing secret, and its ciphertext",
    "webhooks.WebhookEndpoint.previous_secret_encrypted": "the same, for a rotation's overlap",
    "credentials.Credential.secret_ciphertext": "a canary org credential, its ciphertext too",
    "credentials.Credential.data_key_wrapped": "the same credential's wrapped data key",
    "credentials.Connection.secret_ciphertext": "a canary App connection, its ciphertext too",
    "credentials.Connection.data_key_wrapped": "the same connection's wrapped data key",
    "sessions.Session.session_key": "every session's key (HttpOnly: no page may carry one)",
    "axes.AccessLog.session_hash": "whatever django-axes stored (its access log is off)",
    "kestrel_oauth.AuthorizationCode.code_hash": "a canary OAuth code, and its digest",
    "kestrel_oauth.OAuthGrant.refresh_hash": "a canary refresh token, rotated once to another",
    "kestrel_oauth.RetiredRefreshToken.refresh_hash": "the rotated-away canary refresh token",
}
NOT_SECRET_FIELDS = {
    "accounts.ApiToken.key_id": "the public half of a token (kst_<key id>), shown to recognise it",
    "audit.AuditChain.last_hash": "the chain head, shown so anyone can verify the chain",
    "audit.AuditChain.anchor_hash": "where a trimmed chain starts, public like the chain",
    "audit.AuditRecord.prev_hash": "the audit chain's links",
    "audit.AuditRecord.hash": "the audit chain's links",
    "execution.Runner.public_key": "a public key",
    "adapters.AdapterInvocation.idempotency_key": "the caller's own idempotency key, no secret",
    "execution.Action.requested_by_token": "a reference to a token row",
    "execution.Approval.decided_by_token": "a reference to a token row",
    "execution.Plan.proposed_by_token": "a reference to a token row",
    "webhooks.WebhookEndpoint.secret_fingerprint": "what pages show instead of the secret",
    "credentials.Credential.key_id": "which key-encryption key wraps it (a hash: names the key)",
    "credentials.Connection.key_id": "which key-encryption key wraps it (a hash: names the key)",
    "webhooks.WebhookEndpoint.secret_rotated_at": "a time",
    "webhooks.WebhookEndpoint.previous_secret_expires_at": "a time",
    "gateway.ModelBudget.tokens_per_day": "a count of model tokens",
    "gateway.ModelBudget.tokens_per_month": "a count of model tokens",
    "gateway.ModelUsage.reserved_tokens": "a count of model tokens",
    "gateway.ModelUsage.input_tokens": "a count of model tokens",
    "gateway.ModelUsage.output_tokens": "a count of model tokens",
    "gateway.ModelUsage.charged_tokens": "a count of model tokens",
    "gateway.ModelUsage.credential": "the public id of the credential record used (crd_...)",
    "kestrel_oauth.OAuthGrant.api_token": "a reference to a token row",
}
# django-oauth-toolkit's own token tables and client secret: Kestrel's token endpoint mints
# Kestrel API tokens and keeps codes and refresh tokens as digests in kestrel_oauth
# (kestrel_one/oauth/validators.py), and registers public clients only, so nothing ever
# writes these; canaried() asserts they are still empty after planting the OAuth flow's.
UNWRITTEN_FIELDS = {
    f"oauth2_provider.{name}": "never written (kestrel_one/oauth)"
    for name in (
        "AccessToken.id_token",
        "AccessToken.source_refresh_token",
        "AccessToken.token",
        "AccessToken.token_checksum",
        "Application.client_secret",
        "Application.hash_client_secret",
        "RefreshToken.access_token",
        "RefreshToken.token",
        "RefreshToken.token_checksum",
        "RefreshToken.token_family",
    )
}
SECRET_NAME = re.compile(r"secret|token|key|hash|passw|seal|cipher|credential|private", re.I)

# Settings holding a secret: each is set to a canary for the test.
PLANTED_SETTINGS = (
    "SECRET_KEY",
    "SECRET_KEY_FALLBACKS",
    "KESTREL_SERVER_TOKEN",
    "KESTREL_ARGUMENT_ENCRYPTION_KEY",
    "KESTREL_WEBHOOK_ENCRYPTION_KEY",
    "EMAIL_HOST_PASSWORD",
)
SECRET_SETTING = re.compile(r"(SECRET|TOKEN|PASSWORD|_KEY)$|SECRET_KEY|ENCRYPTION")

# Shapes of secrets, for the ones the test cannot know (tokens made before it ran).
SECRET_SHAPES = {
    "API token": re.compile(r"kst_[a-z2-7]{12}_[A-Za-z0-9_-]{43}"),
    "share-link token": re.compile(r"ksh_[A-Za-z0-9_-]{16,}"),
    "webhook secret": re.compile(r"whsec_[A-Za-z0-9+/=]{16,}"),
    "private key": re.compile(r"PRIVATE KEY-----"),
    "sign-in link": re.compile(r"/login/set-password/[^/\s\"']+/[^/\s\"']+"),
}


def test_every_secret_field_is_planted():
    found = {
        f"{model._meta.label}.{field.name}"
        for model in apps.get_models()
        for field in model._meta.get_fields()
        if getattr(field, "concrete", False) and SECRET_NAME.search(field.name)
    }
    unlisted = sorted(found - set(PLANTED_FIELDS) - set(NOT_SECRET_FIELDS) - set(UNWRITTEN_FIELDS))
    assert not unlisted, (
        f"fields whose names say secret: plant a canary in them here, or say why not: {unlisted}"
    )
    stale = sorted((set(PLANTED_FIELDS) | set(NOT_SECRET_FIELDS) | set(UNWRITTEN_FIELDS)) - found)
    assert not stale, f"listed fields that no model has: {stale}"
    secret_settings = {name for name in dir(django_settings) if SECRET_SETTING.search(name)}
    assert secret_settings <= set(PLANTED_SETTINGS), (
        f"secret settings the canary test does not plant: {sorted(secret_settings)}"
    )


def encodings(value: str) -> set[str]:
    raw = value.encode()
    return {
        value,
        base64.b64encode(raw).decode().rstrip("="),
        base64.urlsafe_b64encode(raw).decode().rstrip("="),
        raw.hex(),
        raw.hex().upper(),
    }


def canary_encodings() -> set[str]:
    """The canary itself, hex, and base64 at each of the three alignments it may sit at
    inside a longer encoded value (only the characters its own bytes decide)."""
    raw = CANARY.encode()
    found = {CANARY, CANARY.lower(), raw.hex(), raw.hex().upper()}
    for offset in range(3):
        length = offset + len(raw)
        start = -(-offset * 4 // 3)
        for encode in (base64.b64encode, base64.urlsafe_b64encode):
            found.add(encode(b"\0" * offset + raw).decode()[start : length // 3 * 4])
    return found


class Secrets:
    """What must never reach a browser: the canary in its encodings, the secrets planted
    with it, and every secret value stored in the database as it is now."""

    def __init__(self, known: set[str]):
        self.known = known

    def values(self) -> dict[str, str]:
        stored: set[str] = set(self.known)
        stored |= set(ApiToken.objects.values_list("secret_hash", flat=True))
        stored |= set(ShareLink.objects.values_list("token_hash", flat=True))
        for current, previous in WebhookEndpoint.objects.values_list(
            "secret_encrypted", "previous_secret_encrypted"
        ):
            stored |= {current, previous}
        stored |= set(Action.objects.values_list("sealed_args", flat=True))
        stored |= set(Runner.objects.values_list("broker_password_sha256", flat=True))
        stored |= set(IdempotencyKey.objects.values_list("key", flat=True))
        for password in User.objects.values_list("password", flat=True):
            stored |= {password, password.rsplit("$", 1)[-1]}
        stored |= set(Session.objects.values_list("session_key", flat=True))
        stored |= set(Session.objects.values_list("session_data", flat=True))
        stored |= set(AuthorizationCode.objects.values_list("code_hash", flat=True))
        stored |= set(OAuthGrant.objects.values_list("refresh_hash", flat=True))
        stored |= set(RetiredRefreshToken.objects.values_list("refresh_hash", flat=True))
        named = {}
        for value in stored:
            if value and len(value) >= 12:
                for encoded in encodings(value):
                    named[encoded] = value
        for encoded in canary_encodings():
            named[encoded] = CANARY
        return named


def signing_key_material(path: Path) -> set[str]:
    """A PEM private key's base64 lines and its raw key in hex and base64."""
    pem = path.read_bytes()
    lines = {line for line in pem.decode().splitlines() if line and not line.startswith("-----")}
    key = serialization.load_pem_private_key(pem, password=None)
    raw = key.private_bytes(
        serialization.Encoding.Raw,
        serialization.PrivateFormat.Raw,
        serialization.NoEncryption(),
    )
    return lines | {raw.hex(), base64.b64encode(raw).decode().rstrip("=")}


@pytest.fixture
def canaried(settings, world):
    """The world with a canary in every secret field and setting."""
    for name in PLANTED_SETTINGS:
        value = [canary(name)] if name == "SECRET_KEY_FALLBACKS" else canary(name)
        setattr(settings, name, value)
    known: set[str] = {canary(name) for name in PLANTED_SETTINGS}
    known |= {actor.plaintext for actor in world.actors.values() if actor.plaintext}
    known |= signing_key_material(django_settings.KESTREL_SIGNING_KEY_FILE)
    # Connection passwords, where the test's own services have any.
    known |= {db["PASSWORD"] for db in django_settings.DATABASES.values() if db.get("PASSWORD")}
    for url in (django_settings.REDIS_URL, getattr(django_settings, "CELERY_BROKER_URL", "")):
        if url and urlsplit(url).password:
            known.add(urlsplit(url).password)

    for user in User.objects.all():
        password = canary(f"password-{user.public_id}")
        user.set_password(password)
        user.save(update_fields=["password"])
        known.add(password)
    world.passwords = {user.pk: canary(f"password-{user.public_id}") for user in User.objects.all()}
    for actor in world.actors.values():
        if actor.user is not None:
            actor.user.refresh_from_db()  # a stale password hash would sign the session out

    _, plaintext = token_create(
        actor=system_principal("tests"),
        organization=world.org,
        name="canary integration",
        scopes=["org:read", "projects:read", "projects:write"],
        integration=True,
    )
    known.add(plaintext)

    artifact, _, _ = records_objects(world)
    for subject in ({"artifact": artifact}, {"thread": world.thread}):
        _, token = share_create(actor=world.agent, expires_in=3600, **subject)
        known.add(token)

    endpoint, _ = webhook_objects(world)
    WebhookEndpoint.objects.filter(pk=endpoint.pk).update(
        secret_encrypted=secret_encrypt(f"whsec_{canary('webhook')}"),
        previous_secret_encrypted=secret_encrypt(f"whsec_{canary('previous-webhook')}"),
        previous_secret_expires_at=timezone.now() + timedelta(hours=1),
    )

    broker_password = canary("broker-password")
    Runner.objects.filter(pk=world.runner.pk).update(
        broker_password_sha256=hashlib.sha256(broker_password.encode()).hexdigest()
    )
    known.add(broker_password)
    runner_key = generate_private_key_pem()
    runner_enroll(
        actor=system_principal("tests"),
        organization=world.org,
        pool="acme-pool",
        public_key_pem=public_key_pem(runner_key).decode(),
        name="canary runner",
    )
    known |= {
        line for line in runner_key.decode().splitlines() if line and not line.startswith("-")
    }

    # An org credential and a member's App connection, and the key that wraps them (CRED-1).
    credential = credential_create(
        actor=system_principal("tests"),
        organization=world.org,
        name="canary-github",
        adapter="github",
        secret=f"ghp_{canary('credential')}",
    )
    connection = connection_create(
        actor=Principal(PrincipalKind.SESSION, user=world["member"].user),
        organization=world.org,
        adapter="slack",
        secret=f"xoxb-{canary('connection')}",
    )
    known |= {f"ghp_{canary('credential')}", f"xoxb-{canary('connection')}"}
    for record in (credential, connection):
        for sealed in (bytes(record.secret_ciphertext), bytes(record.data_key_wrapped)):
            known |= {sealed.hex(), base64.b64encode(sealed).decode().rstrip("=")}
    kek = django_settings.KESTREL_CREDENTIALS_KEY_FILE.read_text().strip()
    known |= {kek, base64.b64decode(kek).hex()}

    # An environment overlay (write-only: kept sealed while the action awaits approval).
    overlay = {"argv": ["env"], "env": {"API_KEY": canary("env-value")}}
    sealed = action_request(actor=world.agent, thread=world.thread, tool="shell.exec", args=overlay)
    assert sealed.state == "awaiting_approval" and sealed.sealed_args
    plan_propose(
        actor=world.agent, thread=world.plan_thread, steps=[{"tool": "shell.exec", "args": overlay}]
    )
    IdempotencyKey.objects.create(
        organization=world.org,
        actor_id=world.agent.actor_id,
        key=canary("idempotency-key"),
        request_digest="0" * 64,
        action=sealed,
    )
    world.canary_action = sealed

    # An MCP client's OAuth grant: a canary code, and a canary refresh token rotated once.
    client = client_register(
        name="canary client", redirect_uris=["https://client.example/cb"], remote_addr=None
    )
    code = authorization_code_create(
        actor=consenting_person(world["owner"].user),
        application=client,
        project=world.project,
        scopes=["projects:read"],
        resource=f"https://testserver/api/v1/orgs/acme/projects/{world.project.public_id}/mcp",
        redirect_uri="https://client.example/cb",
        code=canary("oauth-code"),
        code_challenge="E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM",
    )
    grant, first, _ = oauth_tokens_issue(code=code, refresh_token=canary("oauth-refresh"))
    _, second, _ = oauth_tokens_refresh(
        grant=grant,
        refresh_token=canary("oauth-refresh"),
        new_refresh_token=canary("oauth-refresh-2"),
        scopes=["projects:read"],
    )
    known |= {canary("oauth-code"), canary("oauth-refresh"), canary("oauth-refresh-2")}
    known |= {first, second}
    assert not AccessToken.objects.exists() and not RefreshToken.objects.exists()
    assert not Application.objects.exclude(client_secret="").exists()
    return Secrets(known)


def leaks(
    response,
    named: dict[str, str],
    *,
    allowed: frozenset[str] = frozenset(),
    answer_to_a_write: bool = False,
) -> list[str]:
    """Where a secret shows in a response's body, headers or cookies."""
    found = []
    texts = {"body": body_text(response)}
    texts |= {f"header {name}": value for name, value in response.items()}
    # The session cookie is the holder's own (HttpOnly); every other cookie is looked at.
    texts |= {
        f"cookie {name}": morsel.value
        for name, morsel in response.cookies.items()
        if name != django_settings.SESSION_COOKIE_NAME
    }
    for where, text in texts.items():
        for encoded, value in named.items():
            if encoded in text and value not in allowed:
                found.append(f"{where}: {value[:24]}… (as {encoded[:16]}…)")
        for shape, pattern in SECRET_SHAPES.items():
            if shape == "sign-in link" and answer_to_a_write:
                continue  # shown once to whoever added the person, like a new token
            for match in pattern.finditer(text):
                if match.group() not in allowed:
                    found.append(f"{where}: a {shape} ({match.group()[:16]}…)")
    return found


def visit(client: Client, url: str, named, seen: set[str], *, status: int) -> list[str]:
    """GET ``url`` and the htmx fragments it links (one level); every leak found."""
    found = []
    response = client.get(url)
    assert response.status_code == status, (url, response.status_code, status)
    found += [f"GET {url}: {leak}" for leak in leaks(response, named)]
    seen.add(url)
    if is_html(response):
        for fragment in sorted(set(fragment_urls(body_text(response))) - seen):
            seen.add(fragment)
            partial = client.get(fragment, HTTP_HX_REQUEST="true")
            found += [f"GET {fragment} (from {url}): {leak}" for leak in leaks(partial, named)]
    return found


@pytest.mark.spec("SURF-4", "API-4")
def test_no_page_or_fragment_carries_a_secret(canaried, world):
    named = canaried.values()
    owner = Client()
    # The owner signs in through the form, with the canary password (and so is in sudo mode).
    sign_in = owner.post(
        "/login",
        {"email": world["owner"].user.email, "password": world.passwords[world["owner"].user.pk]},
    )
    assert sign_in.status_code == 302, sign_in.content[:500]
    found = [f"POST /login: {leak}" for leak in leaks(sign_in, named)]
    viewer = signed_in(world["viewer"].user)
    named = canaried.values()  # the sessions just made are secrets too
    pages = catalogue_pages(world)
    for person, client in (("owner", owner), ("viewer", viewer)):
        seen: set[str] = set()
        for url in OUTSIDE_ORGANIZATIONS:
            found += [f"{person} {leak}" for leak in visit(client, url, named, seen, status=200)]
        found += [f"{person} {leak}" for leak in visit(client, NOT_FOUND, named, seen, status=404)]
        for entry in pages:
            if not entry.page.post_only:
                status = entry.page.get[person]
                found += [
                    f"{person} {leak}"
                    for leak in visit(client, entry.url, named, seen, status=status)
                ]
    assert not found, "secrets reached the browser:\n" + "\n".join(found)

    # The writes the catalogue probes, by the people it names: a token or a share link made
    # by the request itself is shown once in its answer, and that plaintext alone is allowed
    # there.
    for entry in pages:
        for post in entry.page.posts:
            for name in post.expect:
                client = owner if name == "owner" else signed_in(world[name].user)
                tokens_before = set(ApiToken.objects.values_list("pk", flat=True))
                links_before = set(ShareLink.objects.values_list("pk", flat=True))
                response = client.post(entry.url, post.body(world))
                made_tokens = set(
                    ApiToken.objects.exclude(pk__in=tokens_before).values_list(
                        "secret_hash", flat=True
                    )
                )
                made_links = set(
                    ShareLink.objects.exclude(pk__in=links_before).values_list(
                        "token_hash", flat=True
                    )
                )
                text = body_text(response)
                just_made = frozenset(
                    [
                        token
                        for token in SECRET_SHAPES["API token"].findall(text)
                        if hash_token(token) in made_tokens
                    ]
                    + [
                        link
                        for link in SECRET_SHAPES["share-link token"].findall(text)
                        if share_token_hash(link) in made_links
                    ]
                )
                found += [
                    f"{name} POST {entry.url}: {leak}"
                    for leak in leaks(
                        response, canaried.values(), allowed=just_made, answer_to_a_write=True
                    )
                ]
    assert not found, "secrets reached the browser:\n" + "\n".join(found)


@pytest.mark.spec("SURF-4", "API-4")
def test_the_token_made_on_the_page_is_its_only_secret_and_shown_once(canaried, world):
    """The one exception above, checked on its own: the plaintext is in the answer to the
    request that made it, in no other response, and that answer is not cached."""
    owner = signed_in(world["owner"].user)
    response = owner.post("/console/acme/tokens", {"name": "once", "scopes": ["org:read"]})
    assert response.status_code == 200
    (plaintext,) = set(SECRET_SHAPES["API token"].findall(body_text(response)))
    assert ApiToken.objects.filter(secret_hash=hash_token(plaintext)).exists()
    assert "no-store" in response["Cache-Control"]
    assert not leaks(response, canaried.values(), allowed=frozenset({plaintext}))
    again = owner.get("/console/acme/tokens")
    assert plaintext not in body_text(again)
    assert not leaks(again, canaried.values())


# --- Content-Security-Policy and inline code -------------------------------------------------


def csp_problems(response) -> list[str]:
    policy = response.get("Content-Security-Policy")
    if not policy:
        return ["no Content-Security-Policy header"]
    directives = {}
    for part in policy.split(";"):
        words = part.split()
        if words:
            directives[words[0]] = words[1:]
    problems = []
    for word in ("'unsafe-inline'", "'unsafe-eval'", "'unsafe-hashes'", "'strict-dynamic'"):
        if word in policy:
            problems.append(f"allows {word}")
    # A download is stricter still: a sandbox where nothing loads ('none' covers object-src).
    download = directives.get("default-src") == ["'none'"] and "sandbox" in directives
    for directive, expected in (
        ("default-src", ["'none'"] if download else ["'self'"]),
        ("frame-ancestors", ["'none'"]),
        ("object-src", None if download else ["'none'"]),
    ):
        if directives.get(directive) != expected:
            problems.append(f"{directive} is {directives.get(directive)}, not {expected}")
    for directive in ("script-src", "style-src"):
        if any(source not in {"'self'"} for source in directives.get(directive, [])):
            problems.append(f"{directive} allows {directives[directive]}")
    return problems


INLINE_HANDLER = re.compile(r"^(on[a-z]+|hx-on.*|data-hx-on.*)$")
NON_SCRIPT_TYPES = {"application/json", "application/ld+json"}


def inline_code(html: str) -> list[str]:
    """Script bodies, style elements and attributes, and event handlers: what the policy
    would refuse, so a page that has them is broken in a browser."""
    problems = []
    for element in parse(html).elements:
        if element.tag == "script":
            if element.text.strip() and element.attrs.get("type") not in NON_SCRIPT_TYPES:
                problems.append(f"inline <script>: {element.text.strip()[:60]}")
            if not element.attrs.get("src") and element.attrs.get("type") not in NON_SCRIPT_TYPES:
                problems.append("a <script> without src")
        if element.tag == "style":
            problems.append("a <style> element")
        for name, value in element.attrs.items():
            if name == "style":
                problems.append(f"style= on <{element.tag}>")
            if INLINE_HANDLER.match(name):
                problems.append(f"{name}= on <{element.tag}>")
            if value.strip().lower().startswith(("javascript:", "js:")):
                problems.append(f"{name}={value[:30]} on <{element.tag}>")
    return problems


@pytest.mark.spec("SURF-4")
def test_every_page_sends_a_strict_csp_and_has_no_inline_code(world):
    owner, viewer = signed_in(world["owner"].user), signed_in(world["viewer"].user)
    found, checked = [], []

    def check(where: str, response, *, html: bool = True) -> None:
        checked.append(where)
        found.extend(f"{where}: {problem}" for problem in csp_problems(response))
        if html and is_html(response):
            found.extend(f"{where}: {problem}" for problem in inline_code(body_text(response)))

    check("GET /login (signed out)", Client().get("/login"))
    check("GET /api/v1/orgs", world["owner"].client().get("/api/v1/orgs"), html=False)
    check("GET /api/v1/health", Client().get("/api/v1/health"), html=False)
    for person, client in (("owner", owner), ("viewer", viewer)):
        seen: set[str] = set()
        urls = [*OUTSIDE_ORGANIZATIONS, NOT_FOUND]
        urls += [entry.url for entry in catalogue_pages(world) if not entry.page.post_only]
        for url in urls:
            response = client.get(url)
            check(f"{person} GET {url} ({response.status_code})", response)
            if is_html(response):
                for fragment in sorted(set(fragment_urls(body_text(response))) - seen):
                    seen.add(fragment)
                    partial = client.get(fragment, HTTP_HX_REQUEST="true")
                    check(f"{person} GET {fragment} (from {url})", partial)
    assert len(checked) > 2 * len(OUTSIDE_ORGANIZATIONS), checked
    assert not found, "\n".join(found)


# --- CSRF ------------------------------------------------------------------------------------


@pytest.mark.spec("SURF-4")
def test_every_write_without_the_csrf_token_is_refused_and_changes_nothing(world):
    owner = signed_in(world["owner"].user, enforce_csrf_checks=True)
    writes = [
        (entry.url, post.body(world))
        for entry in catalogue_pages(world)
        for post in entry.page.posts
    ]
    assert writes, "the catalogue has no writes to probe"
    writes += [("/console/sudo", {"password": PASSWORD, "next": "/console/"}), ("/logout", {})]
    for url, body in writes:
        before = database_fingerprint()
        response = owner.post(url, body)
        assert response.status_code == 403, (url, response.status_code)
        assert database_fingerprint() == before, f"POST {url} without a CSRF token wrote"
        # htmx's way in is refused the same without the header.
        response = owner.post(url, body, HTTP_HX_REQUEST="true")
        assert response.status_code == 403, (url, response.status_code)
    # Signing in is a form too.
    refused = Client(enforce_csrf_checks=True).post(
        "/login", {"email": world["owner"].user.email, "password": PASSWORD}
    )
    assert refused.status_code == 403
    # The refused sign-out left the session signed in.
    assert owner.get("/console/acme/").status_code == 200


@pytest.mark.spec("SURF-4")
def test_every_post_form_carries_the_csrf_token(world):
    found, forms = [], 0
    for person in ("owner", "viewer"):
        client = signed_in(world[person].user)
        urls = [*OUTSIDE_ORGANIZATIONS, NOT_FOUND]
        urls += [entry.url for entry in catalogue_pages(world) if not entry.page.post_only]
        seen: set[str] = set()
        for url in urls:
            pages = [(url, client.get(url))]
            if is_html(pages[0][1]):
                for fragment in sorted(set(fragment_urls(body_text(pages[0][1]))) - seen):
                    seen.add(fragment)
                    pages.append((fragment, client.get(fragment, HTTP_HX_REQUEST="true")))
            for where, response in pages:
                if not is_html(response):
                    continue
                document = parse(body_text(response))
                for attrs, names in document.forms:
                    if attrs.get("method", "get").lower() == "post":
                        forms += 1
                        if "csrfmiddlewaretoken" not in names:
                            found.append(f"{person} {where}: form to {attrs.get('action', '.')}")
                posting = [
                    element
                    for element in document.elements
                    if {"hx-post", "hx-put", "hx-patch", "hx-delete"} & element.attrs.keys()
                ]
                body = next((e for e in document.elements if e.tag == "body"), None)
                if posting and "X-CSRFToken" not in (
                    body.attrs.get("hx-headers", "") if body else ""
                ):
                    found.append(f"{person} {where}: htmx writes without the X-CSRFToken header")
    assert forms, "no post form found on any page"
    assert not found, "forms without a CSRF token:\n" + "\n".join(found)
