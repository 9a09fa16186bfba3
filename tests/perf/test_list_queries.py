"""List endpoints run a constant number of queries whatever the page size.

A page of 2 and a page of 40 must cost the same queries: anything per row (a missing
``select_related``, a serializer reaching for a relation) would show up as a difference.
Speed itself is measured in ``bench/``, never asserted here.
"""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from kestrel_one.threads.models import Thread, ThreadEvent

BASE = "/api/v1/orgs/acme/projects/{prj}/threads"


def _queries(client, path: str) -> int:
    # The first request of a token also records its use; measure a steady request.
    client.get(path)
    with CaptureQueriesContext(connection) as captured:
        response = client.get(path)
    assert response.status_code == 200, response.content
    return len(captured.captured_queries)


@pytest.fixture
def many_threads(world):
    Thread.objects.bulk_create(
        Thread(
            organization=world.org,
            project=world.project,
            title=f"thread {index}",
            created_by="perf",
        )
        for index in range(60)
    )
    return world


@pytest.fixture
def many_events(world):
    thread = Thread.objects.create(
        organization=world.org, project=world.project, title="events", created_by="perf"
    )
    ThreadEvent.objects.bulk_create(
        ThreadEvent(
            thread=thread,
            organization=world.org,
            sequence=index + 1,
            kind="perf.event",
            data={"n": index},
        )
        for index in range(60)
    )
    return thread


def test_thread_list_queries_do_not_grow_with_the_page(many_threads):
    client = many_threads["owner"].client()
    path = BASE.format(prj=many_threads.project.public_id)
    small = _queries(client, f"{path}?limit=2")
    large = _queries(client, f"{path}?limit=40")
    assert small == large


def test_event_list_queries_do_not_grow_with_the_page(world, many_events):
    client = world["owner"].client()
    path = f"{BASE.format(prj=world.project.public_id)}/{many_events.public_id}/events"
    small = _queries(client, f"{path}?limit=2")
    large = _queries(client, f"{path}?limit=40")
    assert small == large


def test_audit_list_queries_do_not_grow_with_the_page(world):
    client = world["owner"].client()
    # The world's setup already wrote audit records (memberships, tokens...); add more.
    from django.db import transaction

    from kestrel_one.accounts.principal import system_principal
    from kestrel_one.audit.services import audit_record

    with transaction.atomic():
        for index in range(45):
            audit_record(
                organization=world.org,
                actor=system_principal("perf"),
                action="perf.record",
                data={"n": index},
            )
    small = _queries(client, "/api/v1/orgs/acme/audit?limit=2")
    large = _queries(client, "/api/v1/orgs/acme/audit?limit=40")
    assert small == large


def test_member_list_queries_do_not_grow_with_the_page(world):
    """Limited members' projects are read for the whole page at once."""
    from kestrel_one.accounts.scopes import Role
    from tests.conftest import make_person

    for index in range(30):
        make_person(world.org, Role.MEMBER, name=f"limited{index}", projects=[world.project])
    client = world["owner"].client()
    path = "/api/v1/orgs/acme/members"
    # Both pages hold limited members (the world's own "limited" is the fifth member).
    assert _queries(client, f"{path}?limit=6") == _queries(client, f"{path}?limit=35")
    body = client.get(f"{path}?limit=50").json()
    extra = [m for m in body["results"] if m["user"]["email"].startswith("limited0")]
    assert extra and all(m["projects"] == [world.project.public_id] for m in extra)


def test_reading_an_action_reads_its_row_once(world):
    """GET of one action, without ``?wait=``: the lookup already joins what the answer shows,
    so the row is not read a second time to answer."""
    client = world["owner"].client()
    path = (
        f"{BASE.format(prj=world.project.public_id)}/{world.thread.public_id}"
        f"/actions/{world.finished_action.public_id}"
    )
    client.get(path)
    with CaptureQueriesContext(connection) as captured:
        response = client.get(path)
    assert response.status_code == 200, response.content
    assert response.json()["id"] == world.finished_action.public_id
    reads = [q["sql"] for q in captured.captured_queries if 'FROM "execution_action"' in q["sql"]]
    assert len(reads) == 1, reads
