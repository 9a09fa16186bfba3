"""Where a person reads what an agent asked, did or wrote, they read exactly what is there:
every character a browser draws as nothing or reorders (a right-to-left override, a
zero-width space, a tag character) is shown as ``[U+XXXX]``, on every console page, and
the person who approves, denies or accepts reads what would run. What is stored and what
the API returns keep the raw characters, with the ``hidden_characters`` flag beside them,
and what a form posts back (an input's value, a textarea's text) stays as given, so that
what is judged or saved is what was typed."""

from __future__ import annotations

import json
import re
from html import escape, unescape

import pytest
from django.db import transaction
from django.test import Client

from kestrel_one.accounts.principal import system_principal
from kestrel_one.audit.services import audit_record
from kestrel_one.common.injection import HIDDEN_CHARACTERS, hidden_revealed, is_hidden
from kestrel_one.console.approvals import decision_binding
from kestrel_one.console.base import page_revealed
from kestrel_one.execution.models import Action
from kestrel_one.execution.plans import plan_propose
from kestrel_one.execution.services import action_request
from kestrel_one.governance.drafts import policy_draft_of
from kestrel_one.threads.services import thread_create
from tests.console import surface

pytestmark = pytest.mark.spec("SURF-2", "SURF-3", "API-6", "POL-5")

RLO, ZWSP, TAG_A = "\u202e", "\u200b", "\U000e0041"
# What the approver would read as ``rm -rf ./build`` is ``rm -rf /`` and a reordered tail;
# the path reads as ``docs/a.md`` but is not that file.
ARGV = ["rm", "-rf", f"/{RLO}dliub/.", f"docs/a{ZWSP}.md", f"ok{TAG_A}"]
REVEALED = ["/[U+202E]dliub/.", "docs/a[U+200B].md", "ok[U+E0041]"]


def signed_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def hidden_in(html: str) -> list[str]:
    return sorted({f"U+{ord(char):04X}" for char in html if is_hidden(char)})


def assert_revealed(html: str, *expected: str) -> None:
    assert hidden_in(html) == [], "a character the person cannot see is drawn raw"
    for shown in expected:
        assert shown in html, shown


@pytest.fixture
def hidden(world):
    """An agent's thread, action, result and plan, each with characters nobody can see."""
    thread = thread_create(
        actor=world.agent, project=world.project, title=f"tidy{ZWSP} docs", mode="agent"
    )
    action = action_request(
        actor=world.agent, thread=thread, tool="shell.exec", args={"argv": ARGV}
    )
    assert action.state == "awaiting_approval", action.decision
    ran = action_request(
        actor=world.agent, thread=thread, tool="fs.read", args={"path": f"README{ZWSP}.md"}
    )
    Action.objects.filter(pk=ran.pk).update(state="succeeded", result={"content": f"all {RLO}enod"})
    plan_thread = thread_create(
        actor=world.agent, project=world.project, title=f"plan{RLO}", mode="plan"
    )
    plan = plan_propose(
        actor=world.agent,
        thread=plan_thread,
        steps=[
            {"tool": "shell.exec", "args": {"argv": ARGV}},
            {"tool": "fs.write", "args": {"path": "src/a.py", "content": f"x = 1{RLO}"}},
        ],
    )
    return {
        "thread": thread,
        "action": action,
        "ran": ran,
        "plan": plan,
        "plan_thread": plan_thread,
    }


def test_what_is_stored_and_what_the_api_returns_keep_the_raw_characters(world, hidden):
    action = hidden["action"]
    action.refresh_from_db()
    assert action.args["argv"] == ARGV
    assert HIDDEN_CHARACTERS in action.flags
    shown = (
        world["member"]
        .client()
        .get(
            f"/api/v1/orgs/acme/projects/{world.project.public_id}/threads/"
            f"{hidden['thread'].public_id}/actions/{action.public_id}"
        )
    )
    assert shown.status_code == 200, shown.content
    assert shown.json()["args"]["argv"] == ARGV
    assert HIDDEN_CHARACTERS in shown.json()["flags"]


def test_the_action_page_shows_hidden_characters_revealed(world, hidden):
    action = hidden["action"]
    response = signed_in(world["member"].user).get(f"/console/acme/actions/{action.public_id}")
    assert response.status_code == 200
    html = response.content.decode()
    assert RLO not in html and ZWSP not in html
    assert_revealed(html, *REVEALED, "tidy[U+200B] docs")
    assert "shown as [U+XXXX]" in html  # the page says how it draws them


def test_the_action_status_fragment_shows_the_result_revealed(world, hidden):
    ran = hidden["ran"]
    response = signed_in(world["member"].user).get(
        f"/console/acme/actions/{ran.public_id}", headers={"HX-Request": "true"}
    )
    assert response.status_code == 200
    assert_revealed(response.content.decode(), "all [U+202E]enod")


