"""Console sessions are short-lived (API-2): they end KESTREL_SESSION_SECONDS after sign-in,
capped at 12 hours, and an ended session lets nobody into the console."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.sessions.models import Session
from django.test import override_settings
from django.utils import timezone

from kestrel_one.accounts.sessions import SIGNED_IN_AT
from kestrel_one.console.sudo import SESSION_KEY as SUDO_SESSION_KEY
from tests.test_settings import run_manage

pytestmark = pytest.mark.spec("API-2")

PRINT_AGE = "from django.conf import settings; print(settings.SESSION_COOKIE_AGE)"


@override_settings(SESSION_COOKIE_AGE=900)
def test_a_session_ends_at_its_lifetime_after_sign_in(world, client):
    owner = world["owner"].user
    before = timezone.now()
    response = client.post(
        "/login", {"email": owner.email, "password": "correct horse battery staple"}
    )
    after = timezone.now()
    assert response.status_code == 302
    key = response.cookies["sessionid"].value
    session = Session.objects.get(session_key=key)
    assert before + timedelta(seconds=900) <= session.expire_date
    assert session.expire_date <= after + timedelta(seconds=900)
    assert client.get("/console/").status_code == 200
    # Using the console does not extend it: the lifetime counts from sign-in.
    assert Session.objects.get(session_key=key).expire_date == session.expire_date
    Session.objects.filter(session_key=key).update(
        expire_date=timezone.now() - timedelta(seconds=1)
    )
    ended = client.get("/console/")
    assert ended.status_code == 302 and ended["Location"].startswith("/login")
    assert client.get("/console/acme/tokens").status_code == 302


@override_settings(SESSION_COOKIE_AGE=900)
def test_writing_to_the_session_later_does_not_extend_it(world, client):
    """A sudo confirmation writes the session, as a message shown on the next page does;
    Django's database sessions would then count the lifetime again from that write."""
    owner = world["owner"].user
    password = "correct horse battery staple"
    assert client.post("/login", {"email": owner.email, "password": password}).status_code == 302
    key = client.cookies["sessionid"].value
    signed_in_until = Session.objects.get(session_key=key).expire_date
    # Ten minutes on, as far as the session can tell: its sign-in is that much older.
    session = client.session
    session[SIGNED_IN_AT] -= 600
    session.save()
    Session.objects.filter(session_key=key).update(expire_date=signed_in_until)
    confirmed = client.post("/console/sudo", {"password": password, "next": "/console/"})
    assert confirmed.status_code == 302 and confirmed["Location"] == "/console/"
    assert client.session[SUDO_SESSION_KEY]  # written
    expiry = Session.objects.get(session_key=key).expire_date
    assert expiry <= signed_in_until - timedelta(seconds=599)


def test_the_session_lifetime_defaults_to_two_hours_and_is_capped():
    default = run_manage({}, "shell", "-c", PRINT_AGE)
    assert default.returncode == 0, default.stderr
    assert default.stdout.splitlines()[-1] == str(2 * 60 * 60)
    long = run_manage({"KESTREL_SESSION_SECONDS": str(30 * 24 * 3600)}, "shell", "-c", PRINT_AGE)
    assert long.returncode == 0, long.stderr
    assert long.stdout.splitlines()[-1] == str(12 * 60 * 60)
