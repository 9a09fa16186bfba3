"""A share link opens its one object and nothing else: not as a credential, not around it."""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from kestrel_one.artifacts.models import ShareLink
from kestrel_one.audit.models import AuditRecord
from kestrel_one.common.ids import PREFIXES
from kestrel_one.execution.approvals import approval_decide
from kestrel_one.execution.services import action_dispatch, action_request, report_ingest
from tests.api.routes import KWARGS, org_scoped_routes
from tests.api.test_cross_tenant import fill
from tests.artifacts.conftest import person
from tests.artifacts.helpers import finished_report, workspace_archive
from tests.artifacts.test_output_artifacts import shell_result

pytestmark = pytest.mark.spec("TEN-6", "AUD-7")


@pytest.fixture
def artifact(records):
    action = records.run("shell.exec", {"argv": ["make"]}, shell_result("x" * 40_000))
    return action.artifacts.get()


def anonymous() -> APIClient:
    return APIClient(REMOTE_ADDR="203.0.113.9")


def share(world, url, body=None, actor="member"):
    response = world[actor].client().post(url, body or {"expires_in": 3600}, format="json")
    assert response.status_code == 201, response.content
    return response.json()


def test_an_artifact_link_opens_that_artifact_and_its_content(world, records, artifact):
    made = share(world, f"/api/v1/orgs/acme/artifacts/{artifact.public_id}/share")
    assert made["artifact"] == artifact.public_id and made["token"].startswith("ksh_")
    link = ShareLink.objects.get(public_id=made["id"])
    assert made["token"] not in link.token_hash  # stored hashed, shown once
    assert AuditRecord.objects.filter(action="share.create", target_id=link.public_id).count() == 1

    opened = anonymous().get(made["url"])
    assert opened.status_code == 200
    body = opened.json()
    assert body["kind"] == "artifact" and body["artifact"]["sha256"] == artifact.sha256
    assert "id" not in body["artifact"]
    # Nothing names what is around it.
    text = opened.content.decode()
    for around in (
        records.project.public_id,
        records.thread.public_id,
        "acme",
        world.org.public_id,
    ):
        assert around not in text
    content = anonymous().get(body["content_url"])
    assert content.status_code == 200
    assert b"".join(content.streaming_content) == b"x" * 40_000
    assert content["X-Content-Type-Options"] == "nosniff"
    assert content["Content-Disposition"].startswith("attachment;")
    assert content["Referrer-Policy"] == "no-referrer"


def test_a_thread_link_opens_its_replay_only(world, records, artifact):
    base = (
        f"/api/v1/orgs/acme/projects/{records.project.public_id}/threads/{records.thread.public_id}"
    )
    made = share(world, f"{base}/share")
    assert made["thread"] == records.thread.public_id
    opened = anonymous().get(made["url"])
    assert opened.status_code == 200
    replay = opened.json()["replay"]
    assert replay["thread"]["title"] == records.thread.title and "id" not in replay["thread"]
    assert [e["sequence"] for e in replay["events"]] == list(range(1, len(replay["events"]) + 1))
    text = opened.content.decode()
    assert records.project.public_id not in text and "acme" not in text
    assert world["owner"].token.public_id not in text  # requesters are not shown
    # The thread's artifacts are listed, but the link opens no content.
    assert anonymous().get(f"{made['url']}/content").status_code == 404


