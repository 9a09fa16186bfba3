"""The explicit tool registry: schemas, policy requests, unknown tools (EXT-1, RUN-2)."""

from __future__ import annotations

import inspect
import sys

import pytest

from policies.request import Request
from runners.contract import arguments as registry
from runners.contract.errors import InvalidArguments, UnknownTool
from runners.contract.registry import TOOL_MODULES, TOOLS, get_tool, validate_args
from runners.contract.toolspec import ToolSpec

pytestmark = pytest.mark.spec("EXT-1", "RUN-2")


def test_registry_holds_exactly_the_first_tool_set():
    assert set(TOOLS) == {
        "shell.exec",
        "fs.read",
        "fs.write",
        "fs.list",
        "fs.delete",
        "code.python",
        "workspace.checkpoint",
        "workspace.restore",
        "adapter.invoke",
        "model.invoke",
        "mcp.call",
    }


def _implementations(module) -> set:
    """The functions a tool module defines that take ``(args, ctx)``: its implementations."""
    return {
        value
        for value in vars(module).values()
        if inspect.isfunction(value)
        and value.__module__ == module.__name__
        and list(inspect.signature(value).parameters) == ["args", "ctx"]
    }


def test_every_registered_tool_has_exactly_one_implementation():
    implementations = [spec.implementation for spec in TOOLS.values()]
    assert all(callable(implementation) for implementation in implementations)
    # One implementation per tool: no two tools share one.
    assert len(set(implementations)) == len(TOOLS)
    for spec in TOOLS.values():
        module = sys.modules[spec.implementation.__module__]
        assert module in TOOL_MODULES
        # The tool's spec sits in the module of its implementation.
        assert any(listed is spec for listed in module.TOOLS)


def test_every_implementation_is_registered():
    defined = set().union(*(_implementations(module) for module in TOOL_MODULES))
    registered = {spec.implementation for spec in TOOLS.values()}
    assert defined == registered
    # Every spec a tool module defines is listed in the registry, by the same object.
    specs = {id(v) for m in TOOL_MODULES for v in vars(m).values() if isinstance(v, ToolSpec)}
    assert specs == {id(spec) for spec in TOOLS.values()}


def test_registry_cannot_be_extended_at_run_time():
    with pytest.raises(TypeError):
        TOOLS["net.fetch"] = TOOLS["fs.read"]  # type: ignore[index]


@pytest.mark.parametrize("name", ["fs.exec", "", "FS.READ", "shell.exec ", None, 7])
def test_unknown_tools_fail_closed(name):
    with pytest.raises(UnknownTool):
        get_tool(name)
    with pytest.raises(UnknownTool):
        validate_args(name, {"path": "a"})


@pytest.mark.parametrize(
    ("name", "idempotent"),
    [
        ("fs.read", True),
        ("fs.list", True),
        ("fs.write", True),
        ("fs.delete", False),
        ("shell.exec", False),
        ("code.python", False),
    ],
)
def test_idempotence_is_declared_per_tool(name, idempotent):
    assert get_tool(name).idempotent is idempotent


def test_every_schema_is_closed():
    for spec in TOOLS.values():
        assert spec.input_schema["additionalProperties"] is False, spec.name
        assert spec.input_schema["$schema"].endswith("2020-12/schema")


@pytest.mark.parametrize(
    ("name", "args", "request_"),
    [
        ("fs.read", {"path": "src/a.py"}, Request("fs.read", paths=("src/a.py",))),
        ("fs.list", {"path": "."}, Request("fs.read", paths=(".",))),
        ("fs.write", {"path": "out/b", "content": ""}, Request("fs.write", paths=("out/b",))),
        ("fs.delete", {"path": "out/b"}, Request("fs.write", paths=("out/b",))),
        (
            "shell.exec",
            {"argv": ["/usr/bin/git", "status"], "timeout_s": 30},
            Request("shell.exec", command="/usr/bin/git", limits={"timeout_s": 30.0}),
        ),
        # A program in the workspace is not the program a "git" rule names.
        ("shell.exec", {"argv": ["./git"]}, Request("shell.exec", command="./git")),
        ("shell.exec", {"script": "ls | wc -l"}, Request("shell.exec", command="sh")),
        (
            "code.python",
            {"code": "print(1)", "timeout_s": 5},
            Request("code.exec", limits={"timeout_s": 5.0}),
        ),
    ],
)
def test_capability_request_names_capability_and_resources(name, args, request_):
    assert get_tool(name).capability_request(validate_args(name, args)) == request_


