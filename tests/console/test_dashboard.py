"""The team dashboard (SURF-1): the overview, a project's threads and a thread's timeline
show what the person may see, in a number of queries that does not grow with the rows."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from django.utils.html import escape

from kestrel_one.accounts.principal import Principal, PrincipalKind
from kestrel_one.artifacts.models import ShareLink
from kestrel_one.artifacts.services import artifact_create
from kestrel_one.console.dashboard import CHART_DAYS, actions_per_day
from kestrel_one.execution.approvals import verification_record
from kestrel_one.execution.models import Action
from kestrel_one.execution.services import action_request
from kestrel_one.tenancy.models import Project
from kestrel_one.threads.services import thread_create

pytestmark = pytest.mark.spec("SURF-1")


def signed_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def person(actor) -> Principal:
    return Principal(PrincipalKind.SESSION, user=actor.user)


def timeline_url(world, thread=None) -> str:
    thread = thread or world.thread
    return f"/console/acme/projects/{thread.project.public_id}/threads/{thread.public_id}"


def more_actions(world, count: int, *, thread=None) -> None:
    for index in range(count):
        action_request(
            actor=world.agent,
            thread=thread or world.thread,
            tool="fs.read",
            args={"path": f"docs/{index}.md"},
        )


def query_count(client, url: str) -> int:
    with CaptureQueriesContext(connection) as queries:
        response = client.get(url)
    assert response.status_code == 200, url
    return len(queries)


def test_the_overview_shows_projects_approvals_activity_and_the_chart(world):
    html = signed_in(world["member"].user).get("/console/acme/").content.decode()
    assert "launchpad" in html and "hangar" in html
    assert f"/console/acme/actions/{world.action.public_id}" in html  # awaiting approval
    assert "action.requested" in html  # recent activity
    assert '<svg class="chart"' in html and "<title" in html
    # The chart's numbers, also as a table: one action succeeded and one awaits today.
    assert "2 actions in the last 14 days: 1 succeeded, 0 failed, 0 denied, 1 awaiting" in html
    assert "Globex" not in html.split("</header>", 1)[1]


def test_a_viewer_sees_no_approvals_they_cannot_give(world):
    html = signed_in(world["viewer"].user).get("/console/acme/").content.decode()
    assert "No approvals waiting." in html
    assert f"/console/acme/actions/{world.action.public_id}" not in html.split("Recent activity")[0]


def test_the_chart_counts_actions_per_day_by_outcome_in_one_query(world, django_assert_num_queries):
    Action.objects.filter(pk=world.finished_action.pk).update(
        created_at=timezone.now() - timedelta(days=2)
    )
    Action.objects.filter(pk=world.action.pk).update(state="denied")
    since = timezone.now() - timedelta(days=CHART_DAYS)
    projects = Project.objects.filter(organization=world.org)
    with django_assert_num_queries(1):
        rows = actions_per_day(projects=projects, since=since)
    assert sorted(sum(counts.values()) for counts in rows.values()) == [1, 1]
    assert sum(counts["denied"] for counts in rows.values()) == 1
    assert sum(counts["succeeded"] for counts in rows.values()) == 1


def test_the_chart_is_kept_for_the_configured_seconds_per_set_of_visible_projects(world, settings):
    """With the cache on, a second view within the minute reads the chart from the cache (one
    query fewer, the same numbers although an action was added); a person who sees other
    projects gets a chart of their own."""
    from django.core.cache import cache

    cache.clear()
    settings.KESTREL_CONSOLE_CHART_SECONDS = 60
    member = signed_in(world["member"].user)
    first = query_count(member, "/console/acme/")
    more_actions(world, 1)
    html = member.get("/console/acme/").content.decode()
    assert "2 actions in the last 14 days" in html  # as cached, not 3
    assert query_count(member, "/console/acme/") == first - 1
    limited = signed_in(world["limited"].user).get("/console/acme/").content.decode()
    assert "0 actions in the last 14 days" in limited  # only hangar, where nothing ran
    cache.clear()


def test_overview_queries_do_not_grow_with_the_actions(world):
    client = signed_in(world["member"].user)
    more_actions(world, 3)
    few = query_count(client, "/console/acme/")
    more_actions(world, 30)
    assert query_count(client, "/console/acme/") == few


def test_the_project_page_lists_threads_newest_first_with_mode_and_state(world):
    html = (
        signed_in(world["member"].user)
        .get(f"/console/acme/projects/{world.project.public_id}/")
        .content.decode()
    )
    assert html.index("plan it") < html.index("build")  # newest first
    assert "mode-plan" in html and "mode-agent" in html
    assert timeline_url(world) in html


def test_project_queries_do_not_grow_with_the_threads(world):
    client = signed_in(world["member"].user)
    url = f"/console/acme/projects/{world.project.public_id}/"
    for index in range(3):
        thread_create(actor=world.agent, project=world.project, title=f"t{index}", mode="ask")
    few = query_count(client, url)
    for index in range(30):
        thread_create(actor=world.agent, project=world.project, title=f"u{index}", mode="ask")
    assert query_count(client, url) == few


def test_threads_are_paginated(world):
    for index in range(55):
        thread_create(actor=world.agent, project=world.project, title=f"t{index}", mode="ask")
    client = signed_in(world["member"].user)
    url = f"/console/acme/projects/{world.project.public_id}/"
    first = client.get(url).content.decode()
    assert "Page 1 of 2" in first and "t54" in first and "build" not in first
    assert "build" in client.get(url + "?page=2").content.decode()


def test_a_limited_member_sees_only_the_granted_projects_threads(world):
    hangar_thread = thread_create(
        actor=world.agent, project=world.other_project, title="hangar work", mode="agent"
    )
    client = signed_in(world["limited"].user)
    overview = client.get("/console/acme/").content.decode()
    assert "hangar" in overview and "launchpad" not in overview
    assert "hangar work" in overview and world.thread.title not in overview.split("Recent")[1]
    assert client.get(f"/console/acme/projects/{world.project.public_id}/").status_code == 404
    assert client.get(timeline_url(world)).status_code == 404
    page = client.get(f"/console/acme/projects/{world.other_project.public_id}/")
    assert "hangar work" in page.content.decode()
    assert client.get(timeline_url(world, hangar_thread)).status_code == 200


def test_a_thread_of_another_project_is_missing_under_this_one(world):
    hangar_thread = thread_create(
        actor=world.agent, project=world.other_project, title="hangar work", mode="agent"
    )
    client = signed_in(world["owner"].user)
    url = f"/console/acme/projects/{world.project.public_id}/threads/{hangar_thread.public_id}"
    assert client.get(url).status_code == 404


def test_the_timeline_shows_events_actions_decisions_receipts_and_plans(world):
    verification_record(
        actor=person(world["member"]),
        action=world.finished_action,
        accepted=True,
        evidence="the tests pass",
    )
    html = signed_in(world["member"].user).get(timeline_url(world)).content.decode()
    for kind in ("thread.created", "action.requested", "action.decided", "action.verified"):
        assert kind in html
    assert html.index("#1") < html.index("#2")  # ordered
    action = world.action
    assert f"/console/acme/actions/{action.public_id}" in html
    assert action.decision["outcome"] == "needs_approval" and "needs_approval" in html
    assert action.decision["reasons"]
    for reason in action.decision["reasons"]:
        assert escape(reason) in html
    receipt = world.finished_action.receipt
    assert receipt.public_id in html
    assert "the tests pass" in html
    assert "hx-get" in html and "hx-trigger" in html
    plan_html = signed_in(world["member"].user).get(timeline_url(world, world.plan_thread))
    assert world.plan.public_id in plan_html.content.decode()
    assert "src/a.py" in plan_html.content.decode()


def test_the_timeline_never_shows_sealed_arguments(world):
    action = action_request(
        actor=world.agent,
        thread=world.thread,
        tool="shell.exec",
        args={"argv": ["deploy"], "env": {"API_KEY": "sk-live-canary-1234567890abcdef"}},
    )
    assert action.sealed_args
    html = signed_in(world["owner"].user).get(timeline_url(world)).content.decode()
    assert action.public_id in html
    assert "sk-live-canary-1234567890abcdef" not in html
    assert action.sealed_args not in html


def test_timeline_queries_do_not_grow_with_the_actions(world):
    client = signed_in(world["member"].user)
    thread = thread_create(actor=world.agent, project=world.project, title="busy", mode="agent")
    more_actions(world, 3, thread=thread)
    for index in range(2):
        artifact_create(
            project=world.project,
            thread=thread,
            kind="file",
            name=f"out{index}.txt",
            content=b"x",
            created_by="tests",
        )
    few = query_count(client, timeline_url(world, thread))
    more_actions(world, 30, thread=thread)
    for index in range(10):
        artifact_create(
            project=world.project,
            thread=thread,
            kind="file",
            name=f"more{index}.txt",
            content=b"x",
            created_by="tests",
        )
    assert query_count(client, timeline_url(world, thread)) == few


def test_the_poll_answers_nothing_until_something_happens(world):
    client = signed_in(world["member"].user)
    world.thread.refresh_from_db()
    last = world.thread.last_event_sequence
    poll = f"{timeline_url(world)}/timeline?after={last}"
    assert client.get(poll).status_code == 204
    action = action_request(
        actor=world.agent, thread=world.thread, tool="fs.read", args={"path": "NEW.md"}
    )
    response = client.get(poll, headers={"HX-Request": "true"})
    assert response.status_code == 200
    html = response.content.decode()
    assert action.public_id in html and "<html" not in html
    world.thread.refresh_from_db()
    assert f"after={world.thread.last_event_sequence}" in html
    # The same address opened in the browser itself is the whole page.
    page = client.get(poll.split("?")[0]).content.decode()
    assert "<title>" in page and action.public_id in page


def test_a_member_makes_a_share_link_and_a_viewer_is_offered_none(world):
    artifact = artifact_create(
        project=world.project,
        thread=world.thread,
        kind="file",
        name="report.txt",
        content=b"the report\n",
        created_by="tests",
    )
    viewer_html = signed_in(world["viewer"].user).get(timeline_url(world)).content.decode()
    assert f"/artifacts/{artifact.public_id}/content" in viewer_html
    assert 'method="post"' not in viewer_html.split("</header>", 1)[1]
    member = signed_in(world["member"].user)
    member_html = member.get(timeline_url(world)).content.decode()
    assert f"/console/acme/artifacts/{artifact.public_id}/share" in member_html
    response = member.post(
        f"/console/acme/artifacts/{artifact.public_id}/share", {"expires_in": "3600"}
    )
    assert response.status_code == 201
    link = ShareLink.objects.get(artifact=artifact)
    html = response.content.decode()
    assert "/api/v1/shared/ksh_" in html and link.token_hash not in html
    assert 3500 < (link.expires_at - timezone.now()).total_seconds() <= 3600
    bad = member.post(f"/console/acme/artifacts/{artifact.public_id}/share", {"expires_in": "9"})
    assert bad.status_code == 400
    assert ShareLink.objects.filter(artifact=artifact).count() == 1


def test_an_artifact_downloads_as_an_attachment(world):
    artifact = artifact_create(
        project=world.project,
        thread=world.thread,
        kind="file",
        name="report.txt",
        content=b"the report\n",
        created_by="tests",
    )
    response = signed_in(world["viewer"].user).get(
        f"/console/acme/artifacts/{artifact.public_id}/content"
    )
    assert response.status_code == 200
    assert b"".join(response.streaming_content) == b"the report\n"
    assert response["Content-Disposition"].startswith("attachment")
    assert response["X-Content-Type-Options"] == "nosniff"


def test_older_events_page_back_and_are_not_polled(world, monkeypatch):
    monkeypatch.setattr("kestrel_one.console.dashboard.TIMELINE_EVENTS", 3)
    client = signed_in(world["member"].user)
    world.thread.refresh_from_db()
    last = world.thread.last_event_sequence
    newest = client.get(timeline_url(world)).content.decode()
    assert f'id="event-{last}"' in newest and 'id="event-1"' not in newest
    assert f"?before={last - 2}" in newest and "hx-get" in newest
    older = client.get(f"{timeline_url(world)}?before={last - 2}").content.decode()
    assert f'id="event-{last - 3}"' in older and f'id="event-{last}"' not in older
    assert "hx-get" not in older


def test_an_ended_thread_with_nothing_in_flight_is_not_polled(world):
    from kestrel_one.threads.services import thread_end

    thread = thread_create(actor=world.agent, project=world.project, title="done", mode="ask")
    client = signed_in(world["member"].user)
    assert "hx-get" in client.get(timeline_url(world, thread)).content.decode()
    thread_end(actor=world.agent, thread=thread)
    html = client.get(timeline_url(world, thread)).content.decode()
    assert "ended" in html and "hx-get" not in html
    # The world's thread still has an action awaiting approval: watched even once ended.
    thread_end(actor=world.agent, thread=world.thread)
    assert "hx-get" in client.get(timeline_url(world)).content.decode()


def test_the_project_page_says_how_to_connect_an_mcp_client_and_lists_open_sessions(world):
    url = f"/api/v1/orgs/acme/projects/{world.project.public_id}/mcp"
    client = world["member"].client()
    initialized = client.post(
        url,
        data=(
            '{"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion":'
            ' "2025-11-25", "capabilities": {}, "clientInfo": {"name": "cursor", "version": "1"}}}'
        ),
        content_type="application/json",
        HTTP_ACCEPT="application/json, text/event-stream",
    )
    assert initialized.status_code == 200, initialized.content
    session = initialized["Mcp-Session-Id"]
    page = signed_in(world["viewer"].user).get(f"/console/acme/projects/{world.project.public_id}/")
    html = page.content.decode()
    assert f"http://testserver{url}" in html
    assert session in html and "cursor" in html
    # An ended session is not listed.
    client.delete(url, HTTP_MCP_SESSION_ID=session)
    html = signed_in(world["viewer"].user).get(f"/console/acme/projects/{world.project.public_id}/")
    assert session not in html.content.decode()
