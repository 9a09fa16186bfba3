"""A thread's replay: its events, actions, decisions and receipts, in order, redacted."""

from __future__ import annotations

import pytest

from kestrel_one.execution.approvals import approval_decide
from kestrel_one.execution.services import action_request
from kestrel_one.threads.models import ThreadEvent
from tests.artifacts.conftest import person
from tests.artifacts.test_output_artifacts import SECRET, shell_result

pytestmark = pytest.mark.spec("AUD-5")


def replay_url(records) -> str:
    return (
        f"/api/v1/orgs/acme/projects/{records.project.public_id}"
        f"/threads/{records.thread.public_id}/replay"
    )


@pytest.fixture
def finished_thread(world, records):
    """Reads, a write, a long shell run, a denied call and a person's approval."""
    records.run("fs.read", {"path": "README.md"}, {"path": "README.md", "content": "hi"})
    records.run(
        "fs.write",
        {"path": "src/app.py", "content": f"API_KEY = '{SECRET}'\n"},
        {"path": "src/app.py", "size": 10, "sha256": "0" * 64},
    )
    records.run("shell.exec", {"argv": ["make"]}, shell_result("y" * 30_000))
    # Waits for a person: its replay shows the decision so far.
    waiting = action_request(
        actor=person(world["owner"]), thread=records.thread, tool="code.python", args={"code": "1"}
    )
    assert waiting.state == "awaiting_approval"
    records.run("fs.list", {"path": "."}, {"path": ".", "entries": [], "truncated": False})
    return records, waiting


def test_replay_of_a_finished_thread_reproduces_its_order_exactly(world, finished_thread):
    records, _ = finished_thread
    client = world["viewer"].client()
    first = client.get(replay_url(records))
    assert first.status_code == 200, first.content
    body = first.json()
    stored = list(
        ThreadEvent.objects.filter(thread=records.thread)
        .order_by("sequence")
        .values_list("sequence", "kind")
    )
    assert [(e["sequence"], e["kind"]) for e in body["events"]] == stored
    assert [e["sequence"] for e in body["events"]] == list(range(1, len(stored) + 1))
    # Actions in the order their first event appears; receipts in the order recorded.
    first_seen = []
    for event in body["events"]:
        if event["action"] and event["action"] not in first_seen:
            first_seen.append(event["action"])
    assert [a["id"] for a in body["actions"]] == first_seen
    finished = [e["data"]["receipt"] for e in body["events"] if e["kind"] == "action.finished"]
    assert [r["id"] for r in body["receipts"]] == finished
    assert all(a["decision"]["outcome"] for a in body["actions"])
    # Reading it again gives the same bytes, and the events endpoint agrees.
    assert client.get(replay_url(records)).content == first.content
    events_url = replay_url(records).replace("/replay", "/events?limit=500")
    listed = client.get(events_url).json()["results"]
    assert [e["sequence"] for e in listed] == [e["sequence"] for e in body["events"]]
    # The long output's artifact belongs to the thread's records.
    assert [a["kind"] for a in body["artifacts"]] == ["stdout"]


def test_pages_put_together_are_the_whole_replay(world, finished_thread):
    records, _ = finished_thread
    client = world["owner"].client()
    whole = client.get(replay_url(records)).json()
    sequences, after = [], 0
    while after is not None:
        page = client.get(f"{replay_url(records)}?after={after}&limit=3").json()
        sequences += [e["sequence"] for e in page["events"]]
        after = page["next_after"]
    assert sequences == [e["sequence"] for e in whole["events"]]
    for value in ("-1", "\u00b2"):  # a superscript two is a digit to str.isdigit, not to int
        bad = client.get(f"{replay_url(records)}?after={value}")
        assert bad.status_code == 400 and "after" in bad.json()["error"]["details"]


@pytest.mark.spec("AUD-2", "CRED-1")
def test_replay_is_redacted_and_bounded(world, finished_thread):
    records, _ = finished_thread
    response = world["owner"].client().get(replay_url(records))
    assert SECRET not in response.content.decode()
    write = next(a for a in response.json()["actions"] if a["tool"] == "fs.write")
    assert "[redacted]" in write["args"]["content"]
    assert len(response.content) < 200_000


def test_a_persons_decision_is_part_of_the_replay(world, records):
    action = action_request(
        actor=world.agent, thread=records.thread, tool="code.python", args={"code": "1"}
    )
    assert action.state == "awaiting_approval"
    approval_decide(actor=person(world["owner"]), action=action, approve=False, reason="no")
    body = world["owner"].client().get(replay_url(records)).json()
    replayed = next(a for a in body["actions"] if a["id"] == action.public_id)
    assert replayed["decision"]["outcome"] == "needs_approval"
    assert replayed["approval"]["decision"] == "denied"
    assert replayed["approval"]["by"] == world["owner"].user.public_id
    kinds = [e["kind"] for e in body["events"] if e["action"] == action.public_id]
    assert kinds[:2] == ["action.requested", "action.decided"] and len(kinds) > 2


@pytest.mark.spec("AUD-7", "TEN-4")
def test_replay_follows_project_visibility(world, records):
    missing = (
        world["owner"]
        .client()
        .get(
            replay_url(records).replace(records.thread.public_id, "thr_00000000000000000000000000")
        )
    )
    for name in ("limited", "outsider"):
        response = world[name].client().get(replay_url(records))
        assert response.status_code == 404 and response.content == missing.content
    assert world["anonymous"].client().get(replay_url(records)).status_code == 401


@pytest.mark.spec("AUD-5", "TEN-6")
def test_the_last_page_lists_a_bounded_number_of_artifacts_and_says_when_there_are_more(
    world, records, monkeypatch
):
    """Events come in pages, and so must the records listed beside them: a thread's
    artifacts grow with every call (up to 18 each), and a share link serves the replay to
    anyone holding it, so one request must not list them all."""
    from kestrel_one.artifacts import selectors
    from kestrel_one.artifacts.services import artifact_create, share_create

    monkeypatch.setattr(selectors, "REPLAY_RECORDS_MAX", 3, raising=False)
    made = [
        artifact_create(
            project=records.project,
            thread=records.thread,
            kind="file",
            name=f"out/{index}.txt",
            content=b"x",
            created_by="tests",
        )
        for index in range(5)
    ]
    body = world["owner"].client().get(replay_url(records)).json()
    assert [a["id"] for a in body["artifacts"]] == sorted(a.public_id for a in made)[:3]
    assert body["artifacts_more"] is True and body["checkpoints_more"] is False
    _, token = share_create(actor=person(world["owner"]), thread=records.thread, expires_in=600)
    shared = world["anonymous"].client().get(f"/api/v1/shared/{token}").json()["replay"]
    assert len(shared["artifacts"]) == 3 and shared["artifacts_more"] is True