def test_revoked_expired_and_unknown_links_are_the_same_404(world, artifact):
    made = share(world, f"/api/v1/orgs/acme/artifacts/{artifact.public_id}/share")
    unknown = anonymous().get("/api/v1/shared/ksh_" + "A" * 43)
    assert unknown.status_code == 404

    link = ShareLink.objects.get(public_id=made["id"])
    ShareLink.objects.filter(pk=link.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert anonymous().get(made["url"]).content == unknown.content
    ShareLink.objects.filter(pk=link.pk).update(expires_at=timezone.now() + timedelta(hours=1))
    assert anonymous().get(made["url"]).status_code == 200

    revoked = world["member"].client().delete(f"/api/v1/orgs/acme/shares/{link.public_id}")
    assert revoked.status_code == 200 and revoked.json()["active"] is False
    for tail in ("", "/content"):
        response = anonymous().get(made["url"] + tail)
        assert response.status_code == 404 and response.content == unknown.content
    assert AuditRecord.objects.filter(action="share.revoke", target_id=link.public_id).exists()


def test_viewers_cannot_share_and_limited_members_cannot_share_hidden_threads(
    world, records, artifact
):
    url = f"/api/v1/orgs/acme/artifacts/{artifact.public_id}/share"
    assert world["viewer"].client().post(url, {}, format="json").status_code == 403
    assert world["limited"].client().post(url, {}, format="json").status_code == 404
    assert world["outsider"].client().post(url, {}, format="json").status_code == 404
    too_long = world["member"].client().post(url, {"expires_in": 10**9}, format="json")
    assert too_long.status_code == 400 and "expires_in" in too_long.json()["error"]["details"]
    unknown = world["member"].client().post(url, {"expires_in": 60, "scope": "org"}, format="json")
    assert unknown.status_code == 400 and "scope" in unknown.json()["error"]["details"]


def test_the_token_opens_no_other_route_of_its_thread_project_or_org(world, records, artifact):
    """Every organization route, filled with this artifact's own org, project and thread:
    the token sent as a credential authenticates nothing (401), and the token's own public
    prefix leads nowhere else (404)."""
    made = share(world, f"/api/v1/orgs/acme/artifacts/{artifact.public_id}/share")
    token = made["token"]
    world.project, world.thread = records.project, records.thread  # fill with its own tree
    probes = 0
    for route in org_scoped_routes():
        assert route.name in KWARGS
        url = fill(route, world, "acme")
        for method in route.actions:
            for headers in (
                {"HTTP_AUTHORIZATION": f"Bearer {token}"},
                {"HTTP_X_KESTREL_TOKEN": token},
            ):
                client = anonymous()
                client.credentials(**headers)
                response = getattr(client, method)(url, {}, format="json")
                assert response.status_code == 401, (route.name, method, response.content)
                assert response.json()["error"]["code"] == "not_authenticated"
                probes += 1
            # As a query parameter it is simply an anonymous request.
            response = getattr(anonymous(), method)(f"{url}?token={token}", {}, format="json")
            assert response.status_code == 401, (route.name, method)
            probes += 1
        # The shared prefix leads to no other object: /shared/<token>/<any org route>.
        tail = url.removeprefix("/api/v1/")
        response = anonymous().get(f"/api/v1/shared/{token}/{tail}")
        assert response.status_code == 404, (route.name, response.content)
        probes += 1
    # The link itself still works, and nothing it touched became someone.
    assert anonymous().get(made["url"]).status_code == 200
    assert probes > 3 * len(org_scoped_routes())


def test_share_list_follows_project_visibility(world, records, artifact):
    made = share(world, f"/api/v1/orgs/acme/artifacts/{artifact.public_id}/share")
    owner_ids = [
        s["id"] for s in world["owner"].client().get("/api/v1/orgs/acme/shares").json()["results"]
    ]
    assert made["id"] in owner_ids
    assert "token" not in str(world["owner"].client().get("/api/v1/orgs/acme/shares").json())
    limited = world["limited"].client().get("/api/v1/orgs/acme/shares").json()["results"]
    assert made["id"] not in [s["id"] for s in limited]
    hidden = world["limited"].client().delete(f"/api/v1/orgs/acme/shares/{made['id']}")
    assert hidden.status_code == 404


def test_the_list_shows_how_often_a_link_was_used_and_when_last(world, records, artifact):
    made = share(world, f"/api/v1/orgs/acme/artifacts/{artifact.public_id}/share")

    def listed() -> dict:
        found = world["member"].client().get("/api/v1/orgs/acme/shares").json()["results"]
        return next(s for s in found if s["id"] == made["id"])

    assert (listed()["uses"], listed()["last_used_at"]) == (0, None)
    before = timezone.now()
    assert anonymous().get(made["url"]).status_code == 200
    content = anonymous().get(f"{made['url']}/content")
    assert content.status_code == 200
    b"".join(content.streaming_content)
    assert listed()["uses"] == 2
    assert datetime.fromisoformat(listed()["last_used_at"].replace("Z", "+00:00")) >= before
    # A request the link does not answer is no use of it.
    ShareLink.objects.filter(public_id=made["id"]).update(revoked_at=timezone.now())
    assert anonymous().get(made["url"]).status_code == 404
    assert listed()["uses"] == 2


ANY_PUBLIC_ID = re.compile(r"(?:%s)_[0-9A-Z]{26}" % "|".join(sorted(PREFIXES)))  # noqa: UP031


@pytest.mark.spec("TEN-6")
def test_a_shared_thread_carries_no_person_runner_or_internal_id(world, records):
    owner = world["owner"]
    records.run("shell.exec", {"argv": ["make"]}, shell_result("y" * 40_000))
    records.run("workspace.checkpoint", {}, workspace_archive({"a.txt": "v1\n"}))
    # Free text quoting an id: a tool that prints who asked.
    records.run("shell.exec", {"argv": ["whoami"]}, shell_result(f"{owner.user.public_id}\n"))
    waiting = action_request(
        actor=person(world["member"]), thread=records.thread, tool="code.python", args={"code": "1"}
    )
    approval_decide(actor=person(owner), action=waiting, approve=True)
    assert action_dispatch(action_id=waiting.pk)
    waiting.refresh_from_db()
    report_ingest(
        finished_report(waiting, records.runner, records.key, result=shell_result("ok\n"))
    )
    base = (
        f"/api/v1/orgs/acme/projects/{records.project.public_id}/threads/{records.thread.public_id}"
    )
    # The owner's replay names all of them; the shared one is the same thread with none.
    full = owner.client().get(f"{base}/replay").json()
    full_text = json.dumps(full)
    for present in ("usr_", "run_", "apr_", "rcp_", "art_", "chk_", "act_", "thr_"):
        assert present in full_text
    made = share(world, f"{base}/share")

    opened = anonymous().get(made["url"])
    assert opened.status_code == 200
    assert ANY_PUBLIC_ID.findall(opened.content.decode()) == []
    replay = opened.json()["replay"]
    assert len(replay["events"]) == len(full["events"])
    assert len(replay["actions"]) == len(full["actions"]) == 4
    assert len(replay["receipts"]) == len(full["receipts"]) == 4
    assert replay["artifacts"] and replay["checkpoints"]
    # Actions are referred to by the sequence of their first event, consistently.
    refs = [action["action_ref"] for action in replay["actions"]]
    assert refs == sorted(refs) and all(isinstance(ref, int) for ref in refs)
    by_ref = {event["action_ref"] for event in replay["events"] if event["action_ref"]}
    assert by_ref == set(refs) == {receipt["action_ref"] for receipt in replay["receipts"]}
    assert replay["actions"][-1]["approval"]["decision"] == "approved"
    assert "by" not in replay["actions"][-1]["approval"]
