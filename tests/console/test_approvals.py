"""The approvals pages: the inbox lists exactly what the person could approve, the action
page shows what a decision binds, and a decision is taken only on the action as it was shown."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import dateformat, timezone
from django.utils.html import escape

from kestrel_one.accounts.principal import Principal, PrincipalKind
from kestrel_one.common.errors import KestrelError
from kestrel_one.console import base as console_base
from kestrel_one.console.approvals import action_requester, decision_binding
from kestrel_one.console.base import session_principal
from kestrel_one.execution.approvals import approval_decide
from kestrel_one.execution.models import Action, Approval
from kestrel_one.execution.plans import plan_accept, plan_propose
from kestrel_one.execution.selectors import (
    actions_awaiting_decision,
    actions_visible_to,
    plans_awaiting_acceptance,
)
from kestrel_one.execution.services import action_request
from kestrel_one.threads.services import thread_create, thread_end
from runners.contract.canonical import digest
from tests.api.routes import database_fingerprint

pytestmark = pytest.mark.spec("SURF-3")


def signed_in(user) -> Client:
    client = Client()
    client.force_login(user)  # a sign-in: sudo mode starts with it
    return client


def token_principal(actor) -> Principal:
    return Principal(PrincipalKind.TOKEN, user=actor.user, token=actor.token)


def session_of(actor) -> Principal:
    return Principal(PrincipalKind.SESSION, user=actor.user)


def awaiting(world, *, actor=None, thread=None, argv=("make", "deploy")) -> Action:
    action = action_request(
        actor=actor or world.agent,
        thread=thread or world.thread,
        tool="shell.exec",
        args={"argv": list(argv)},
    )
    assert action.state == "awaiting_approval", action.decision
    return action


class Rollback(Exception):
    pass


def can_approve(principal, action) -> bool:
    """Whether this principal's approval is taken, as the console and the API take it: the
    action found among those it may see, then approval_decide; nothing is left behind."""
    organization = action.organization
    if "actions:approve" not in principal.scopes_in(organization):
        return False
    visible = actions_visible_to(principal=principal, organization=organization)
    if not visible.filter(pk=action.pk).exists():
        return False
    try:
        with transaction.atomic():
            approval_decide(actor=principal, action=action, approve=True)
            raise Rollback
    except Rollback:
        return True
    except KestrelError:
        return False


@pytest.fixture
def mixed(world):
    """Awaiting actions of every kind: the agent's, the member's own token's, an expired
    one, one in an ended thread, one in the project the limited member sees."""
    member = world["member"]
    ended = thread_create(actor=world.agent, project=world.project, title="done", mode="agent")
    in_ended = awaiting(world, thread=ended)
    thread_end(actor=world.agent, thread=ended)
    expired = awaiting(world, argv=("make", "old"))
    Action.objects.filter(pk=expired.pk).update(created_at=timezone.now() - timedelta(days=3))
    hangar = thread_create(actor=world.agent, project=world.other_project, title="h", mode="agent")
    return {
        "agent": world.action,
        "own_token": awaiting(world, actor=token_principal(member), argv=("make", "mine")),
        "expired": expired,
        "ended": in_ended,
        "hangar": awaiting(world, thread=hangar),
    }


def test_the_inbox_lists_exactly_what_each_person_could_approve(world, mixed):
    everything = list(Action.objects.filter(state="awaiting_approval"))
    principals = {
        "member session": session_of(world["member"]),
        "member token": token_principal(world["member"]),
        "limited session": session_of(world["limited"]),
        "owner session": session_of(world["owner"]),
        "viewer session": session_of(world["viewer"]),
        "agent (integration token)": world.agent,
    }
    for name, principal in principals.items():
        listed = set(
            actions_awaiting_decision(principal=principal, organization=world.org).values_list(
                "pk", flat=True
            )
        )
        for action in everything:
            assert can_approve(principal, action) == (action.pk in listed), (name, action.tool)
    member_listed = actions_awaiting_decision(
        principal=session_of(world["member"]), organization=world.org
    )
    assert {a.pk for a in member_listed} == {
        mixed["agent"].pk,
        mixed["own_token"].pk,
        mixed["hangar"].pk,
    }
    # Through the token that asked (its lineage), the member's own request is not theirs.
    token_listed = actions_awaiting_decision(
        principal=token_principal(world["member"]), organization=world.org
    )
    assert mixed["own_token"].pk not in {a.pk for a in token_listed}
    assert not actions_awaiting_decision(principal=world.agent, organization=world.org).exists()


def test_plans_awaiting_acceptance_follow_the_same_person_rules(world):
    member = token_principal(world["member"])
    own = plan_propose(
        actor=member,
        thread=world.plan_thread,
        steps=[{"tool": "fs.read", "args": {"path": "README.md"}}],
    )
    for principal, expected in (
        (session_of(world["member"]), {world.plan.pk, own.pk}),
        (member, {world.plan.pk}),
        (session_of(world["viewer"]), set()),
        (world.agent, set()),
    ):
        listed = plans_awaiting_acceptance(principal=principal, organization=world.org)
        assert {p.pk for p in listed} == expected
    with pytest.raises(KestrelError):
        plan_accept(actor=member, plan=own)


def test_the_nav_count_equals_the_inbox_total(world, mixed):
    for name in ("owner", "member", "limited", "viewer"):
        html = signed_in(world[name].user).get("/console/acme/approvals").content.decode()
        total = actions_awaiting_decision(
            principal=session_of(world[name]), organization=world.org
        ).count()
        assert f'aria-label="{total} waiting">{total}</span>' in html, name
        assert f'Actions awaiting your decision <span class="muted">({total})' in html, name
        for action in Action.objects.filter(state="awaiting_approval"):
            link = f"/console/acme/actions/{action.public_id}"
            assert (link in html) == (
                actions_awaiting_decision(principal=session_of(world[name]), organization=world.org)
                .filter(pk=action.pk)
                .exists()
            ), (name, action.public_id)


def test_an_empty_inbox_says_no_approvals_waiting(world):
    html = signed_in(world["viewer"].user).get("/console/acme/approvals").content.decode()
    assert "No approvals waiting." in html
    assert "does not approve actions" in html
    html = signed_in(world["member"].user).get("/console/acme/approvals").content.decode()
    assert "No approvals waiting." not in html
    assert world.plan.public_id in html  # plans in their own list


def test_the_inbox_costs_the_same_queries_for_3_or_30_actions(world):
    client = signed_in(world["member"].user)

    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            assert client.get("/console/acme/approvals").status_code == 200
        return len(captured)

    for index in range(2):
        awaiting(world, argv=("make", f"a{index}"))
    small = queries()
    member = token_principal(world["member"])
    for index in range(27):
        awaiting(world, actor=member if index % 2 else None, argv=("make", f"b{index}"))
    assert queries() == small


def test_the_inbox_is_paginated_newest_first(world):
    for index in range(55):
        awaiting(world, argv=("make", f"n{index}"))
    client = signed_in(world["member"].user)
    first = client.get("/console/acme/approvals").content.decode()
    newest = actions_awaiting_decision(
        principal=session_of(world["member"]), organization=world.org
    )
    assert first.count('<span class="public-id">act_') == 50
    assert newest[0].public_id in first and world.action.public_id not in first
    second = client.get("/console/acme/approvals?page=2").content.decode()
    assert world.action.public_id in second and "Page 2 of 2" in second


def test_an_inbox_row_shows_the_tool_flags_place_requester_and_time(world):
    """The inbox's rows are made as text in Python (``inbox_row``): each shows what the
    template's own lookups and ``date`` filters showed, escaped."""
    action = awaiting(world, argv=("make", "row"))
    Action.objects.filter(pk=action.pk).update(flags=["role_override", "exfiltration"])
    untitled = thread_create(actor=world.agent, project=world.project, title="", mode="agent")
    bare = awaiting(world, thread=untitled, argv=("make", "bare"))
    world.project.name = "launch<pad>"
    world.project.save(update_fields=["name"])
    html = signed_in(world["member"].user).get("/console/acme/approvals").content.decode()
    prj = world.project.public_id
    for shown, thread, title in ((action, world.thread, world.thread.title), (bare, untitled, "")):
        shown = Action.objects.select_related("requested_by_token__user", "requested_by_user").get(
            pk=shown.pk
        )
        created = timezone.localtime(shown.created_at)
        place = f"launch&lt;pad&gt; / {escape(title or thread.public_id)}"
        assert (
            f'<a href="/console/acme/projects/{prj}/threads/{thread.public_id}">{place}</a>'
        ) in html
        assert f"<td>{escape(action_requester(shown))}</td>" in html
        assert (
            f'<time datetime="{dateformat.format(created, "c")}">'
            f"{dateformat.format(created, 'Y-m-d H:i')} UTC</time>"
        ) in html
        assert f'href="/console/acme/actions/{shown.public_id}">Review' in html
    assert "flagged: role_override, exfiltration" in html
    assert html.count("flagged:") == 1


