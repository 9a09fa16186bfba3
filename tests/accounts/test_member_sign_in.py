"""Members can sign in: a one-time sign-in link when added, `set_password` from standard
input, `member_add` on the server, and a login page that offers the server token only where
one is configured."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from django.conf import settings as django_settings
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import Client
from rest_framework.test import APIClient

from kestrel_one.accounts.models import User
from kestrel_one.accounts.principal import system_principal
from kestrel_one.accounts.scopes import Role
from kestrel_one.accounts.services import token_create
from kestrel_one.accounts.sign_in_links import sign_in_link_tokens
from kestrel_one.audit.models import AuditRecord
from kestrel_one.tenancy.models import Membership
from kestrel_one.tenancy.services import member_add
from tests.accounts.test_tokens import all_text_in_database
from tests.console.test_administration import signed_in as console_signed_in
from tests.factories import OrganizationFactory, UserFactory
from tests.test_settings import run_manage

REPO = Path(__file__).resolve().parents[2]
NEW_PASSWORD = "kestrel-first-password-Vb81"
SERVER_TOKEN = "kst-server-token-for-this-test-7f3a"


def audit_text() -> str:
    """Every audit row as text: what an auditor (or a leak through the audit log) would see."""
    return "\n".join(
        json.dumps(row, default=str) for row in AuditRecord.objects.values().order_by("pk")
    )


def configured_log_output():
    """A handler with the service's own JSON log formatter (redaction included) on the root
    logger, so a test can read what the logs would say."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    config = dict(django_settings.LOGGING["formatters"]["json"])
    handler.setFormatter(config.pop("()")(**config))
    return stream, handler


def add_member(client, email: str, role: str = "member", org: str = "acme"):
    return client.post(f"/api/v1/orgs/{org}/members", {"email": email, "role": role}, format="json")


def link_path(link: str) -> str:
    return urlsplit(link).path


def choose_password(browser: Client, link: str, password: str = NEW_PASSWORD):
    """Open the link as a browser does, then post the form on the page it leads to."""
    opened = browser.get(link_path(link))
    assert opened.status_code == 302, opened.content
    form_page = opened["Location"]
    assert form_page.endswith("/set-password/"), "the token leaves the address bar"
    assert browser.get(form_page).status_code == 200
    return browser.post(form_page, {"new_password1": password, "new_password2": password})


# The link flow, end to end.


def test_a_new_member_follows_the_link_chooses_a_password_and_is_signed_in(world):
    stream, handler = configured_log_output()
    logging.getLogger().addHandler(handler)
    try:
        added = add_member(world["owner"].client(), "newcomer@example.com")
        assert added.status_code == 201, added.content
        assert added["Cache-Control"] == "no-store"
        body = added.json()
        link = body["sign_in_link"]
        assert link.startswith("http://testserver/login/set-password/")
        assert body["sign_in_link_expires_at"]
        token = link_path(link).rstrip("/").rsplit("/", 1)[1]

        browser = Client()
        opened = browser.get(link_path(link))
        assert opened.status_code == 302
        page = browser.get(opened["Location"])
        assert page.status_code == 200
        assert b"newcomer@example.com" in page.content
        assert b'name="csrfmiddlewaretoken"' in page.content
        # The page the token moved to must not carry it (no Referer leak).
        assert token.encode() not in page.content

        mismatch = browser.post(
            opened["Location"], {"new_password1": NEW_PASSWORD, "new_password2": "other-Xy71"}
        )
        assert mismatch.status_code == 400
        weak = browser.post(
            opened["Location"], {"new_password1": "short", "new_password2": "short"}
        )
        assert weak.status_code == 400 and b"too short" in weak.content
        chosen = browser.post(
            opened["Location"], {"new_password1": NEW_PASSWORD, "new_password2": NEW_PASSWORD}
        )
        assert chosen.status_code == 302 and chosen["Location"] == "/console/"
        home = browser.get("/console/")
        assert home.status_code == 200
        assert home.context["user"].email == "newcomer@example.com"

        # One time only: the same link, in any browser, no longer works.
        again = Client().get(link_path(link))
        assert again.status_code == 400
        assert b"does not work" in again.content
        assert browser.get(link_path(link)).status_code == 400

        # The password chosen is the one that signs in from now on.
        signed_in = Client().post(
            "/login", {"email": "newcomer@example.com", "password": NEW_PASSWORD}
        )
        assert signed_in.status_code == 302 and "sessionid" in signed_in.cookies
    finally:
        logging.getLogger().removeHandler(handler)

    user = User.objects.get(email="newcomer@example.com")
    added_row = AuditRecord.objects.get(action="membership.add", target_id=body["id"])
    assert added_row.data["user"] == user.public_id
    assert added_row.data["sign_in_link_expires_at"] == body["sign_in_link_expires_at"].replace(
        "Z", "+00:00"
    )
    assert list(
        AuditRecord.objects.filter(organization=world.org, target_id=user.public_id).values_list(
            "action", "actor_type", "actor_id", "data"
        )
    ) == [("user.password_set", "user", user.public_id, {"via": "sign_in_link"})]
    # Neither the link's token nor the password is anywhere: audit rows, any stored text,
    # the logs (the refused re-use was logged as a 400), or what the API shows afterwards.
    audited = audit_text()
    assert "sign_in_link_expires_at" in audited
    stored = all_text_in_database()
    logs = stream.getvalue()
    assert "Bad Request: /login/" in logs, "the refused link was logged, masked"
    owner = world["owner"].client()
    later = owner.get("/api/v1/orgs/acme/members").content.decode()
    later += owner.get(f"/api/v1/orgs/acme/members/{body['id']}").content.decode()
    for text in (audited, stored, logs, later):
        assert token not in text
        assert NEW_PASSWORD not in text


