"""Strict parsing: every malformed document is rejected at the exact path of the problem."""

from __future__ import annotations

import pytest

from policies import PolicyError, parse_policy, parse_policy_json


def caps(**capabilities: object) -> dict:
    """A document from keyword capabilities; ``fs_write`` stands for ``fs.write``."""
    return {
        "capabilities": {name.replace("_", ".", 1): grant for name, grant in capabilities.items()}
    }


MALFORMED = [
    ([], "", "must be an object"),
    ({}, "capabilities", "is required"),
    ({"capabilities": {}, "extra": 1}, "extra", "unknown key"),
    ({"capabilities": [], "description": "x"}, "capabilities", "must be an object"),
    ({"capabilities": {}, "description": 5}, "description", "must be a string"),
    (caps(fs_delete={"paths": ["a"]}), "capabilities.fs.delete", "unknown capability"),
    (caps(fs_read="**"), "capabilities.fs.read", "must be an object"),
    (caps(fs_read={}), "capabilities.fs.read.paths", "is required"),
    (caps(fs_read={"paths": []}), "capabilities.fs.read.paths", "must not be empty"),
    (caps(fs_read={"paths": "src/**"}), "capabilities.fs.read.paths", "must be a list"),
    (caps(fs_read={"paths": ["src/**"], "mode": "x"}), "capabilities.fs.read.mode", "unknown key"),
    (caps(fs_write={"paths": ["src/**", "/etc/**"]}), "capabilities.fs.write.paths[1]", "absolute"),
    (caps(fs_write={"paths": ["src/../etc"]}), "capabilities.fs.write.paths[0]", "'..'"),
    (caps(fs_write={"paths": ["src//a"]}), "capabilities.fs.write.paths[0]", "empty segment"),
    (caps(fs_write={"paths": ["src\\a"]}), "capabilities.fs.write.paths[0]", "backslash"),
    (caps(fs_write={"paths": ["src/*.py"]}), "capabilities.fs.write.paths[0]", "ambiguous"),
    (caps(fs_write={"paths": ["src/**/test"]}), "capabilities.fs.write.paths[0]", "last segment"),
    (caps(fs_write={"paths": ["a", "b", "a"]}), "capabilities.fs.write.paths[2]", "repeats [0]"),
    (caps(fs_write={"paths": ["src/**", "src/a"]}), "capabilities.fs.write.paths[1]", "covered"),
    (caps(fs_write={"paths": [7]}), "capabilities.fs.write.paths[0]", "must be a string"),
    (
        caps(fs_write={"paths": ["a"], "approval": "sometimes"}),
        "capabilities.fs.write.approval",
        "one of",
    ),
    (caps(shell_exec={"commands": []}), "capabilities.shell.exec.commands", "must not be empty"),
    (
        caps(shell_exec={"commands": ["git", "/bin/rm"]}),
        "capabilities.shell.exec.commands[1]",
        "program",
    ),
    (
        caps(shell_exec={"limits": {"timeout_s": 0}}),
        "capabilities.shell.exec.limits.timeout_s",
        "positive",
    ),
    (
        caps(shell_exec={"limits": {"timeout_s": True}}),
        "capabilities.shell.exec.limits.timeout_s",
        "number",
    ),
    (
        caps(shell_exec={"limits": {"memory_mb": 1.5}}),
        "capabilities.shell.exec.limits.memory_mb",
        "whole",
    ),
    (
        caps(shell_exec={"limits": {"pids": 10**6}}),
        "capabilities.shell.exec.limits.pids",
        "at most",
    ),
    # An integer too large for a float is still just too large, not an error of ours.
    (
        caps(shell_exec={"limits": {"timeout_s": 10**400}}),
        "capabilities.shell.exec.limits.timeout_s",
        "at most 3600",
    ),
    (
        caps(shell_exec={"limits": {"memory_mb": -(10**400)}}),
        "capabilities.shell.exec.limits.memory_mb",
        "positive",
    ),
    (caps(code_exec={"limits": {"gpus": 1}}), "capabilities.code.exec.limits.gpus", "unknown key"),
    (caps(code_exec={"limits": [60]}), "capabilities.code.exec.limits", "must be an object"),
    (
        caps(net_http={"allow": ["https://a.com:443", "https://b.com:443", "https://*.c.com:443"]}),
        "capabilities.net.http.allow[2]",
        "wildcards",
    ),
    (
        caps(net_http={"allow": ["https://api.github.com"]}),
        "capabilities.net.http.allow[0]",
        "port is required",
    ),
    (caps(net_http={"allow": ["ftp://a.com:21"]}), "capabilities.net.http.allow[0]", "scheme"),
    (caps(net_http={"allow": ["https://a.com:443/v1"]}), "capabilities.net.http.allow[0]", "paths"),
    (
        caps(net_http={"allow": ["https://u:p@a.com:443"]}),
        "capabilities.net.http.allow[0]",
        "userinfo",
    ),
    (
        caps(net_http={"allow": ["https://127.0.0.1:443"]}),
        "capabilities.net.http.allow[0]",
        "allow_ip_literals",
    ),
    (
        caps(net_http={"allow": ["https://127.1:443"], "allow_ip_literals": True}),
        "capabilities.net.http.allow[0]",
        "canonical",
    ),
    (
        caps(net_http={"allow": ["https://API.github.com:443"]}),
        "capabilities.net.http.allow[0]",
        "lower case",
    ),
    (caps(net_http={"allow": ["https://a.com:0"]}), "capabilities.net.http.allow[0]", "port"),
    # Digits that are not ASCII (fullwidth, superscript) are no port number.
    (
        caps(net_http={"allow": ["https://a.com:\uff18\uff10"]}),
        "capabilities.net.http.allow[0]",
        "is not a number",
    ),
    (caps(net_http={"allow": ["https://a.com:\u00b2"]}), "capabilities.net.http.allow[0]", "port"),
    (
        caps(net_http={"allow": ["https://a.com:443"], "allow_ip_literals": "yes"}),
        "capabilities.net.http.allow_ip_literals",
        "true or false",
    ),
    (caps(model_invoke={"models": ["gpt 4"]}), "capabilities.model.invoke.models[0]", "model name"),
    (caps(mcp_call={"servers": {}}), "capabilities.mcp.call.servers", "must not be empty"),
    (
        caps(mcp_call={"servers": {"github": {"tools": ["search"], "dangerous": ["delete"]}}}),
        "capabilities.mcp.call.servers.github.dangerous[0]",
        "not one of this server's tools",
    ),
    # A dangerous opt-in that is no name at all (a list, an object: JSON can hold anything)
    # is reported at its place, not compared with the server's tools.
    (
        caps(mcp_call={"servers": {"github": {"tools": ["search"], "dangerous": [["search"]]}}}),
        "capabilities.mcp.call.servers.github.dangerous[0]",
        "must be a string",
    ),
    (
        caps(mcp_call={"servers": {"github": {"tools": ["a"], "dangerous": ["a", {"b": 1}]}}}),
        "capabilities.mcp.call.servers.github.dangerous[1]",
        "must be a string",
    ),
    (
        caps(mcp_call={"servers": {"github": {}}}),
        "capabilities.mcp.call.servers.github.tools",
        "is required",
    ),
    (
        caps(mcp_call={"servers": {"Git Hub": {"tools": ["x"]}}}),
        "capabilities.mcp.call.servers.Git Hub",
        "name",
    ),
    (
        caps(adapter_invoke={"adapters": {"s3": {"operations": ["get"], "region": "eu"}}}),
        "capabilities.adapter.invoke.adapters.s3.region",
        "unknown key",
    ),
    (
        caps(adapter_invoke={"adapters": {"s3": {"operations": []}}}),
        "capabilities.adapter.invoke.adapters.s3.operations",
        "must not be empty",
    ),
]


