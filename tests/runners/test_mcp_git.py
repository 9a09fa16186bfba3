"""The managed git server runs no program a repository's configuration names.

The workspace is the agent's to write, .git/config and .git/hooks included, and git runs
programs some configuration keys name. The image (deploy/images/mcp-servers/git) turns off
what can be turned off by name (hooks, fsmonitor, transports) and its launcher runs git only
in a repository whose configuration sets none but a short list of keys that name no program
(so not filter, diff and merge drivers, whose names the repository chooses). These tests set
every such trap in a real repository, show that the image's own git and GitPython spring
them without those guards, and that the server, started and called by the runner's session
code, springs none.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import anyio
import docker
import pytest

from runners.contract.mcp import DEFAULT_LIMITS, MANAGED_SERVERS, tool_definition_digest
from runners.mcp.session import call_pinned, list_tools, server_session
from runners.sandbox.docker import LABEL_PREFIX
from runners.workspace import workspace_for, workspace_owner

pytestmark = [pytest.mark.docker, pytest.mark.spec("MCP-1")]

REPO = Path(__file__).resolve().parents[2]
SERVER = "mcp_01ARZ3NDEKTSV4RRFFQ69G5FAV"
# Every hook git or GitPython runs for the server's tools used here.
HOOKS = (
    "pre-commit",
    "commit-msg",
    "post-commit",
    "post-index-change",
    "post-checkout",
)
# Run in the git image as the workspace's owner, in /workspace: repositories whose
# configuration and hooks make each program they run leave /workspace/marker-<what>.
# "repo" has the hooks, a staged change (for git_commit) and a branch "other" (for
# git_checkout), and no configuration of its own; "lazy" is a partial clone missing a blob
# its modified file needs, whose promisor remote is an ext:: command; "drivers" has
# core.fsmonitor, a filter and a diff driver for a.txt (.gitattributes), diff.external for
# the rest, and an included file defining another filter, with a.txt and b.dat modified.
TRAPS = r"""
set -eu
cd /workspace
git init -q repo
cd repo
echo one > a.txt
git add a.txt
git commit -qm one
git branch other
echo two >> a.txt
git add a.txt
for hook in $HOOKS; do
  printf '#!/bin/sh\ntouch /workspace/marker-%s\n' "$hook" > .git/hooks/$hook
  chmod 0755 .git/hooks/$hook
done
cd /workspace
git init -q lazy
cd lazy
echo one > b.txt
git add b.txt
git commit -qm one
blob=$(git rev-parse HEAD:b.txt)
rm -f .git/objects/$(echo "$blob" | cut -c1-2)/$(echo "$blob" | cut -c3-)
git config core.repositoryformatversion 1
git config extensions.partialClone origin
git config remote.origin.promisor true
git config remote.origin.url 'ext::sh -c touch% /workspace/marker-lazy-fetch'
git config protocol.ext.allow always
echo two >> b.txt
cd /workspace
git init -q drivers
cd drivers
echo 'a.txt filter=trap diff=trap' > .gitattributes
echo one > a.txt
echo one > b.dat
git add .gitattributes a.txt b.dat
git commit -qm one
printf '#!/bin/sh\ntouch /workspace/marker-fsmonitor\n' > /workspace/fsmonitor.sh
chmod 0755 /workspace/fsmonitor.sh
git config core.fsmonitor /workspace/fsmonitor.sh
git config filter.trap.clean 'touch /workspace/marker-filter; cat'
git config filter.trap.smudge 'touch /workspace/marker-filter; cat'
git config diff.trap.command 'touch /workspace/marker-diff-command #'
git config diff.external 'touch /workspace/marker-diff-external #'
printf '[filter "included"]\n\tclean = touch /workspace/marker-included\n' > /workspace/extra.cfg
git config include.path /workspace/extra.cfg
echo two >> a.txt
echo two >> b.dat
cd /workspace
git init -q nested
cd nested
git init -q sub
echo one > sub/f.txt
echo 'f.txt filter=nested' > sub/.gitattributes
git -C sub add f.txt .gitattributes
git -C sub commit -qm one
printf '[submodule "sub"]\n\tpath = sub\n\tignore = none\n' > .gitmodules
git add sub .gitmodules
git commit -qm one
git -C sub config filter.nested.clean 'touch /workspace/marker-nested-filter; cat'
sleep 1
echo uno > sub/f.txt
"""
# What the git image's own git springs with its environment's overrides: the drivers.
GUARDED = r"""
git -C /workspace/drivers status >/dev/null
git -C /workspace/drivers diff >/dev/null
git -C /workspace/lazy diff >/dev/null 2>&1 || true
git -C /workspace/nested status >/dev/null
"""
# The tools' work by the image's git and GitPython without the image's overrides.
UNGUARDED = r"""
git -C /workspace/drivers status >/dev/null
git -C /workspace/repo status >/dev/null
git -C /workspace/lazy diff >/dev/null 2>&1 || true
git -C /workspace/repo checkout -q other
/opt/mcp/bin/python -c 'import git; git.Repo("/workspace/repo").index.commit("c")'
"""


@pytest.fixture(scope="module")
def git_image() -> str:
    """The managed git image's id, (re)built by its script when out of date (quick if not)."""
    built = subprocess.run(
        ["bash", str(REPO / "deploy/images/mcp-servers/build.sh")],
        env={**os.environ, "KESTREL_MCP_IMAGES": "git"},
        capture_output=True,
        text=True,
        check=False,
    )
    if built.returncode != 0:
        pytest.fail(f"the git image does not build: {built.stderr[-2000:]}", pytrace=False)
    client = docker.from_env()
    try:
        return str(client.images.get(MANAGED_SERVERS["git"]["image"]).id)
    finally:
        client.close()


