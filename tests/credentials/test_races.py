"""Credential writes that race: the database's constraint answers as the service's check does."""

from __future__ import annotations

import threading

import pytest
from django.db import connection, transaction

from kestrel_one.accounts.principal import system_principal
from kestrel_one.common.errors import KestrelError
from kestrel_one.credentials.models import Credential
from kestrel_one.credentials.services import credential_create

pytestmark = [pytest.mark.django_db(transaction=True)]


@pytest.mark.spec("API-6")
def test_two_creates_of_one_name_at_once_are_a_conflict_not_a_server_error(world):
    made, release = threading.Event(), threading.Event()

    def first() -> None:
        try:
            with transaction.atomic():
                credential_create(
                    actor=system_principal("tests"),
                    organization=world.org,
                    name="ci bot",
                    adapter="github",
                    secret="ghp_RaceFirstSecret000011112222",
                )
                made.set()
                release.wait(10)
        finally:
            connection.close()  # this thread's own

    racer = threading.Thread(target=first)
    racer.start()
    try:
        assert made.wait(10)
        # The first create is not committed yet: the name check passes, the insert waits on
        # the constraint until the first commits, then fails.
        threading.Timer(0.5, release.set).start()
        with pytest.raises(KestrelError) as refused:
            credential_create(
                actor=system_principal("tests"),
                organization=world.org,
                name="ci bot",
                adapter="github",
                secret="ghp_RaceSecondSecret33334444",
            )
    finally:
        release.set()
        racer.join()
    # The same refusal as when the name check sees the first one (a 409 naming the field).
    assert refused.value.status == 409
    assert refused.value.details == {"name": ["taken"]}
    assert Credential.objects.filter(organization=world.org, name="ci bot").count() == 1