def test_an_expired_link_is_refused(world):
    link = add_member(world["owner"].client(), "late@example.com").json()["sign_in_link"]
    hours = django_settings.KESTREL_SIGN_IN_LINK_HOURS
    assert django_settings.PASSWORD_RESET_TIMEOUT == hours * 3600

    def later(by: timedelta):
        return lambda: datetime.now() + by

    # Just inside the lifetime the link opens; just past it, it does not.
    browser = Client()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sign_in_link_tokens, "_now", later(timedelta(hours=hours, minutes=-5)))
        opened = browser.get(link_path(link))
        assert opened.status_code == 302
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sign_in_link_tokens, "_now", later(timedelta(hours=hours, minutes=5)))
        refused = Client().get(link_path(link))
        assert refused.status_code == 400 and b"expired" in refused.content
        # Nor can the form opened before it expired be posted after.
        late = browser.post(
            opened["Location"], {"new_password1": NEW_PASSWORD, "new_password2": NEW_PASSWORD}
        )
        assert late.status_code == 400 and "sessionid" not in late.cookies
    assert not User.objects.get(email="late@example.com").has_usable_password()


def test_a_shorter_lifetime_setting_expires_links_sooner(world, settings):
    settings.PASSWORD_RESET_TIMEOUT = 60 * 60
    link = add_member(world["owner"].client(), "brief@example.com").json()["sign_in_link"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sign_in_link_tokens, "_now", lambda: datetime.now() + timedelta(hours=2))
        assert Client().get(link_path(link)).status_code == 400


def test_an_altered_or_foreign_link_is_refused(world):
    first = add_member(world["owner"].client(), "first@example.com").json()["sign_in_link"]
    second = add_member(world["owner"].client(), "second@example.com").json()["sign_in_link"]
    first_uid, first_token = link_path(first).strip("/").split("/")[2:]
    second_uid, _ = link_path(second).strip("/").split("/")[2:]
    # One person's token does not open another person's link.
    swapped = Client().get(f"/login/set-password/{second_uid}/{first_token}/")
    assert swapped.status_code == 400
    altered = first_token[:-1] + ("1" if first_token.endswith("0") else "0")
    assert Client().get(f"/login/set-password/{first_uid}/{altered}/").status_code == 400
    assert Client().get("/login/set-password/not-base64/1-2/").status_code == 400
    assert Client().get(f"/login/set-password/{first_uid}/set-password/").status_code == 400


def test_the_link_uses_the_public_url_when_one_is_configured(world, settings):
    settings.KESTREL_PUBLIC_URL = "https://kestrel.example.com"
    body = add_member(world["owner"].client(), "public@example.com").json()
    assert body["sign_in_link"].startswith("https://kestrel.example.com/login/set-password/")