def test_validate_args_returns_an_independent_copy():
    original = {"argv": ["echo", "hi"], "env": {"A": "1"}}
    canonical = validate_args("shell.exec", original)
    canonical["argv"].append("more")
    assert original == {"argv": ["echo", "hi"], "env": {"A": "1"}}


@pytest.mark.parametrize(
    ("name", "args", "field"),
    [
        ("fs.read", {}, "args.path"),
        ("fs.read", [], "args"),
        ("fs.read", {"path": "a", "mode": "r"}, "args.mode"),
        ("fs.read", {"path": 3}, "args.path"),
        ("fs.read", {"path": ""}, "args.path"),
        ("fs.read", {"path": "../etc/passwd"}, "args.path"),
        ("fs.read", {"path": "/etc/passwd"}, "args.path"),
        ("fs.read", {"path": "a\x00b"}, "args.path"),
        ("fs.read", {"path": "a//b"}, "args.path"),
        ("fs.write", {"path": "a"}, "args.content"),
        ("fs.write", {"path": "a", "content": 5}, "args.content"),
        (
            "fs.write",
            {"path": "a", "content": "x" * (registry.MAX_FILE_CONTENT_CHARS + 1)},
            "args.content",
        ),
        ("shell.exec", {"argv": []}, "args.argv"),
        ("shell.exec", {"argv": [""]}, "args.argv[0]"),
        ("shell.exec", {"argv": ["echo", 1]}, "args.argv[1]"),
        ("shell.exec", {"argv": ["echo", "a\x00"]}, "args.argv[1]"),
        ("shell.exec", {"argv": ["x"] * (registry.MAX_ARGV_ITEMS + 1)}, "args.argv"),
        ("shell.exec", {"argv": ["echo"], "script": "echo"}, "args"),
        ("shell.exec", {"cwd": "src"}, "args"),
        ("shell.exec", {"argv": ["ls"], "cwd": "../other"}, "args.cwd"),
        ("shell.exec", {"argv": ["ls"], "env": {"A": 1}}, "args.env.A"),
        ("shell.exec", {"argv": ["ls"], "env": {"PATH": "/tmp"}}, "args.env.PATH"),
        ("shell.exec", {"argv": ["ls"], "env": {"TMPDIR": "/x"}}, "args.env.TMPDIR"),
        ("shell.exec", {"argv": ["ls"], "timeout_s": 0}, "args.timeout_s"),
        ("shell.exec", {"argv": ["ls"], "timeout_s": 1.5}, "args.timeout_s"),
        ("shell.exec", {"argv": ["ls"], "timeout_s": True}, "args.timeout_s"),
        ("shell.exec", {"argv": ["ls"], "timeout_s": registry.MAX_TIMEOUT_S + 1}, "args.timeout_s"),
        ("code.python", {"code": ""}, "args.code"),
        ("code.python", {"code": "1", "argv": ["x"]}, "args.argv"),
    ],
)
def test_invalid_arguments_name_the_field(name, args, field):
    with pytest.raises(InvalidArguments) as raised:
        validate_args(name, args)
    assert raised.value.field == field
    assert str(raised.value).startswith(field)


@pytest.mark.parametrize(
    ("name", "args", "reason"),
    [
        (
            "fs.write",
            {"path": "a", "content": "x", "mode": "w"},
            "unknown argument 'mode'; fs.write takes: content, path",
        ),
        (
            "shell.exec",
            {"argv": ["ls"], "shell": True},
            "unknown argument 'shell'; "
            "shell.exec takes: argv, cwd, env, outputs, script, timeout_s",
        ),
        (
            "workspace.checkpoint",
            {"path": "."},
            "unknown argument 'path'; workspace.checkpoint takes no arguments",
        ),
        (
            "fs.read",
            ["a"],
            "must be a JSON object of arguments; fs.read takes: path",
        ),
    ],
)
def test_an_unknown_argument_lists_the_ones_the_tool_takes(name, args, reason):
    """The runner refuses a command with the same words the API answers with."""
    with pytest.raises(InvalidArguments) as raised:
        validate_args(name, args)
    assert raised.value.reason == reason