def test_the_action_page_shows_what_the_decision_binds_and_no_secret(world):
    canary = "sk-live-CANARY0123456789abcdef0123456789"
    action = action_request(
        actor=world.agent,
        thread=world.thread,
        tool="shell.exec",
        args={"argv": ["deploy", "--token", canary], "env": {"API_KEY": canary}},
    )
    assert action.sealed_args  # the exact arguments are kept, sealed
    html = signed_in(world["member"].user).get(f"/console/acme/actions/{action.public_id}")
    assert html.status_code == 200
    page = html.content.decode()
    assert canary not in page and action.sealed_args not in page
    for shown in (action.action_digest, action.args_digest, action.policy_version, "shell.exec"):
        assert shown in page
    for reason in action.decision["reasons"]:
        assert escape(reason) in page
    assert "agent" in page  # who asked: the integration token, by name
    assert 'name="digest" value="' + action.action_digest in page
    assert "&quot;argv&quot;: [" in page  # pretty-printed


def test_approving_values_hidden_from_the_person_needs_a_tick(world):
    """Redaction hides a random-looking run from the approver too, yet the call runs with it:
    the page names each hidden value, and approving says on purpose that the person approves
    what they cannot read. Denying needs no tick."""
    payload = "aGVsbG8gd29ybGQgdGhpcyBpcyBhIHBheWxvYWQ9PXh5ejEyMw0123456789"
    action = action_request(
        actor=world.agent,
        thread=world.thread,
        tool="shell.exec",
        args={"argv": ["sh", "-c", f"echo {payload} | base64 -d | sh"], "env": {"TZ": "UTC"}},
    )
    assert action.state == "awaiting_approval", action.decision
    client = signed_in(world["member"].user)
    url = f"/console/acme/actions/{action.public_id}"
    page = client.get(url).content.decode()
    assert payload not in page
    assert "2 values hidden from you" in page
    assert "<code>argv[2]</code>" in page and "<code>env.TZ</code>" in page
    assert 'name="approve_hidden"' in page
    # The API names the same paths, for whoever approves there.
    shown = (
        world["member"]
        .client()
        .get(
            f"/api/v1/orgs/acme/projects/{world.project.public_id}/threads/"
            f"{world.thread.public_id}/actions/{action.public_id}"
        )
    )
    assert shown.status_code == 200, shown.content
    assert shown.json()["hidden_args"] == ["argv[2]", "env.TZ"]

    refused = client.post(url + "/approve", decision_binding(action))
    assert refused.status_code == 400
    assert "Nothing was approved: 2 value(s) are hidden from you" in refused.content.decode()
    action.refresh_from_db()
    assert action.state == "awaiting_approval"
    assert not Approval.objects.filter(action=action).exists()

    approved = client.post(url + "/approve", {**decision_binding(action), "approve_hidden": "yes"})
    assert approved.status_code == 303
    action.refresh_from_db()
    assert action.state == "queued"