# Who gets a link: only a person nobody else relies on yet.


def test_an_existing_person_with_a_password_gets_no_link(world):
    acme_member = world["member"].user
    assert acme_member.has_usable_password()
    added = add_member(world["outsider"].client(), acme_member.email, org="globex")
    assert added.status_code == 201
    assert added.json()["sign_in_link"] is None
    assert added.json()["sign_in_link_expires_at"] is None
    added_row = AuditRecord.objects.get(action="membership.add", target_id=added.json()["id"])
    assert "sign_in_link_expires_at" not in added_row.data


def test_another_organization_cannot_take_over_someone_without_a_password(world):
    """acme added someone who has not chosen a password yet; globex's owner adds the same
    email. A link for globex would let globex set the password and act in acme."""
    acme_link = add_member(world["owner"].client(), "pending@example.com").json()["sign_in_link"]
    added = add_member(world["outsider"].client(), "pending@example.com", org="globex")
    assert added.status_code == 201
    assert added.json()["sign_in_link"] is None
    # And acme's outstanding link stopped working when the person joined another organization.
    assert Client().get(link_path(acme_link)).status_code == 400


def test_an_operator_account_never_gets_a_link(world):
    staff = UserFactory(email="operator@example.com", is_staff=True)
    staff.set_unusable_password()
    staff.save()
    added = add_member(world["owner"].client(), "operator@example.com")
    assert added.status_code == 201 and added.json()["sign_in_link"] is None


def test_a_person_removed_and_added_again_gets_a_new_link(world):
    owner = world["owner"].client()
    first = add_member(owner, "again@example.com").json()
    assert owner.delete(f"/api/v1/orgs/acme/members/{first['id']}").status_code == 204
    second = add_member(owner, "again@example.com").json()
    assert second["sign_in_link"] and second["sign_in_link"] != first["sign_in_link"]
    assert Client().get(link_path(first["sign_in_link"])).status_code == 400
    assert Client().get(link_path(second["sign_in_link"])).status_code == 302


def token_client(world, scopes: list[str], *, person=None):
    """An API client with a token of exactly ``scopes`` in acme: an integration's (no person)
    or, with ``person``, that person's own narrower token."""
    _, plaintext = token_create(
        actor=system_principal("tests"),
        organization=world.org,
        name="narrow",
        scopes=scopes,
        integration=person is None,
        user=person,
    )
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    return client


@pytest.mark.spec("POL-5")
def test_a_link_goes_only_to_a_caller_who_holds_every_scope_of_the_role(world):
    """Whoever holds a link becomes that person. An integration token with members:write that
    received one could add a member, sign in as them and approve its own actions; a person's
    token made without actions:approve could do the same."""
    integration = token_client(world, ["org:read", "members:write"])
    added = add_member(integration, "puppet@example.com", role="admin")
    assert added.status_code == 201, added.content
    body = added.json()
    assert body["sign_in_link"] is None and body["sign_in_link_expires_at"] is None
    assert body["sign_in_link_withheld"] is True
    row = AuditRecord.objects.get(action="membership.add", target_id=body["id"])
    assert "sign_in_link_expires_at" not in row.data

    narrow = token_client(world, ["org:read", "members:write"], person=world["owner"].user)
    assert add_member(narrow, "second-puppet@example.com").json()["sign_in_link_withheld"]

    # A person's token that holds every scope of the role it adds does get the link.
    viewer_scopes = ["org:read", "members:write", "projects:read", "tokens:write"]
    enough = token_client(world, viewer_scopes, person=world["owner"].user)
    viewer = add_member(enough, "reader@example.com", role="viewer").json()
    assert viewer["sign_in_link"] and viewer["sign_in_link_withheld"] is False
    # Someone who already has a way in is never "withheld": there is nothing to send.
    has_password = add_member(integration, world["outsider"].user.email).json()
    assert has_password["sign_in_link"] is None and has_password["sign_in_link_withheld"] is False