def test_the_approvals_queue_shows_hidden_characters_revealed(world, hidden):
    html = signed_in(world["member"].user).get("/console/acme/approvals").content.decode()
    assert hidden["action"].public_id in html and hidden["plan"].public_id in html
    assert_revealed(html, "tidy[U+200B] docs", "plan[U+202E]")


def test_the_plan_page_shows_every_step_revealed(world, hidden):
    plan = hidden["plan"]
    html = signed_in(world["member"].user).get(f"/console/acme/plans/{plan.public_id}")
    html = html.content.decode()
    assert RLO not in html
    assert_revealed(html, *REVEALED, "x = 1[U+202E]", "plan[U+202E]", "shown as [U+XXXX]")


def test_the_thread_timeline_and_its_poll_show_hidden_characters_revealed(world, hidden):
    client = signed_in(world["member"].user)
    for thread, expected in (
        (hidden["thread"], [*REVEALED, "all [U+202E]enod", "README[U+200B].md"]),
        (hidden["plan_thread"], [*REVEALED, "x = 1[U+202E]"]),
    ):
        url = f"/console/acme/projects/{world.project.public_id}/threads/{thread.public_id}"
        assert_revealed(client.get(url).content.decode(), *expected)
        poll = client.get(url + "/timeline?after=0", headers={"HX-Request": "true"})
        assert poll.status_code == 200
        assert_revealed(poll.content.decode(), *expected)


def test_the_overview_and_the_project_page_show_titles_revealed(world, hidden):
    client = signed_in(world["member"].user)
    assert_revealed(client.get("/console/acme/").content.decode())
    project = client.get(f"/console/acme/projects/{world.project.public_id}/").content.decode()
    assert_revealed(project, "tidy[U+200B] docs", "plan[U+202E]")


def test_a_refused_decision_shows_the_arguments_revealed_too(world, hidden):
    """The page shown again after a refusal (here: the hidden-values tick missing, or a
    changed binding) is the same page, drawn the same way."""
    action = hidden["action"]
    client = signed_in(world["member"].user)
    refused = client.post(
        f"/console/acme/actions/{action.public_id}/approve",
        {**decision_binding(action), "digest": "0" * 64, "args_digest": "0" * 64},
    )
    assert refused.status_code == 409
    assert_revealed(refused.content.decode(), *REVEALED)


def test_approving_what_was_shown_revealed_binds_the_raw_arguments(world, hidden):
    """Revealing changes only what is drawn: the form still posts the digest of the exact
    arguments, and the call is approved with them."""
    action = hidden["action"]
    client = signed_in(world["member"].user)
    approved = client.post(
        f"/console/acme/actions/{action.public_id}/approve", decision_binding(action)
    )
    assert approved.status_code == 303, approved.content.decode()[:2000]
    action.refresh_from_db()
    assert action.state == "queued" and action.args["argv"] == ARGV


@pytest.mark.parametrize(
    "text",
    [
        "plain <b>ascii</b>\t\r\n &amp; more",
        "launchpad \u203a \u201cbuild\u201d \u2014 \u00e9 \u00df \u6f22\u5b57",
        f"rm -rf /{RLO}dliub/. a{ZWSP}b ok{TAG_A} \x00\x7f \ufe0f\u2066x\u2069 \u00ad",
        "👩\u200d💻 \u2028 \U0010fffd",
    ],
)
def test_a_page_is_revealed_as_hidden_revealed_reveals_a_string(text):
    assert page_revealed(text) == hidden_revealed(text)
    assert hidden_in(page_revealed(text)) == []
    assert page_revealed(page_revealed(text)) == page_revealed(text)


def test_what_a_form_posts_back_is_kept_as_given():
    """An input's value and a textarea's text are what the form sends: revealed there, a
    typed argument or a saved document would come back changed. What is drawn around them
    (an option's text, a title, a label) is revealed."""
    html = (
        f'<input type="search" name="actor" value="usr_{ZWSP}x" title="t{RLO}">'
        f'<textarea id="a" name="args">{{"path": "a{ZWSP}.md"}}</textarea>'
        '<textarea name="b"></textarea>'
        f'<select><option value="p{TAG_A}">n{ZWSP}</option></select>'
        f"<p>value=&quot;a{ZWSP}&quot;</p>"
    )
    assert page_revealed(html) == (
        f'<input type="search" name="actor" value="usr_{ZWSP}x" title="t[U+202E]">'
        f'<textarea id="a" name="args">{{"path": "a{ZWSP}.md"}}</textarea>'
        '<textarea name="b"></textarea>'
        f'<select><option value="p{TAG_A}">n[U+200B]</option></select>'
        "<p>value=&quot;a[U+200B]&quot;</p>"
    )


