"""Console sessions are short-lived (API-2): they end KESTREL_SESSION_SECONDS after sign-in,
capped at 12 hours, and an ended session lets nobody into the console."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.sessions.models import Session
from django.test import override_settings
from django.utils import timezone

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


def test_the_session_lifetime_defaults_to_two_hours_and_is_capped():
    default = run_manage({}, "shell", "-c", PRINT_AGE)
    assert default.returncode == 0, default.stderr
    assert default.stdout.splitlines()[-1] == str(2 * 60 * 60)
    long = run_manage({"KESTREL_SESSION_SECONDS": str(30 * 24 * 3600)}, "shell", "-c", PRINT_AGE)
    assert long.returncode == 0, long.stderr
    assert long.stdout.splitlines()[-1] == str(12 * 60 * 60)