def test_the_console_makes_the_withheld_link_once_for_someone_who_may_hold_it(world):
    integration = token_client(world, ["org:read", "members:write"])
    body = add_member(integration, "provisioned@example.com", role="member").json()
    page = f"/console/acme/members/{body['id']}"

    admin = console_signed_in(world["admin"].user)
    shown = admin.get(page).content.decode()
    assert "Make a sign-in link" in shown
    made = admin.post(page + "/sign-in-link")
    assert made.status_code == 200 and made["Cache-Control"] == "no-store"
    link = re.search(r'<code id="sign-in-link">([^<]+)</code>', made.content.decode()).group(1)
    assert link.startswith("http://testserver/login/set-password/")
    assert link not in admin.get(page).content.decode(), "shown only once"
    row = AuditRecord.objects.get(action="membership.sign_in_link", target_id=body["id"])
    assert row.actor_id == world["admin"].user.public_id and row.data["sign_in_link_expires_at"]
    assert link_path(link).rsplit("/", 2)[1] not in audit_text()
    assert choose_password(Client(), link).status_code == 302

    # Once they have a password there is no link to make.
    refused = admin.post(page + "/sign-in-link")
    assert refused.status_code == 409 and b"already has a way in" in refused.content


def test_the_console_link_needs_sudo_and_a_caller_who_could_add_the_member(world):
    owner_token = world["owner"].client()
    body = add_member(owner_token, "boss@example.com", role="owner").json()
    page = f"/console/acme/members/{body['id']}"
    # Without a fresh sign-in, the console asks for one first.
    stale = console_signed_in(world["admin"].user, sudo=False).post(page + "/sign-in-link")
    assert stale.status_code == 303 and stale["Location"].startswith("/console/sudo?")
    # An admin could not have added an owner, so they may not become one either.
    refused = console_signed_in(world["admin"].user).post(page + "/sign-in-link")
    assert refused.status_code == 403
    assert not AuditRecord.objects.filter(action="membership.sign_in_link").exists()


def test_a_refused_add_leaves_no_person_behind(world):
    """A member cannot add members: the 403 rolls back the person it would have created."""
    refused = add_member(world["member"].client(), "nobody@example.com")
    assert refused.status_code == 403
    assert not User.objects.filter(email="nobody@example.com").exists()


def test_sign_in_links_in_log_lines_are_masked(db):
    from kestrel_one.common.redaction import redact_text

    user = UserFactory()
    token = sign_in_link_tokens.make_token(user)
    line = f'"GET /login/set-password/dXNyXzAxSjk/{token}/ HTTP/1.1" 400'
    masked = redact_text(line)
    assert token not in masked and "GET /login/" in masked


# manage.py set_password and member_add


def run_manage_here(*args: str, stdin: str = "", **env: str) -> subprocess.CompletedProcess:
    """A real manage.py process against this test run's database."""
    db = connection.settings_dict
    environment = {**os.environ, "DJANGO_SETTINGS_MODULE": "kestrel_one.settings_test", **env}
    environment["TEST_DATABASE_URL"] = (
        f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"
    )
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=REPO,
        env=environment,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.django_db(transaction=True)
def test_member_add_and_set_password_in_real_processes():
    organization = OrganizationFactory(slug="lab")
    added = run_manage_here(
        "member_add",
        "--org",
        "lab",
        "--email",
        "Grace@Example.com",
        "--role",
        "admin",
        KESTREL_PUBLIC_URL="https://kestrel.example.com/",
    )
    assert added.returncode == 0, added.stderr
    assert len(added.stdout.strip().splitlines()) == 1, "one line of JSON"
    result = json.loads(added.stdout)
    assert result["org"] == "lab" and result["user"] == "grace@example.com"
    assert result["role"] == "admin" and result["membership"].startswith("mem_")
    link = result["sign_in_link"]
    assert link.startswith("https://kestrel.example.com/login/set-password/")
    assert result["sign_in_link_expires_at"]

    weak = run_manage_here("set_password", "grace@example.com", stdin="grace12345\n")
    assert weak.returncode != 0
    assert "too short" in weak.stderr
    assert "grace12345" not in weak.stdout + weak.stderr

    unknown = run_manage_here("set_password", "nobody@example.com", stdin=NEW_PASSWORD + "\n")
    assert unknown.returncode != 0 and "nobody@example.com" in unknown.stderr
    assert NEW_PASSWORD not in unknown.stdout + unknown.stderr

    empty = run_manage_here("set_password", "grace@example.com", stdin="\n")
    assert empty.returncode != 0 and "empty" in empty.stderr

    done = run_manage_here(
        "set_password", "grace@example.com", stdin=NEW_PASSWORD + "\nsecond line ignored\n"
    )
    assert done.returncode == 0, done.stderr
    assert NEW_PASSWORD not in done.stdout + done.stderr

    # A real sign-in with the password read from standard input (its first line only).
    browser = Client()
    signed_in = browser.post("/login", {"email": "grace@example.com", "password": NEW_PASSWORD})
    assert signed_in.status_code == 302
    assert browser.get("/console/").context["user"].email == "grace@example.com"
    # Setting the password ended the link that member_add printed.
    assert Client().get(link_path(link)).status_code == 400

    audited = audit_text()
    assert AuditRecord.objects.filter(
        organization=organization, action="user.password_set", data={"via": "set_password command"}
    ).exists()
    token = link_path(link).rstrip("/").rsplit("/", 1)[1]
    for text in (audited, all_text_in_database()):
        assert NEW_PASSWORD not in text and token not in text and "grace12345" not in text


