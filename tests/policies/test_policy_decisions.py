"""decide, widenings, modes and masks on hand-written policies, with readable reasons."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings

from policies import (
    Mode,
    Policy,
    Request,
    apply_mode,
    decide,
    meet,
    meet_all,
    mode_denial_reason,
    mode_mask,
    parse_policy,
    render_decision,
    resolve_mode,
    widenings,
)
from policies.globs import PathSet, parse_pattern

from .strategies import policies, requests

ENVIRONMENT = parse_policy(
    {
        "capabilities": {
            "fs.read": {"paths": ["**"]},
            "fs.write": {"paths": ["src/**", "out/**"]},
            "shell.exec": {
                "approval": "always",
                "commands": ["git", "make"],
                "limits": {
                    "timeout_s": 60,
                    "memory_mb": 512,
                    "cpus": 1,
                    "pids": 128,
                    "output_kb": 256,
                },
            },
            "code.exec": {"limits": {"timeout_s": 30}},
            "net.http": {"allow": ["https://api.github.com:443"]},
            "model.invoke": {"models": ["claude-3"]},
            "mcp.call": {
                "servers": {"github": {"tools": ["search", "merge"], "dangerous": ["merge"]}}
            },
            "adapter.invoke": {"adapters": {"s3": {"operations": ["get"]}}},
        }
    }
)
WRITE_AND_EXECUTE = ("fs.write", "shell.exec", "code.exec", "mcp.call", "adapter.invoke")


def judge(request: Request, policy: Policy = ENVIRONMENT):
    return decide(policy, request, version="pol_1")


@pytest.mark.spec("POL-6")
def test_allowed_write_names_the_matching_pattern_and_version():
    decision = judge(Request("fs.write", paths=("src/app.py",)))
    assert decision.outcome == "allow"
    assert decision.policy_version == "pol_1"
    assert decision.reasons == (
        "fs.write is granted by the effective policy",
        "path 'src/app.py' matches 'src/**'",
    )


@pytest.mark.spec("POL-6")
def test_write_outside_the_patterns_is_denied_with_the_path():
    decision = judge(Request("fs.write", paths=("src/ok.py", "etc/passwd")))
    assert decision.outcome == "deny"
    assert decision.reasons == ("path 'etc/passwd' matches none of ['out/**', 'src/**']",)


@pytest.mark.parametrize("path", ["/etc/passwd", "src/../etc", "src//a", "src\\a", ""])
def test_non_canonical_paths_are_denied(path):
    assert judge(Request("fs.write", paths=(path,))).outcome == "deny"


def test_globstar_matches_the_directory_itself_and_the_root():
    assert judge(Request("fs.write", paths=("src",))).outcome == "allow"
    assert judge(Request("fs.read", paths=(".",))).outcome == "allow"
    assert judge(Request("fs.write", paths=(".",))).outcome == "deny"


def test_star_matches_exactly_one_segment():
    policy = parse_policy({"capabilities": {"fs.read": {"paths": ["docs/*"]}}})
    assert judge(Request("fs.read", paths=("docs/a.md",)), policy).outcome == "allow"
    assert judge(Request("fs.read", paths=("docs",)), policy).outcome == "deny"
    assert judge(Request("fs.read", paths=("docs/a/b.md",)), policy).outcome == "deny"


@pytest.mark.spec("POL-6")
def test_unknown_and_missing_capabilities_fail_closed():
    assert judge(Request("fs.delete", paths=("src/a",))).reasons == (
        "unknown capability 'fs.delete'; unknown capabilities are always denied",
    )
    decision = judge(Request("fs.write", paths=("src/a",)), Policy.deny_all())
    assert decision.reasons == ("fs.write is not granted by the effective policy",)


@pytest.mark.spec("POL-1", "POL-6")
def test_shell_needs_approval_and_reports_clamped_limits():
    decision = judge(Request("shell.exec", command="git", limits={"timeout_s": 10}))
    assert decision.outcome == "needs_approval"
    assert dict(decision.limits) == {
        "timeout_s": 10,
        "memory_mb": 512,
        "cpus": 1,
        "pids": 128,
        "output_kb": 256,
    }
    assert "shell.exec requires a person's approval for every use" in decision.reasons


@pytest.mark.spec("POL-1", "POL-6")
def test_limit_above_the_ceiling_is_denied():
    decision = judge(Request("shell.exec", command="git", limits={"timeout_s": 120}))
    assert decision.outcome == "deny"
    assert decision.reasons == ("requested timeout_s 120 exceeds the ceiling 60",)
    assert dict(decision.limits) == {}
    # An integer with no float form is just as much above it.
    huge = judge(Request("shell.exec", command="git", limits={"timeout_s": 10**400}))
    assert huge.outcome == "deny" and "exceeds the ceiling 60" in huge.reasons[0]


def test_program_outside_the_allowlist_is_denied():
    decision = judge(Request("shell.exec", command="/usr/bin/git"))
    assert decision.reasons == (
        "program '/usr/bin/git' is not in the allowed commands ['git', 'make']",
    )


def test_limits_on_a_capability_without_limits_are_denied():
    decision = judge(Request("net.http", url="https://api.github.com/", limits={"timeout_s": 5}))
    assert decision.outcome == "deny"


@pytest.mark.parametrize(
    ("url", "outcome"),
    [
        ("https://api.github.com/repos/x", "allow"),
        ("https://API.GitHub.com:443/", "allow"),
        ("https://api.github.com:8443/", "deny"),
        ("http://api.github.com/", "deny"),
        ("https://user@api.github.com/", "deny"),
        ("https://api.github.com.evil.example/", "deny"),
        ("ftp://api.github.com/", "deny"),
        ("https://[::1/", "deny"),
    ],
)
def test_net_http_matches_exact_origins(url, outcome):
    assert judge(Request("net.http", url=url)).outcome == outcome


@pytest.mark.spec("POL-8")
def test_dangerous_mcp_tool_needs_its_explicit_opt_in():
    assert judge(
        Request("mcp.call", mcp_server="github", mcp_tool="merge", mcp_dangerous=True)
    ).allowed
    assert judge(Request("mcp.call", mcp_server="github", mcp_tool="search")).allowed
    refused = judge(Request("mcp.call", mcp_server="github", mcp_tool="search", mcp_dangerous=True))
    assert refused.reasons == (
        "tool 'search' on 'github' is marked dangerous and has no explicit opt-in",
    )
    assert not judge(Request("mcp.call", mcp_server="jira", mcp_tool="search")).allowed


def test_adapters_and_models_are_exact():
    assert judge(Request("adapter.invoke", adapter="s3", operation="get")).allowed
    assert not judge(Request("adapter.invoke", adapter="s3", operation="put")).allowed
    assert judge(Request("model.invoke", model="claude-3")).allowed
    assert not judge(Request("model.invoke", model="claude-4")).allowed


def test_render_decision_is_readable():
    text = render_decision(judge(Request("fs.write", paths=("etc/x",))))
    assert (
        text
        == "deny: fs.write (policy pol_1)\n  - path 'etc/x' matches none of ['out/**', 'src/**']"
    )


@pytest.mark.spec("POL-2")
def test_widenings_name_each_place_as_written():
    project = parse_policy(
        {
            "capabilities": {
                "fs.write": {"paths": ["src/app/**", "etc/**"]},
                "net.http": {"allow": ["https://api.github.com:443", "https://evil.example:443"]},
                "shell.exec": {
                    "approval": "always",
                    "commands": ["git"],
                    "limits": {"timeout_s": 90},
                },
                "mcp.call": {
                    "servers": {"github": {"tools": ["search", "delete"]}, "jira": {"tools": ["x"]}}
                },
            }
        }
    )
    found = {w.path: w.message for w in widenings(project, ENVIRONMENT, parent_label="environment")}
    default = "(the platform default, as the document leaves it out)"
    limits = "capabilities.shell.exec.limits"
    assert found == {
        "capabilities.fs.write.paths[1]": "fs.write path 'etc/**' is not within "
        "the environment's ['out/**', 'src/**']",
        "capabilities.net.http.allow[1]": "net.http origin 'https://evil.example:443' is not in "
        "the environment's ['https://api.github.com:443']",
        f"{limits}.timeout_s": "shell.exec timeout_s ceiling 90 is above the environment's 60",
        f"{limits}.memory_mb": f"shell.exec memory_mb ceiling 2048 {default} "
        "is above the environment's 512",
        f"{limits}.cpus": f"shell.exec cpus ceiling 2 {default} is above the environment's 1",
        f"{limits}.pids": f"shell.exec pids ceiling 256 {default} is above the environment's 128",
        f"{limits}.output_kb": f"shell.exec output_kb ceiling 1024 {default} "
        "is above the environment's 256",
        "capabilities.mcp.call.servers.github.tools[1]": "mcp.call tool 'delete' on server "
        "'github' is not in the environment's ['merge', 'search']",
        "capabilities.mcp.call.servers.jira": "mcp.call server 'jira' is not granted "
        "by the environment",
    }


@pytest.mark.spec("POL-2")
def test_capability_the_parent_lacks_and_looser_approval_are_widenings():
    parent = parse_policy({"capabilities": {"fs.read": {"paths": ["**"], "approval": "always"}}})
    child = parse_policy({"capabilities": {"fs.read": {"paths": ["src/**"]}, "code.exec": {}}})
    assert [w.path for w in widenings(child, parent)] == [
        "capabilities.code.exec",
        "capabilities.fs.read.approval",
    ]


@pytest.mark.spec("POL-2")
def test_narrower_project_has_no_widenings_and_is_its_own_meet():
    project = parse_policy(
        {"capabilities": {"fs.write": {"paths": ["src/a/*"]}, "fs.read": {"paths": ["src/**"]}}}
    )
    assert widenings(project, ENVIRONMENT) == []
    assert meet(project, ENVIRONMENT) == project


def test_glob_meet_examples():
    def paths(*texts):
        return PathSet(parse_pattern(text) for text in texts)

    assert paths("src/**").intersect(paths("src/a/*")) == paths("src/a/*")
    assert paths("**").intersect(paths("a/*", "b/**")) == paths("a/*", "b/**")
    assert paths("*/x/**").intersect(paths("a/*")) == paths("a/x")
    assert paths("src", "src/*/**") == paths("src/**")
    assert paths("src/*").intersect(paths("docs/**")) == paths()


def test_policies_are_hashable_and_compare_by_meaning():
    one = parse_policy(
        {"capabilities": {"fs.read": {"paths": ["src", "src/*/**"]}, "code.exec": {}}}
    )
    two = parse_policy(
        {
            "capabilities": {
                "fs.read": {"paths": ["src/**"]},
                "code.exec": {"limits": {"timeout_s": 300}},
            }
        }
    )
    assert one == two and len({one, two}) == 1


def test_a_mask_has_no_document_form_but_its_meet_with_a_document_does():
    mask = Policy.allowing({"net.http", "fs.read"})
    with pytest.raises(ValueError, match="no document form"):
        mask.to_document()
    effective = meet_all(ENVIRONMENT, mask)
    assert parse_policy(effective.to_document()) == effective
    assert effective.capabilities == {"net.http", "fs.read"}
    assert meet(ENVIRONMENT, Policy.allowing(ENVIRONMENT.capabilities)) == ENVIRONMENT


def test_auto_resolves_to_ask_or_plan_never_agent():
    assert resolve_mode(Mode.AUTO, wants_plan=True) is Mode.PLAN
    assert resolve_mode(Mode.AUTO, wants_plan=False) is Mode.ASK
    assert resolve_mode(Mode.AGENT, wants_plan=True) is Mode.AGENT


@pytest.mark.spec("POL-4")
def test_read_only_modes_keep_read_and_network_capabilities_only():
    for mode in (Mode.ASK, Mode.PLAN, Mode.AUTO):
        assert apply_mode(ENVIRONMENT, mode).capabilities == {"fs.read", "net.http", "model.invoke"}
    assert apply_mode(ENVIRONMENT, Mode.AGENT) == ENVIRONMENT


@pytest.mark.spec("POL-4")
@settings(max_examples=1000, deadline=None)
@given(policies, requests(capabilities=WRITE_AND_EXECUTE))
def test_ask_plan_and_auto_never_allow_writes_or_execution(policy, request):
    for mode in (Mode.ASK, Mode.PLAN, Mode.AUTO, resolve_mode(Mode.AUTO, wants_plan=True)):
        for effective in (
            apply_mode(policy, mode),
            meet(mode_mask(mode), Policy.allowing(WRITE_AND_EXECUTE)),
        ):
            assert decide(effective, request, version="v").outcome == "deny"


@pytest.mark.spec("POL-4", "POL-6")
def test_a_capability_a_read_only_mode_removed_is_denied_naming_the_mode():
    request = Request("shell.exec", command="git")
    for mode in (Mode.ASK, Mode.PLAN, Mode.AUTO):
        decision = decide(apply_mode(ENVIRONMENT, mode), request, version="v", mode=mode)
        assert decision.outcome == "deny"
        (reason,) = decision.reasons
        assert reason.startswith(f"shell.exec is not available in {mode} mode: ")
        assert "allows reads only (fs.read, model.invoke, net.http)" in reason
        assert reason == mode_denial_reason(mode, "shell.exec")
    # The mode keeps reads, and in agent mode a missing grant is the policy's doing.
    assert mode_denial_reason(Mode.PLAN, "fs.read") is None
    assert mode_denial_reason(Mode.AGENT, "shell.exec") is None
    lacking = decide(Policy.deny_all(), request, version="v", mode=Mode.AGENT)
    assert lacking.reasons == ("shell.exec is not granted by the effective policy",)


@settings(max_examples=300, deadline=None)
@given(policies, requests())
def test_naming_the_mode_never_changes_an_outcome(policy, request):
    for mode in Mode:
        effective = apply_mode(policy, mode)
        plain = decide(effective, request, version="v")
        named = decide(effective, request, version="v", mode=mode)
        assert (named.outcome, named.limits) == (plain.outcome, plain.limits)


def test_policies_package_imports_no_framework():
    code = (
        "import sys, policies, policies.parse, policies.decide, policies.modes\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "{'django', 'rest_framework', 'kestrel_one', 'runners', 'celery'}]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