def in_git_image(
    engine: Any, image: str, workspace: Path, script: str, project: str, *, guarded: bool = True
) -> None:
    """Run ``script`` with sh in the git image on ``workspace`` as its owner; ``guarded``
    False without the image's git overrides."""
    uid, gid = workspace_owner()
    unguard = [] if guarded else ["env", "-u", "GIT_CONFIG_COUNT", "-u", "GIT_ALLOW_PROTOCOL"]
    engine.containers.run(
        image,
        [*unguard, "sh", "-c", script],
        entrypoint=[],
        user=f"{uid}:{gid}",
        environment={"HOOKS": " ".join(HOOKS)},
        network_mode="none",
        volumes={str(workspace): {"bind": "/workspace", "mode": "rw"}},
        labels={f"{LABEL_PREFIX}project": project},
        remove=True,
    )


def markers(workspace: Path) -> set[str]:
    return {path.name.removeprefix("marker-") for path in workspace.glob("marker-*")}


def test_a_repositorys_own_config_runs_nothing_through_the_git_server(
    git_image: str, engine: Any, workspace_root: Path, project: str
) -> None:
    # The traps are live. With the image's environment, git still springs the drivers, whose
    # names no override can know; without it, it also springs fsmonitor, the lazy fetch and
    # the hooks, and GitPython the commit hooks.
    guarded = workspace_for(workspace_root, f"{project}-guarded")
    in_git_image(engine, git_image, guarded, TRAPS, project)
    in_git_image(engine, git_image, guarded, GUARDED, project)
    assert markers(guarded) == {"filter", "diff-command", "diff-external", "nested-filter"}
    control = workspace_for(workspace_root, f"{project}-control")
    in_git_image(engine, git_image, control, TRAPS, project)
    in_git_image(engine, git_image, control, UNGUARDED, project, guarded=False)
    assert {"fsmonitor", "lazy-fetch", *HOOKS} <= markers(control)

    workspace = workspace_for(workspace_root, project)
    in_git_image(engine, git_image, workspace, TRAPS, project)
    profile = {
        "server": SERVER,
        "reference": MANAGED_SERVERS["git"]["image"],
        "image": git_image,
        "command": list(MANAGED_SERVERS["git"]["command"]),
        "workspace": MANAGED_SERVERS["git"]["workspace"],
        "network": "none",
        "risk_acceptance": None,
        "limits": dict(DEFAULT_LIMITS),
    }
    calls = [
        ("git_status", {"repo_path": "/workspace/repo"}),
        ("git_commit", {"repo_path": "/workspace/repo", "message": "two"}),
        ("git_checkout", {"repo_path": "/workspace/repo", "branch_name": "other"}),
        ("git_status", {"repo_path": "/workspace/repo"}),
        ("git_diff_unstaged", {"repo_path": "/workspace/lazy"}),
        ("git_status", {"repo_path": "/workspace/drivers"}),
        ("git_diff_unstaged", {"repo_path": "/workspace/drivers"}),
        ("git_add", {"repo_path": "/workspace/drivers", "files": ["a.txt"]}),
        ("git_checkout", {"repo_path": "/workspace/drivers", "branch_name": "main"}),
        ("git_status", {"repo_path": "/workspace/nested"}),
        ("git_diff_unstaged", {"repo_path": "/workspace/nested"}),
    ]

    async def through_the_session() -> list[dict[str, Any]]:
        async with server_session(
            engine, profile, labels={"project": project}, workspace=workspace
        ) as (session, _init, _container):
            tools = {tool["name"]: tool for tool in await list_tools(session, timeout_s=60)}
            answers = []
            for name, arguments in calls:
                pinned = {"profile": profile, "tool_sha256": tool_definition_digest(tools[name])}
                answers.append(await call_pinned(session, pinned, name, arguments, timeout_s=60))
            return answers

    answers = anyio.run(through_the_session)
    assert markers(workspace) == set()
    texts = [answer["content"][0]["text"] for answer in answers]
    # A repository without configuration of its own: every tool works, and runs no hook.
    assert not any(answer["is_error"] for answer in answers[:4]), texts[:4]
    assert "a.txt" in texts[0]
    assert texts[1].startswith("Changes committed successfully")
    assert texts[2] == "Switched to branch 'other'"
    # A repository that names programs, or fetches: git does not run in it at all, and the
    # refusal names the keys (those of an included file as well) and what to do.
    lazy, *drivers = answers[4:9]
    assert lazy["is_error"] is True
    assert "extensions.partialclone" in texts[4]
    assert "protocol.ext.allow" in texts[4]
    for answer, text in zip(drivers, texts[5:9], strict=True):
        assert answer["is_error"] is True, text
        assert (
            "sets core.fsmonitor, filter.trap.clean, filter.trap.smudge, diff.trap.command, "
            "diff.external, include.path, filter.included.clean, which"
        ) in text
        assert "Remove those keys from .git/config" in text
    # Nothing was staged or checked out in the refused repository.
    assert (workspace / "drivers" / "a.txt").read_text() == "one\ntwo\n"
    # A submodule's own configuration, which git would read and run in it, is never
    # reached: a repository with one is refused, naming it and what to do.
    for answer, text in zip(answers[9:], texts[9:], strict=True):
        assert answer["is_error"] is True, text
        assert "this repository has submodules (sub)" in text
        assert "git rm --cached PATH" in text