def test_denying_a_call_with_hidden_values_needs_no_tick(world):
    action = awaiting(world, argv=("deploy", "--token", "sk-live-CANARY0123456789abcdef0123456789"))
    client = signed_in(world["member"].user)
    url = f"/console/acme/actions/{action.public_id}"
    assert client.post(url + "/deny", decision_binding(action)).status_code == 303
    action.refresh_from_db()
    assert action.state == "denied"


def test_a_call_without_hidden_values_asks_for_no_tick(world):
    page = signed_in(world["member"].user).get(f"/console/acme/actions/{world.action.public_id}")
    html = page.content.decode()
    assert "hidden from you" not in html and 'name="approve_hidden"' not in html


def test_a_viewer_sees_the_action_without_forms_and_cannot_decide(world):
    client = signed_in(world["viewer"].user)
    page = client.get(f"/console/acme/actions/{world.action.public_id}").content.decode()
    assert world.action.action_digest in page
    assert 'method="post"' not in page.split("</header>", 1)[1]
    before = database_fingerprint()
    refused = client.post(
        f"/console/acme/actions/{world.action.public_id}/approve", decision_binding(world.action)
    )
    assert refused.status_code == 403
    assert database_fingerprint() == before


def test_approving_in_the_console_queues_the_call_as_the_api_does(
    world, django_capture_on_commit_callbacks
):
    client = signed_in(world["member"].user)
    url = f"/console/acme/actions/{world.action.public_id}"
    with django_capture_on_commit_callbacks() as callbacks:
        response = client.post(url + "/approve", {**decision_binding(world.action), "reason": "ok"})
    assert response.status_code == 303 and response["Location"] == url
    # action_dispatch, queued on commit by approval_decide (beside notices and the audit's).
    assert [c for c in callbacks if c.__qualname__.startswith("_decide.")]
    world.action.refresh_from_db()
    assert world.action.state == "queued"
    approval = Approval.objects.get(action=world.action)
    assert (approval.decision, approval.decided_by, approval.decided_by_token) == (
        "approved",
        world["member"].user,
        None,
    )
    assert approval.action_digest == world.action.action_digest and approval.reason == "ok"
    page = client.get(url).content.decode()
    assert "Approved: the action is queued to run." in page
    assert 'action="' + url + '/approve"' not in page  # decided: no forms any more


