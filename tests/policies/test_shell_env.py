"""shell.exec judges the environment overlay's names: a variable that changes what a program
loads or runs is refused unless the policy grants it by name.

Before, ``{"argv": ["ls"], "env": {"LD_PRELOAD": "/workspace/evil.so"}}`` was judged as
plain ``ls``: the request carried no env, so a policy allowing only ``ls`` ran whatever the
library did. Now the registry puts the overlay's names in the request, a small built-in set
(locale, time zone, terminal) is always allowed, and any other name needs ``env`` in the
shell.exec grant, which meets by intersection like every other list.
"""

from __future__ import annotations

import pytest

from policies import PolicyError, Request, decide, meet, parse_policy, widenings
from runners.contract.registry import get_tool, validate_args

ATTACK = {"argv": ["ls"], "env": {"LD_PRELOAD": "/workspace/evil.so"}}


def shell(**grant) -> object:
    return parse_policy({"capabilities": {"shell.exec": {"commands": ["ls"], **grant}}})


def request_for(args: dict) -> Request:
    return get_tool("shell.exec").capability_request(validate_args("shell.exec", args))


@pytest.mark.spec("POL-1", "POL-6")
def test_the_ld_preload_overlay_is_denied_under_a_policy_allowing_only_ls():
    request = request_for(ATTACK)
    assert request.env_names == ("LD_PRELOAD",)
    decision = decide(shell(), request, version="v")
    assert decision.outcome == "deny"
    (reason,) = decision.reasons
    assert "environment variable 'LD_PRELOAD' may not be set" in reason


@pytest.mark.spec("POL-1")
@pytest.mark.parametrize(
    "name",
    [
        "LD_PRELOAD",
        "LD_LIBRARY_PATH",
        "BASH_ENV",
        "ENV",
        "IFS",
        "PYTHONPATH",
        "PYTHONSTARTUP",
        "PYTHONWARNINGS",
        "GCONV_PATH",
        "NODE_OPTIONS",
        "PERL5OPT",
        "PAGER",
        "GIT_SSH_COMMAND",
    ],
)
def test_variables_that_change_what_runs_are_never_allowed_by_default(name):
    decision = decide(shell(), request_for({"argv": ["ls"], "env": {name: "x"}}), version="v")
    assert decision.outcome == "deny" and f"'{name}'" in decision.reasons[0]


@pytest.mark.spec("POL-1")
def test_locale_time_zone_and_terminal_variables_are_always_allowed():
    args = {"argv": ["ls"], "env": {"LANG": "C.UTF-8", "LC_ALL": "C", "TZ": "UTC", "NO_COLOR": "1"}}
    decision = decide(shell(), request_for(args), version="v")
    assert decision.outcome == "allow", decision.reasons
    assert any("LANG" in reason for reason in decision.reasons)


@pytest.mark.spec("POL-1", "POL-6")
def test_a_grant_names_further_variables_and_only_those():
    policy = shell(env=["APP_MODE", "LD_PRELOAD"])
    allowed = decide(policy, request_for({"argv": ["ls"], "env": {"APP_MODE": "1"}}), version="v")
    assert allowed.outcome == "allow"
    assert decide(policy, request_for(ATTACK), version="v").outcome == "allow"
    other = decide(policy, request_for({"argv": ["ls"], "env": {"DEBUG": "1"}}), version="v")
    assert other.outcome == "deny" and "'DEBUG'" in other.reasons[0]
    assert "APP_MODE" in other.reasons[0], "the denial says what the policy does grant"
    # A program outside the commands and a variable outside env: both reasons are given.
    both = decide(policy, request_for({"argv": ["rm"], "env": {"DEBUG": "1"}}), version="v")
    assert len(both.reasons) == 2


@pytest.mark.spec("POL-2")
def test_env_meets_by_intersection_and_a_project_cannot_widen_it():
    environment = shell(env=["APP_MODE", "APP_DEBUG"])
    project = shell(env=["APP_MODE", "LD_PRELOAD"])
    (found,) = widenings(project, environment, parent_label="environment")
    assert found.path == "capabilities.shell.exec.env[1]"
    assert "'LD_PRELOAD'" in found.message
    effective = meet(environment, project)
    assert decide(effective, request_for(ATTACK), version="v").outcome == "deny"
    assert effective.grant("shell.exec").env == frozenset({"APP_MODE"})
    # Leaving env out grants no further variable: it narrows any environment.
    assert widenings(shell(), environment) == []
    assert meet(environment, shell()).grant("shell.exec").env == frozenset()


def test_env_document_form_is_canonical_and_absent_when_empty():
    assert "env" not in shell().to_document()["capabilities"]["shell.exec"]
    document = shell(env=["B", "A"]).to_document()
    assert document["capabilities"]["shell.exec"]["env"] == ["A", "B"]
    assert parse_policy(document) == shell(env=["A", "B"])


@pytest.mark.parametrize(
    "entries,path,message",
    [
        (["LANG"], "capabilities.shell.exec.env[0]", "always allowed"),
        (["LC_ALL"], "capabilities.shell.exec.env[0]", "always allowed"),
        (["A", "1BAD"], "capabilities.shell.exec.env[1]", "not a valid environment variable"),
        (["A", "A"], "capabilities.shell.exec.env[1]", "repeats [0]"),
        ([], "capabilities.shell.exec.env", "must not be empty"),
    ],
)
def test_bad_env_entries_are_rejected_at_their_path(entries, path, message):
    with pytest.raises(PolicyError) as rejected:
        shell(env=entries)
    assert any(i.path == path and message in i.message for i in rejected.value.issues)