def test_set_password_refuses_a_terminal_and_never_prompts(db):
    UserFactory(email="tty@example.com")

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    with pytest.raises(CommandError, match="standard input"):
        call_command("set_password", "tty@example.com", stdin=Terminal(NEW_PASSWORD + "\n"))


def test_set_password_strips_only_the_line_ending(db):
    user = UserFactory(email="spaces@example.com")
    call_command("set_password", "SPACES@example.com", stdin=io.StringIO("  padded Pw-81x  \r\n"))
    user.refresh_from_db()
    assert user.check_password("  padded Pw-81x  ")


def test_member_add_without_a_public_url_in_hosted_mode_changes_nothing(db, settings):
    OrganizationFactory(slug="lab")
    settings.KESTREL_PUBLIC_URL = None
    with pytest.raises(CommandError, match="KESTREL_PUBLIC_URL"):
        call_command("member_add", "--org", "lab", "--email", "x@example.com", "--role", "viewer")
    assert not User.objects.filter(email="x@example.com").exists()


def test_member_add_in_single_host_mode_points_at_the_local_port(db, settings, monkeypatch):
    OrganizationFactory(slug="lab")
    settings.SINGLE_HOST = True
    settings.KESTREL_PUBLIC_URL = None
    monkeypatch.setenv("PORT", "8123")
    out = io.StringIO()
    call_command(
        "member_add", "--org", "lab", "--email", "local@example.com", "--role", "owner", stdout=out
    )
    result = json.loads(out.getvalue())
    assert result["role"] == "owner", "an operator on the server may add an owner"
    assert result["sign_in_link"].startswith("http://127.0.0.1:8123/login/set-password/")
    assert choose_password(Client(), result["sign_in_link"]).status_code == 302


def test_member_add_for_someone_with_a_password_prints_no_link(db, settings):
    settings.KESTREL_PUBLIC_URL = "https://kestrel.example.com"
    OrganizationFactory(slug="lab")
    UserFactory(email="known@example.com")
    out = io.StringIO()
    call_command(
        "member_add", "--org", "lab", "--email", "known@example.com", "--role", "member", stdout=out
    )
    result = json.loads(out.getvalue())
    assert "sign_in_link" not in result and result["user"] == "known@example.com"
    with pytest.raises(CommandError, match="already a member"):
        call_command(
            "member_add", "--org", "lab", "--email", "known@example.com", "--role", "viewer"
        )
    with pytest.raises(CommandError, match="no organization"):
        call_command("member_add", "--org", "nope", "--email", "a@example.com", "--role", "viewer")


def test_the_service_gives_the_same_link_shape_as_the_api(db):
    organization = OrganizationFactory(slug="lab")
    added = member_add(
        actor=system_principal("tests"),
        organization=organization,
        email="svc@example.com",
        role=Role.VIEWER,
        base_url="https://kestrel.example.com/",
    )
    assert added.sign_in_link.startswith("https://kestrel.example.com/login/set-password/")
    assert Membership.objects.get(pk=added.membership.pk).role == "viewer"