def test_denying_in_the_console(world):
    client = signed_in(world["member"].user)
    url = f"/console/acme/actions/{world.action.public_id}"
    response = client.post(url + "/deny", {**decision_binding(world.action), "reason": "no"})
    assert response.status_code == 303
    world.action.refresh_from_db()
    assert world.action.state == "denied" and world.action.sealed_args == ""
    assert Approval.objects.get(action=world.action).decision == "denied"


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ("stored_digest", "the action digest: you saw"),
        ("stored_policy_version", "the policy version: you saw env:"),
        ("stored_args_digest", "the arguments (their digest): you saw"),
        ("posted_tool", "the tool: you saw fs.write, it is now shell.exec"),
        ("posted_digest", "the action digest: you saw 000"),
    ],
)
def test_a_decision_on_a_changed_action_is_refused_naming_what_changed(world, change, named):
    client = signed_in(world["member"].user)
    url = f"/console/acme/actions/{world.action.public_id}"
    seen = decision_binding(world.action)  # what the page showed
    if change == "stored_digest":
        Action.objects.filter(pk=world.action.pk).update(action_digest="f" * 64)
    elif change == "stored_policy_version":
        Action.objects.filter(pk=world.action.pk).update(policy_version="env:pol_other")
    elif change == "stored_args_digest":
        Action.objects.filter(pk=world.action.pk).update(args_digest="e" * 64)
    elif change == "posted_tool":
        seen["tool"] = "fs.write"
    elif change == "posted_digest":
        seen["digest"] = "0" * 64
    before = database_fingerprint()
    for verb in ("approve", "deny"):
        response = client.post(f"{url}/{verb}", seen)
        assert response.status_code == 409, verb
        page = response.content.decode()
        assert "Nothing was decided: this action is not the one you saw." in page
        assert named in page, page.split('role="alert"', 1)[-1][:600]
    assert database_fingerprint() == before
    assert not Approval.objects.filter(action=world.action).exists()


def test_a_decision_without_the_digest_is_refused(world):
    client = signed_in(world["member"].user)
    response = client.post(f"/console/acme/actions/{world.action.public_id}/approve", {})
    assert response.status_code == 409
    assert "did not say which action digest you saw" in response.content.decode()
    world.action.refresh_from_db()
    assert world.action.state == "awaiting_approval"


def test_the_requesting_lineage_cannot_approve_through_the_console(world, monkeypatch):
    """The console decides as the signed-in person, and the service's person rules still
    apply to whatever principal it passes: a principal of the requesting token's lineage is
    refused on the page (403) and nothing is decided; an integration token is never a person."""
    member = world["member"]
    own = awaiting(world, actor=token_principal(member), argv=("make", "mine"))
    url = f"/console/acme/actions/{own.public_id}"
    client = signed_in(member.user)
    # The console as the requesting token's lineage would be (a session never carries one).
    monkeypatch.setattr(console_base, "session_principal", lambda request: token_principal(member))
    before = database_fingerprint()
    response = client.post(url + "/approve", decision_binding(own))
    assert response.status_code == 403
    page = response.content.decode()
    assert "Refused (403)." in page and "lineage" in page
    assert database_fingerprint() == before
    # The listing agrees: that lineage is not offered its own request.
    assert own.public_id not in client.get("/console/acme/approvals").content.decode()
    monkeypatch.setattr(console_base, "session_principal", session_principal)
    # Signed in as themselves, the person approves what their agent asked (require_person).
    assert client.post(url + "/approve", decision_binding(own)).status_code == 303
    assert Approval.objects.get(action=own).decided_by_token is None