def test_every_console_page_draws_hidden_characters_revealed(world):
    """Every page shows the organization's name, so one planted there is on all of them:
    no page, however new, is left to remember to reveal (``ConsoleView.drawn``)."""
    world.org.name = f"Acme{ZWSP} Rockets{RLO}"
    world.org.save(update_fields=["name"])
    owner = surface.signed_in(world["owner"].user)
    urls = ["/console/"] + [
        entry.url
        for entry in surface.catalogue_pages(world)
        if not (entry.page.post_only or entry.page.download)
    ]
    raw, unnamed = [], []
    for url in urls:
        response = owner.get(url)
        if not surface.is_html(response):
            continue
        html = surface.body_text(response)
        if hidden_in(html):
            raw.append(url)
        elif "Acme[U+200B] Rockets[U+202E]" not in html:
            unnamed.append(url)
    assert not raw, "drawn with characters nobody can see"
    assert not unnamed, "these pages do not show the organization's name"


# The policy pages: what the preview replays and explain judges is an agent's call.


def policy_url(world, suffix: str = "") -> str:
    return f"/console/acme/projects/{world.project.public_id}/policy{suffix}"


def textarea_text(html: str, name: str) -> str:
    found = re.search(rf'<textarea[^>]* name="{name}"[^>]*>([^<]*)</textarea>', html)
    assert found, f"no {name} textarea"
    return unescape(found.group(1))


def judged(html: str) -> str:
    return html.split('id="explain-result"', 1)[1]


def outside_textareas(html: str) -> str:
    return re.sub(r"<textarea[^>]*>[^<]*</textarea>", "", html)


def test_the_preview_shows_recorded_arguments_and_reasons_revealed(world):
    recorded = action_request(
        actor=world.agent, thread=world.thread, tool="fs.read", args={"path": f"README{ZWSP}.md"}
    )
    owner = signed_in(world["owner"].user)
    narrowing = {"capabilities": {"fs.read": {"paths": ["src/**"]}}}
    assert owner.post(policy_url(world), {"document": json.dumps(narrowing)}).status_code == 303
    for headers in ({}, {"HX-Request": "true"}):
        html = owner.get(policy_url(world, "/preview"), headers=headers).content.decode()
        assert recorded.public_id in html
        assert_revealed(html, "README[U+200B].md", "&#x27;README[U+200B].md&#x27; matches none")


def test_explain_reveals_what_it_judged_and_keeps_the_typed_arguments(world):
    """The arguments go back in the textarea exactly as typed, so explaining again, or
    after a change of mode, judges the same call; what the judgement says is revealed."""
    typed = json.dumps({"path": f"docs/a{ZWSP}.md"}, ensure_ascii=False)
    owner = signed_in(world["owner"].user)
    query = {"tool": "fs.read", "args": typed, "mode": "agent"}
    html = owner.get(policy_url(world, "/explain"), query).content.decode()
    assert f">{escape(typed)}</textarea>" in html
    assert_revealed(outside_textareas(html), "&#x27;docs/a[U+200B].md&#x27; matches")
    assert textarea_text(html, "args") == typed
    again = owner.get(
        policy_url(world, "/explain"), {**query, "args": textarea_text(html, "args")}
    ).content.decode()
    assert judged(again) == judged(html) and "Allowed" in judged(html)
    fragment = owner.get(policy_url(world, "/explain"), query, headers={"HX-Request": "true"})
    assert_revealed(fragment.content.decode(), "&#x27;docs/a[U+200B].md&#x27; matches")


def test_the_policy_editor_reveals_the_draft_it_shows_and_saves_it_as_typed(world):
    document = json.dumps(
        {"capabilities": {"fs.read": {"paths": [f"src{ZWSP}/**"]}}}, indent=2, ensure_ascii=False
    )
    assert ZWSP in document
    owner = signed_in(world["owner"].user)
    assert owner.post(policy_url(world), {"document": document}).status_code == 303
    saved = policy_draft_of(world.project)
    html = owner.get(policy_url(world)).content.decode()
    assert textarea_text(html, "document") == document == saved.text
    assert_revealed(outside_textareas(html), "src[U+200B]/**")
    # Saving what the editor holds saves the same draft.
    owner.post(policy_url(world), {"document": textarea_text(html, "document")})
    assert policy_draft_of(world.project).sha256 == saved.sha256


def test_the_audit_log_shows_record_data_revealed_and_keeps_the_typed_filters(world):
    with transaction.atomic():
        audit_record(
            organization=world.org,
            actor=system_principal("tests"),
            action="test.note",
            data={"title": f"tidy{ZWSP} docs", "argv": ARGV, "name": "caf\u00e9"},
        )
    owner = signed_in(world["owner"].user)
    html = owner.get("/console/acme/audit?action=test.note").content.decode()
    assert "test.note" in html
    assert_revealed(html, "tidy[U+200B] docs", *REVEALED, "café")
    typed = owner.get(f"/console/acme/audit?action=test.note{ZWSP}").content.decode()
    assert f'value="test.note{ZWSP}"' in typed
    assert "No audit records match these filters." in typed
