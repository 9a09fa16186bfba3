"""The README tour and the docs/api.md walk-through run as written against `manage.py serve`.

Each document's shell blocks are taken verbatim and run by bash, in order, at the top of the
checkout, against a single-host server started as `make run` starts it: no REDIS_URL, a
fresh data folder, the embedded broker and the sandbox it finds.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import requests

from tests.support import ROOT, Server, free_port, single_host_env

pytestmark = pytest.mark.spec("LOCAL-1", "LOCAL-2")

SHELL_BLOCK = re.compile(r"^```sh\n(.*?)^```", re.M | re.S)


def shell_blocks(markdown: str) -> list[str]:
    return SHELL_BLOCK.findall(markdown)


def readme_tour() -> str:
    return shell_blocks(_readme_tour_section())[0]


def _section(document: str, heading: str) -> str:
    """The part of a Markdown file under ``heading``, up to the next heading of its level."""
    text = (ROOT / document).read_text()
    section = text[text.index(heading) :]
    return section[: section.index("\n## ", 1)]


def _readme_tour_section() -> str:
    return _section("README.md", "## A short tour")


def readme_console_pages() -> list[str]:
    """The console pages the tour ends on, as the README names them after its commands."""
    after = SHELL_BLOCK.split(_readme_tour_section(), maxsplit=1)[-1]
    return re.findall(r"`(/console/[^`\s]*)`", after)


# Console pages the README names whose routes come with a part of the console not in this
# checkout yet. The test fails once such a route exists, so the entry cannot outlive it.
def json_documents(output: str) -> list[dict]:
    """Every JSON object curl printed, in order (curl adds no newline between them)."""
    decoder, documents, at = json.JSONDecoder(), [], 0
    while at < len(output):
        if output[at].isspace():
            at += 1
            continue
        document, at = decoder.raw_decode(output, at)
        documents.append(document)
    return documents


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("walkthrough") / "var"
    env = single_host_env(data_dir)
    assert "REDIS_URL" not in env
    port = free_port()
    process = Server(
        env, [sys.executable, "manage.py", "serve", "--port", str(port), "--workers", "1"], port
    )
    try:
        process.wait_ready()
        yield env, port
    finally:
        process.stop()


def run_as_written(script: str, env: dict, port: int) -> list[dict]:
    shell_env = {**env, "PORT": str(port)}
    shell_env.pop("DJANGO_SETTINGS_MODULE", None)  # what a person's shell has: nothing set
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=ROOT,
        env=shell_env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return json_documents(result.stdout)


def test_the_readme_tour_runs_as_written(server):
    env, port = server
    assert os.access(ROOT / ".venv/bin/python", os.X_OK), "the tour uses the checkout's .venv"
    policy, written, refused, approved, finished = run_as_written(readme_tour(), env, port)
    assert policy["version"].startswith("pol_")
    assert written["tool"] == "fs.write" and written["state"] == "succeeded", written
    assert refused["error"]["code"] == "permission_denied"
    assert "local agent" in refused["error"]["message"]
    assert approved["state"] in {"queued", "running", "succeeded"}, approved
    assert finished["state"] == "succeeded", finished
    assert finished["result"]["exit_code"] == 0 and finished["result"]["stdout"] == "hi"
    the_tour_ends_in_the_console(env, port)


def the_tour_ends_in_the_console(env: dict, port: int) -> None:
    """Sign in at /login as the README says (with a password set here, since the one printed
    on the first start went to the server's output), then open the pages it names."""
    password = "a tour password that is long enough"
    setting = subprocess.run(
        [sys.executable, "manage.py", "set_password", "owner@localhost"],
        cwd=ROOT,
        env=env,
        input=password + "\n",
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert setting.returncode == 0, setting.stderr
    base = f"http://127.0.0.1:{port}"
    browser = requests.Session()
    sign_in = browser.get(f"{base}/login", timeout=30)
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', sign_in.text).group(1)
    signed_in = browser.post(
        f"{base}/login",
        data={"email": "owner@localhost", "password": password, "csrfmiddlewaretoken": token},
        timeout=30,
    )
    assert signed_in.status_code == 200 and signed_in.url.endswith("/console/"), signed_in.url
    pages = readme_console_pages()
    assert "/console/local/" in pages, pages
    for path in pages:
        page = browser.get(base + path, timeout=30)
        assert page.status_code == 200, (path, page.status_code)
        if path == "/console/local/":
            assert "website" in page.text
        if path == "/console/local/approvals":
            # The command the tour left for the owner's decision is waiting there.
            assert "shell.exec" in page.text and "No approvals waiting" not in page.text


def test_the_api_walkthrough_runs_as_written(server):
    env, port = server
    script = "\n".join(shell_blocks((ROOT / "docs/api.md").read_text()))
    documents = run_as_written(script, env, port)
    by_state = [d.get("state") for d in documents]
    errors = [d["error"]["code"] for d in documents if d.get("error")]
    # The agent's approval is refused; the thread refuses work once ended; nothing else fails.
    assert errors == ["permission_denied", "thread_ended"], documents
    assert by_state.count("succeeded") >= 3, documents  # the write, the command, the plan step
    command = next(d for d in documents if d.get("tool") == "shell.exec" and d.get("result"))
    assert command["result"]["exit_code"] == 0 and command["result"]["stdout"] == "print(1)\n"
    step = next(d for d in documents if d.get("plan_step") and d.get("state"))
    assert step["state"] == "succeeded" and step["mode"] == "agent", step
    member = next(d for d in documents if "sign_in_link" in d)
    assert f"127.0.0.1:{port}/login/set-password/" in member["sign_in_link"], member
    token = next(d for d in documents if str(d.get("token", "")).startswith("kst_"))
    assert token["scopes"] == ["org:read", "projects:read"]


def mcp_walkthrough() -> str:
    return shell_blocks(_section("docs/mcp.md", "## Try it"))[0]


@pytest.mark.spec("MCP-1", "POL-8")
def test_the_mcp_walkthrough_runs_as_written(server):
    """docs/mcp.md's "Try it": the managed time server installed by a person, its recorded
    tools, and the agent's calls refused, allowed, refused once the tool is marked dangerous,
    and allowed with the opt-in. Needs the Docker sandbox and the managed images."""
    env, port = server
    installed, tools, *rest = run_as_written(mcp_walkthrough(), env, port)
    assert installed["state"] == "ready" and installed["kind"] == "managed", installed
    assert installed["network"]["mode"] == "none", installed
    assert {tool["name"]: tool["dangerous"] for tool in tools} == {
        "convert_time": False,
        "get_current_time": False,
    }
    calls = [document for document in rest if document.get("tool") == "mcp.call"]
    assert [call["state"] for call in calls] == ["denied", "succeeded", "denied", "succeeded"]
    assert "dangerous" in " ".join(calls[2]["decision"]["reasons"]), calls[2]
    for call in (calls[1], calls[3]):
        assert call["result"]["is_error"] is False, call
        assert '"timezone": "UTC"' in call["result"]["content"][0]["text"], call
    marked = next(document for document in rest if document.get("name") == "get_current_time")
    assert marked["dangerous"] is True and marked["marked_dangerous"] is True, marked