def test_invalid_environment_names_are_refused_with_a_clear_reason():
    with pytest.raises(InvalidArguments) as raised:
        validate_args("shell.exec", {"argv": ["env"], "env": {"1BAD": "x"}})
    assert raised.value.field == "args.env"
    assert "1BAD" in raised.value.reason


# --- declared outputs ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "args", "field"),
    [
        (
            "shell.exec",
            {"argv": ["make"], "outputs": ["ok.txt", "../etc/passwd"]},
            "args.outputs[1]",
        ),
        ("shell.exec", {"argv": ["make"], "outputs": ["ok.txt", "/etc/passwd"]}, "args.outputs[1]"),
        ("shell.exec", {"argv": ["make"], "outputs": ["ok.txt", "out//a"]}, "args.outputs[1]"),
        ("shell.exec", {"argv": ["make"], "outputs": ["ok.txt", "./a"]}, "args.outputs[1]"),
        ("shell.exec", {"argv": ["make"], "outputs": ["ok.txt", "out/"]}, "args.outputs[1]"),
        ("shell.exec", {"argv": ["make"], "outputs": ["ok.txt", "."]}, "args.outputs[1]"),
        ("shell.exec", {"argv": ["make"], "outputs": ["ok.txt", ""]}, "args.outputs[1]"),
        ("shell.exec", {"argv": ["make"], "outputs": ["ok.txt", "a\x00b"]}, "args.outputs[1]"),
        ("shell.exec", {"argv": ["make"], "outputs": ["ok.txt", 7]}, "args.outputs[1]"),
        ("shell.exec", {"argv": ["make"], "outputs": ["ok.txt", "x" * 256]}, "args.outputs[1]"),
        ("shell.exec", {"argv": ["make"], "outputs": "out/a"}, "args.outputs"),
        ("shell.exec", {"argv": ["make"], "outputs": ["a", "a"]}, "args.outputs"),
        (
            "shell.exec",
            {"argv": ["make"], "outputs": [f"f{n}" for n in range(registry.MAX_OUTPUTS + 1)]},
            "args.outputs",
        ),
        ("code.python", {"code": "1", "outputs": ["ok.txt", "../x"]}, "args.outputs[1]"),
        ("code.python", {"code": "1", "outputs": ["/x"]}, "args.outputs[0]"),
        ("fs.read", {"path": "a", "outputs": ["a"]}, "args.outputs"),
    ],
)
def test_invalid_outputs_name_the_item(name, args, field):
    with pytest.raises(InvalidArguments) as raised:
        validate_args(name, args)
    assert raised.value.field == field


def test_outputs_are_declared_in_order_and_are_not_part_of_the_tool_request():
    args = validate_args(
        "shell.exec",
        {"script": "make report", "outputs": ["out/report.txt", "build/app.tar.gz"]},
    )
    assert registry.declared_outputs(args) == ("out/report.txt", "build/app.tar.gz")
    # A shell.exec grant judges the program, not paths: the files are judged as fs.read.
    assert get_tool("shell.exec").capability_request(args) == Request(
        capability="shell.exec", command="sh"
    )
    assert registry.output_read_requests(args) == (
        Request(capability="fs.read", paths=("out/report.txt",)),
        Request(capability="fs.read", paths=("build/app.tar.gz",)),
    )
    python = validate_args(
        "code.python", {"code": "1", "outputs": [f"f{n}" for n in range(registry.MAX_OUTPUTS)]}
    )
    assert len(registry.declared_outputs(python)) == registry.MAX_OUTPUTS
    assert registry.declared_outputs(validate_args("fs.read", {"path": "a"})) == ()
