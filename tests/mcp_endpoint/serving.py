"""A real ``manage.py serve`` with a Project to serve over MCP, the people and agents around
it, and the console as a person uses it (sign in at /login, press Approve).

Shared by the conformance run and the real-client tests; each starts its own serve.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urljoin

import requests

from tests.single_host.support import Serve, short_data_dir

ROOT = Path(__file__).resolve().parents[2]
NODE_BIN = ROOT / "node_modules" / ".bin"

# What the Environment allows; the Project narrows it (approval on fs.write).
ENVIRONMENT_POLICY = {
    "capabilities": {
        "fs.read": {"paths": ["**"]},
        "fs.write": {"paths": ["notes/**"]},
        "shell.exec": {"approval": "never", "limits": {"timeout_s": 60}},
    }
}
PROJECT_POLICY = {
    "capabilities": {
        "fs.read": {"paths": ["**"]},
        "fs.write": {"paths": ["notes/**"], "approval": "always"},
        "shell.exec": {"approval": "never", "limits": {"timeout_s": 60}},
    }
}


def npm_tool(name: str) -> Path:
    """A command from package-lock.json's packages (``make test`` installs them); fails,
    never skips, when it is missing."""
    path = NODE_BIN / name
    assert shutil.which("node"), "node is missing (Debian's nodejs package)"
    assert path.exists(), f"{path} is missing: run `make browser` (npm ci from package-lock.json)"
    return path


def _node_env() -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith("npm_")}
    env["NO_COLOR"] = "1"
    return env


def npx(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``npx --no-install``: only what node_modules holds, never a download at run time."""
    assert shutil.which("npx"), "npx is missing (Debian's npm package)"
    return subprocess.run(
        ["npx", "--no-install", *args],
        cwd=ROOT,
        env=_node_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def inspector_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """The MCP Inspector's CLI (``@modelcontextprotocol/inspector-cli``) from node_modules.

    Run from its own ``build`` folder: 1.0.3 looks for its package.json (its client name and
    version) at ``../package.json`` relative to the working directory, and otherwise at a
    path that exists only inside the ``@modelcontextprotocol/inspector`` package.
    """
    program = npm_tool("mcp-inspector-cli")
    build = ROOT / "node_modules" / "@modelcontextprotocol" / "inspector-cli" / "build"
    return subprocess.run(
        [str(program), *args],
        cwd=build,
        env=_node_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@dataclass
class Stack:
    """The serve, the owner (a person: token and password), the agent token, one Project."""

    serve: Serve
    agent: str
    person: str
    password: str
    project: str = ""
    environment: str = ""
    console: requests.Session | None = field(default=None, repr=False)

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self.serve.port}"

    def endpoint(self, query: str = "") -> str:
        url = f"{self.serve.base}/orgs/local/projects/{self.project}/mcp"
        return f"{url}?{query}" if query else url

    def call(self, method: str, path: str, body=None, *, expect: int = 200, person=True):
        response = requests.request(
            method,
            f"{self.serve.base}{path}",
            json=body,
            timeout=120,
            headers={"Authorization": f"Bearer {self.person if person else self.agent}"},
        )
        assert response.status_code == expect, (response.status_code, response.text[:2000])
        return response.json()


def stack_start(log_dir: Path, *, calls: bool, **env: str) -> Stack:
    """Serve on a fresh data folder; an Environment and a Project with the policies above.

    ``calls``: wait until the broker and the runner answer (tool calls can run), not only
    until the web server does.
    """
    serve = Serve(short_data_dir(), log_dir=log_dir, **env)
    serve.start()
    try:
        serve.wait_until_calls_can_run() if calls else serve.wait_until_answering()
        agent = re.search(r"Agent token: (kst_\S+)", serve.output)
        password = re.search(r"as owner@localhost\s+password (\S+)", serve.output)
        assert agent and password, serve.output[-4000:]
        stack = Stack(serve, agent.group(1), serve.owner_token(), password.group(1))
        stack.environment = stack.call(
            "POST", "/orgs/local/environments", {"name": "mcp-clients"}, expect=201
        )["id"]
        environment_policy = f"/orgs/local/environments/{stack.environment}/policy"
        stack.call("PUT", environment_policy, ENVIRONMENT_POLICY)
        stack.project = stack.call(
            "POST",
            "/orgs/local/projects",
            {"name": "mcp-clients", "environment": stack.environment},
            expect=201,
        )["id"]
        stack.call("PUT", f"/orgs/local/projects/{stack.project}/policy", PROJECT_POLICY)
        return stack
    except BaseException:
        print(serve.stop()[-6000:])
        raise


# --- the console, as a person uses it --------------------------------------------------


class _Forms(HTMLParser):
    """Every form of a page: its action and the values of its named inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.forms: list[tuple[str, dict[str, str]]] = []
        self._open: tuple[str, dict[str, str]] | None = None

    def handle_starttag(self, tag, attrs):
        values = dict(attrs)
        if tag == "form":
            self._open = (values.get("action") or "", {})
        elif tag == "input" and self._open is not None and values.get("name"):
            self._open[1][values["name"]] = values.get("value") or ""

    def handle_endtag(self, tag):
        if tag == "form" and self._open is not None:
            self.forms.append(self._open)
            self._open = None


def forms_of(html: str) -> list[tuple[str, dict[str, str]]]:
    parser = _Forms()
    parser.feed(html)
    return parser.forms


def console_sign_in(stack: Stack) -> requests.Session:
    """The owner signs in at /login with the password serve printed on its first start."""
    if stack.console is not None:
        return stack.console
    browser = requests.Session()
    page = browser.get(f"{stack.origin}/login", timeout=60)
    assert page.status_code == 200, page.status_code
    (fields,) = [values for action, values in forms_of(page.text) if "password" in values]
    fields.pop("server_token", None)  # the other way in; the password is the person's own
    fields.update(email="owner@localhost", password=stack.password)
    signed_in = browser.post(f"{stack.origin}/login", data=fields, timeout=60)
    assert signed_in.status_code == 200 and signed_in.url.endswith("/console/"), signed_in.url
    stack.console = browser
    return browser


def console_approve(stack: Stack, approval_url: str) -> None:
    """Open the page the MCP result links and press Approve (the form posts back exactly
    what the page showed: digest, tool, arguments' digest, policy version, scope)."""
    browser = console_sign_in(stack)
    page = browser.get(approval_url, timeout=60)
    assert page.status_code == 200, (page.status_code, page.text[:2000])
    (approve,) = [(a, v) for a, v in forms_of(page.text) if a.endswith("/approve")]
    action, fields = approve
    assert "csrfmiddlewaretoken" in fields and fields.get("digest"), fields
    fields["reason"] = "looked at it; fine"
    decided = browser.post(urljoin(approval_url, action), data=fields, timeout=60)
    assert decided.status_code == 200, (decided.status_code, decided.text[:2000])
    assert "Approved: the action is queued to run." in decided.text, decided.text[:2000]