@pytest.mark.spec("POL-1")
@pytest.mark.parametrize(("document", "path", "fragment"), MALFORMED)
def test_malformed_document_is_rejected_at_its_path(document, path, fragment):
    with pytest.raises(PolicyError) as caught:
        parse_policy(document)
    assert [issue.path for issue in caught.value.issues] == [path]
    assert fragment in caught.value.issues[0].message


def test_table_is_large_enough():
    assert len(MALFORMED) >= 30


@pytest.mark.spec("POL-1")
def test_every_issue_is_reported_at_once():
    document = caps(
        fs_write={"paths": ["/abs", "ok/**", "a/../b"]},
        net_http={"allow": ["https://a.com"]},
        shell_exec={"limits": {"timeout_s": -1}, "color": "red"},
    )
    with pytest.raises(PolicyError) as caught:
        parse_policy(document)
    assert sorted(issue.path for issue in caught.value.issues) == [
        "capabilities.fs.write.paths[0]",
        "capabilities.fs.write.paths[2]",
        "capabilities.net.http.allow[0]",
        "capabilities.shell.exec.color",
        "capabilities.shell.exec.limits.timeout_s",
    ]


@pytest.mark.spec("POL-1")
def test_json_with_a_repeated_key_is_rejected_at_that_key():
    text = '{"capabilities": {"fs.read": {"paths": ["**"], "paths": ["src/**"]}}}'
    with pytest.raises(PolicyError) as caught:
        parse_policy_json(text)
    assert [issue.path for issue in caught.value.issues] == ["capabilities.fs.read.paths"]


def test_invalid_json_is_rejected_as_a_whole():
    with pytest.raises(PolicyError) as caught:
        parse_policy_json("{")
    assert caught.value.issues[0].path == ""


@pytest.mark.spec("POL-1")
def test_the_api_example_document_parses_and_round_trips():
    document = {
        "capabilities": {
            "fs.read": {"paths": ["**"]},
            "fs.write": {"paths": ["src/**", "out/**"], "approval": "never"},
            "shell.exec": {
                "approval": "always",
                "limits": {
                    "timeout_s": 60,
                    "memory_mb": 512,
                    "cpus": 1.0,
                    "pids": 128,
                    "output_kb": 256,
                },
            },
            "code.exec": {"approval": "never", "limits": {"timeout_s": 30}},
            "net.http": {"allow": ["https://api.github.com:443"]},
        }
    }
    policy = parse_policy(document)
    assert parse_policy(policy.to_document()) == policy
    assert policy.to_document()["capabilities"]["fs.write"]["paths"] == ["out/**", "src/**"]
    assert policy.to_document()["capabilities"]["code.exec"]["limits"]["memory_mb"] == 2048


def test_ip_literals_parse_with_the_flag_and_stay_flagged():
    document = caps(
        net_http={
            "allow": ["https://10.0.0.1:443", "https://[::1]:8443"],
            "allow_ip_literals": True,
        }
    )
    policy = parse_policy(document)
    assert policy.to_document()["capabilities"]["net.http"] == {
        "approval": "never",
        "allow": ["https://10.0.0.1:443", "https://[::1]:8443"],
        "allow_ip_literals": True,
    }


def test_description_is_kept_but_grants_nothing():
    plain = parse_policy(caps(fs_read={"paths": ["**"]}))
    described = parse_policy({**caps(fs_read={"paths": ["**"]}), "description": "read only"})
    assert described == plain and hash(described) == hash(plain)
    assert described.to_document()["description"] == "read only"
    assert described.sha256() != plain.sha256()