def test_the_link_lifetime_setting_is_read_and_checked():
    shell = (
        "shell",
        "-c",
        "from django.conf import settings; print(settings.PASSWORD_RESET_TIMEOUT)",
    )
    assert run_manage({}, *shell).stdout.split()[-1] == str(72 * 3600)
    assert run_manage({"KESTREL_SIGN_IN_LINK_HOURS": "5"}, *shell).stdout.split()[-1] == "18000"
    zero = run_manage({"KESTREL_SIGN_IN_LINK_HOURS": "0"}, *shell)
    assert zero.returncode != 0 and "KESTREL_SIGN_IN_LINK_HOURS" in zero.stderr
    bad_url = run_manage({"KESTREL_PUBLIC_URL": "kestrel.example.com"}, *shell)
    assert bad_url.returncode != 0 and "KESTREL_PUBLIC_URL" in bad_url.stderr


# The login page and the server token.


def server_token_field(response) -> bool:
    return b'name="server_token"' in response.content


def test_the_login_page_offers_the_server_token_only_when_one_is_configured(db, settings):
    settings.SINGLE_HOST = True
    settings.KESTREL_SERVER_TOKEN = None
    page = Client().get("/login")
    assert page.status_code == 200 and not server_token_field(page)
    assert b'name="csrfmiddlewaretoken"' in page.content

    settings.KESTREL_SERVER_TOKEN = SERVER_TOKEN
    assert server_token_field(Client().get("/login"))

    settings.SINGLE_HOST = False  # hosted mode never takes a server token
    assert not server_token_field(Client().get("/login"))


@pytest.mark.parametrize("value", ["", "anything", SERVER_TOKEN])
def test_without_a_configured_server_token_posting_one_signs_nobody_in(world, settings, value):
    settings.SINGLE_HOST = True
    settings.KESTREL_SERVER_TOKEN = None
    browser = Client()
    refused = browser.post("/login", {"server_token": value})
    assert refused.status_code == 400 and "sessionid" not in refused.cookies
    assert b"Those credentials did not work." in refused.content
    # With an email and password too, the field is ignored: that person signs in, nobody else.
    person = world["viewer"].user
    both = browser.post(
        "/login",
        {"email": person.email, "password": "correct horse battery staple", "server_token": value},
    )
    assert both.status_code == 302
    assert browser.get("/console/").context["user"] == person


def test_a_configured_server_token_still_signs_in_as_the_local_owner(world, settings):
    settings.SINGLE_HOST = True
    settings.KESTREL_SERVER_TOKEN = SERVER_TOKEN
    browser = Client()
    assert browser.post("/login", {"server_token": "wrong"}).status_code == 400
    assert browser.post("/login", {"server_token": SERVER_TOKEN}).status_code == 302
    assert browser.get("/console/").context["user"] == world["owner"].user


def test_sign_in_pages_have_csrf_and_no_inline_script_or_style_attributes(world, settings):
    settings.SINGLE_HOST = True
    settings.KESTREL_SERVER_TOKEN = SERVER_TOKEN
    link = add_member(world["owner"].client(), "csp@example.com").json()["sign_in_link"]
    uid = link_path(link).strip("/").split("/")[2]
    browser = Client()
    form_page = browser.get(browser.get(link_path(link))["Location"])
    refused = Client().get(f"/login/set-password/{uid}/0-0/")
    for page in (Client().get("/login"), form_page, refused):
        html = page.content.decode()
        # Scripts only as files of this origin (the CSP allows no inline script).
        assert not re.search(r"<script(?![^>]*\ssrc=\"/static/)", html), html
        assert "javascript:" not in html
        assert not re.search(r"\s(style|on[a-z]+)\s*=", html), html
        for form in re.findall(r"<form\b.*?</form>", html, flags=re.S):
            assert 'name="csrfmiddlewaretoken"' in form
    assert "<form" in form_page.content.decode()


def test_choosing_a_password_without_the_csrf_token_is_refused(world):
    link = add_member(world["owner"].client(), "csrf@example.com").json()["sign_in_link"]
    browser = Client(enforce_csrf_checks=True)
    form_page = browser.get(link_path(link))["Location"]
    forged = browser.post(form_page, {"new_password1": NEW_PASSWORD, "new_password2": NEW_PASSWORD})
    assert forged.status_code == 403
    assert not User.objects.get(email="csrf@example.com").has_usable_password()
