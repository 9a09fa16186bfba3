"""The registry as people and integrations see it: GET /api/v1/adapters and the console page."""

from __future__ import annotations

import pytest

from kestrel_one.adapters.registry import ADAPTERS
from tests.adapters.conftest import adapter_project


@pytest.mark.spec("CRED-2")
def test_the_api_lists_every_adapter_with_exact_resources_and_effects(world):
    answer = world["viewer"].client().get("/api/v1/adapters")
    assert answer.status_code == 200, answer.content
    listed = {adapter["name"]: adapter for adapter in answer.json()["adapters"]}
    assert set(listed) == set(ADAPTERS)
    github = {op["name"]: op for op in listed["github"]["operations"]}
    assert github["issue_comment.create"]["resource"] == (
        "POST https://api.github.com/repos/{owner}/{repo}/issues/{issue_number}/comments"
    )
    assert github["issue_comment.create"]["effect"] == "external"
    assert github["issue_comment.create"]["requires_approval"] is True
    assert github["issues.list"]["effect"] == "read"
    assert listed["anthropic"]["presentation"] == {"header": "x-api-key", "form": "{secret}"}
    assert listed["slack"]["credential_kind"] == "slack_bot_token"
    # The model providers are the gateway's: listed for their credentials, called by model.invoke.
    assert {name for name, a in listed.items() if a["model_provider"]} == {"openai", "anthropic"}


def test_the_api_listing_needs_a_token(api):
    assert api.get("/api/v1/adapters").status_code in (401, 403)


def test_the_tool_inventory_says_adapter_invoke_runs_in_the_control_tier(world):
    tools = world["viewer"].client().get("/api/v1/tools").json()["tools"]
    by_name = {tool["name"]: tool for tool in tools}
    assert by_name["adapter.invoke"]["tier"] == "control"
    assert by_name["adapter.invoke"]["capability"] == "adapter.invoke"
    assert by_name["shell.exec"]["tier"] == "runner"


@pytest.mark.spec("CRED-5")
def test_the_console_page_shows_which_environment_enables_an_operation(world, client):
    policy = {
        "capabilities": {
            "adapter.invoke": {"adapters": {"slack": {"operations": ["chat.postMessage"]}}}
        }
    }
    adapter_project(world.org, name="chatops", policy=policy)
    client.force_login(world["member"].user)
    page = client.get("/console/acme/adapters")
    assert page.status_code == 200
    html = page.content.decode()
    assert "POST https://slack.com/api/chat.postMessage" in html
    row = html.split("<code>chat.postMessage</code>")[1].split("</tr>")[0]
    assert "chatops" in row and "external" in row
    row = html.split("<code>issue_comment.create</code>")[1].split("</tr>")[0]
    assert "no environment" in row
    client.force_login(world["outsider"].user)
    assert client.get("/console/acme/adapters").status_code == 404