def test_a_refusal_of_the_service_is_shown_with_its_status(world):
    Action.objects.filter(pk=world.action.pk).update(created_at=timezone.now() - timedelta(days=3))
    client = signed_in(world["member"].user)
    url = f"/console/acme/actions/{world.action.public_id}"
    response = client.post(url + "/approve", decision_binding(world.action))
    assert response.status_code == 409
    page = response.content.decode()
    assert "Refused (409)." in page and "expired" in page
    assert '<span id="action-state" class="badge bad">expired</span>' in page


def test_a_stale_session_is_sent_to_confirm_and_back_to_the_action_page(world):
    client = signed_in(world["member"].user)
    session = client.session
    session.pop("kestrel_sudo_at")
    session.save()
    url = f"/console/acme/actions/{world.action.public_id}"
    response = client.post(url + "/approve", decision_binding(world.action))
    assert response.status_code == 303
    assert response["Location"].startswith("/console/sudo?")
    assert "next=%2Fconsole%2Facme%2Factions%2F" + world.action.public_id in response["Location"]
    assert "approve+or+deny+this+action" in response["Location"]
    world.action.refresh_from_db()
    assert world.action.state == "awaiting_approval"


def test_the_plan_page_shows_every_step_and_accepts(world):
    steps = [
        {"tool": "fs.write", "args": {"path": "src/a.py", "content": "x"}},
        {"tool": "shell.exec", "args": {"argv": ["make", "test"]}, "uses": 3},
    ]
    plan = plan_propose(actor=world.agent, thread=world.plan_thread, steps=steps)
    client = signed_in(world["member"].user)
    url = f"/console/acme/plans/{plan.public_id}"
    page = client.get(url).content.decode()
    for step in plan.steps:
        assert step["tool"] in page and step["args_digest"] in page
    assert "may run 3 times" in page and "src/a.py" in page
    assert "integration token “agent”" in page
    refused = client.post(url + "/accept", {"steps_digest": "0" * 64})
    assert refused.status_code == 409 and "not the ones you saw" in refused.content.decode()
    plan.refresh_from_db()
    assert plan.state == "proposed"
    accepted = client.post(url + "/accept", {"steps_digest": digest(plan.steps)})
    assert accepted.status_code == 303
    plan.refresh_from_db()
    assert (plan.state, plan.accepted_by) == ("accepted", world["member"].user)
    page = client.get(url).content.decode()
    assert "Accepted: its steps may now run." in page and "/accept" not in page
    again = client.post(url + "/accept", {"steps_digest": digest(plan.steps)})
    assert again.status_code == 409 and "only a proposed plan" in again.content.decode()


def test_accepting_a_plan_with_hidden_values_needs_a_tick(world):
    secret_like = "sk-live-CANARY0123456789abcdef0123456789"
    steps = [{"tool": "shell.exec", "args": {"argv": ["deploy", "--token", secret_like]}}]
    plan = plan_propose(actor=world.agent, thread=world.plan_thread, steps=steps)
    client = signed_in(world["member"].user)
    url = f"/console/acme/plans/{plan.public_id}"
    page = client.get(url).content.decode()
    assert secret_like not in page and "<code>step 0: argv[2]</code>" in page
    refused = client.post(url + "/accept", {"steps_digest": digest(plan.steps)})
    assert refused.status_code == 400
    assert "Nothing was accepted: 1 value(s) are hidden" in refused.content.decode()
    plan.refresh_from_db()
    assert plan.state == "proposed"
    accepted = client.post(
        url + "/accept", {"steps_digest": digest(plan.steps), "approve_hidden": "yes"}
    )
    assert accepted.status_code == 303
    plan.refresh_from_db()
    assert plan.state == "accepted"
