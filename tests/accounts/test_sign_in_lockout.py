"""Console sign-in lockout: repeated failures for one email from one address are refused."""

from __future__ import annotations

from datetime import timedelta

import pytest
from axes.models import AccessAttempt
from django.test import Client
from django.utils import timezone

from tests.accounts.test_tokens import all_text_in_database

pytestmark = pytest.mark.spec("API-2")

PASSWORD = "correct horse battery staple"
WRONG = "wrong-password-Zq83-never-stored"
ADDRESS = "203.0.113.7"
LOCKED = b"Too many failed sign-ins for this account from your address."


def sign_in(email: str, password: str, *, address: str = ADDRESS, **headers):
    return Client(REMOTE_ADDR=address, **headers).post(
        "/login", {"email": email, "password": password}
    )


def fail(email: str, times: int, **kwargs) -> list[int]:
    return [sign_in(email, WRONG, **kwargs).status_code for _ in range(times)]


@pytest.fixture
def email(world) -> str:
    return world["owner"].user.email


def test_the_fifth_failure_locks_and_then_the_right_password_is_refused(email):
    assert fail(email, 4) == [400, 400, 400, 400]
    fifth = sign_in(email, WRONG)
    assert fifth.status_code == 429
    assert LOCKED in fifth.content

    right = sign_in(email, PASSWORD)
    assert right.status_code == 429
    assert LOCKED in right.content
    assert "sessionid" not in right.cookies


def test_the_lockout_holds_only_that_email_from_that_address(world, email):
    fail(email, 5)
    elsewhere = sign_in(email, PASSWORD, address="198.51.100.2")
    assert elsewhere.status_code == 302 and "sessionid" in elsewhere.cookies
    colleague = world["member"].user.email
    assert sign_in(colleague, PASSWORD).status_code == 302


def test_the_email_counts_whatever_its_case(email):
    fail(email.upper(), 5)
    assert sign_in(email, PASSWORD).status_code == 429


def test_a_forwarded_for_header_does_not_give_a_fresh_address(email):
    for n in range(5):
        sign_in(email, WRONG, HTTP_X_FORWARDED_FOR=f"192.0.2.{n}")
    assert sign_in(email, PASSWORD, HTTP_X_FORWARDED_FOR="192.0.2.99").status_code == 429


def test_fresh_ipv6_addresses_of_one_64_share_one_lockout(email):
    """Counted per address, a client holding a /64 would guess without end, five a time."""
    for n in range(5):
        sign_in(email, WRONG, address=f"2001:db8:1:2::{n + 1:x}")
    assert sign_in(email, PASSWORD, address="2001:db8:1:2:abcd::9").status_code == 429
    assert sign_in(email, PASSWORD, address="2001:db8:1:3::1").status_code == 302


def test_a_success_resets_the_count(email):
    fail(email, 4)
    assert sign_in(email, PASSWORD).status_code == 302
    assert fail(email, 4) == [400, 400, 400, 400]


def test_the_lockout_ends_after_the_cool_off(email, settings):
    fail(email, 5)
    assert sign_in(email, PASSWORD).status_code == 429
    # The attempts grow old, as they would in real time.
    past = timezone.now() - settings.AXES_COOLOFF_TIME - timedelta(seconds=1)
    assert AccessAttempt.objects.update(attempt_time=past) == 1
    assert sign_in(email, PASSWORD).status_code == 302


def test_the_server_token_is_locked_out_too(world, settings):
    settings.SINGLE_HOST = True
    settings.KESTREL_SERVER_TOKEN = "kst-server-token-for-this-test-7f3a"
    client = Client(REMOTE_ADDR=ADDRESS)
    assert client.post("/login", {"server_token": "guess"}).status_code == 400
    for _ in range(4):
        client.post("/login", {"server_token": "guess"})
    refused = client.post("/login", {"server_token": settings.KESTREL_SERVER_TOKEN})
    assert refused.status_code == 429 and "sessionid" not in refused.cookies
    # From another address, the token still signs in as the local owner.
    other = Client(REMOTE_ADDR="198.51.100.2")
    signed_in = other.post("/login", {"server_token": settings.KESTREL_SERVER_TOKEN})
    assert signed_in.status_code == 302
    assert other.get("/console/").context["user"] == world["owner"].user


def test_failed_attempts_keep_no_secret(email, settings):
    settings.SINGLE_HOST = True
    settings.KESTREL_SERVER_TOKEN = "kst-server-token-for-this-test-7f3a"
    fail(email, 5)
    Client(REMOTE_ADDR=ADDRESS).post("/login", {"server_token": "kst-wrong-guess-Hq2"})
    assert AccessAttempt.objects.count() == 2
    text = all_text_in_database()
    assert email in text  # the attempts are there
    for secret in (WRONG, "kst-wrong-guess-Hq2", settings.KESTREL_SERVER_TOKEN):
        assert secret not in text


def test_the_admin_sign_in_is_locked_out_too(email):
    admin = Client(REMOTE_ADDR=ADDRESS)
    statuses = [
        admin.post("/admin/login/", {"username": email, "password": WRONG}).status_code
        for _ in range(5)
    ]
    assert statuses == [200, 200, 200, 200, 429]
    assert sign_in(email, PASSWORD).status_code == 429


def test_the_hourly_sweep_forgets_attempts_whose_lockout_has_passed(email, settings):
    from kestrel_one.execution.tasks import retention

    fail(email, 2)
    fail("someone@else.example", 1, address="198.51.100.2")
    AccessAttempt.objects.filter(username="someone@else.example").update(
        attempt_time=timezone.now() - settings.AXES_COOLOFF_TIME - timedelta(seconds=1)
    )
    retention()  # the beat task, run in this process
    assert list(AccessAttempt.objects.values_list("username", "failures_since_start")) == [
        (email, 2)
    ]
