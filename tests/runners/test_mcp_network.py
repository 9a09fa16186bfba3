"""The open network's preconditions (runners.mcp.network), without an engine: what makes
``ensure_open_network`` refuse a bridge, so a bridged server never starts unprotected."""

from __future__ import annotations

from pathlib import Path

import pytest

from runners.contract.errors import InvalidArguments
from runners.contract.mcp import DEFAULT_LIMITS, MANAGED_SERVERS, profile_digest
from runners.contract.registry import validate_args
from runners.mcp import network
from runners.mcp.errors import McpStartFailed
from runners.mcp.network import BRIDGE_INTERFACE, OPEN_NETWORK, ensure_open_network


class _Network:
    attrs = {
        "Driver": "bridge",
        "Options": {
            "com.docker.network.bridge.enable_icc": "false",
            "com.docker.network.bridge.name": BRIDGE_INTERFACE,
        },
        "EnableIPv6": False,
        "IPAM": {"Config": [{"Subnet": "172.18.0.0/16", "Gateway": "172.18.0.1"}]},
    }


class _Networks:
    def get(self, name: str) -> _Network:
        assert name == OPEN_NETWORK
        return _Network()


class _Engine:
    networks = _Networks()


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[list[str]]:
    """The rules ensure_open_network would install (nothing reaches the host's firewall),
    in a namespace that has the bridge's interface and filters bridged frames."""
    device = tmp_path / BRIDGE_INTERFACE
    device.mkdir()
    monkeypatch.setattr(network, "BRIDGE_DEVICE", device, raising=False)
    bridge_netfilter(monkeypatch, tmp_path, "1")
    rules: list[list[str]] = []
    monkeypatch.setattr(network, "_host_addresses", lambda: ["192.0.2.2"])
    monkeypatch.setattr(network, "_install", rules.extend)
    return rules


def bridge_netfilter(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, value: str | None) -> None:
    path = tmp_path / "bridge-nf-call-iptables"
    if value is None:
        path.unlink(missing_ok=True)
    else:
        path.write_text(value + "\n")
    monkeypatch.setattr(network, "BRIDGE_NETFILTER", path, raising=False)


@pytest.mark.spec("MCP-4")
@pytest.mark.parametrize(("value", "words"), [("0", "filters nothing"), (None, "is not loaded")])
def test_a_bridge_whose_frames_the_kernel_does_not_filter_is_refused(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    installed: list[list[str]],
    value: str | None,
    words: str,
) -> None:
    """Inter-container traffic off is a FORWARD rule, which frames between two containers of
    one bridge meet only while net.bridge.bridge-nf-call-iptables is 1. At 0 two bridged
    servers (of two organizations, on a shared runner) reached each other, and a server was
    started on the bridge all the same."""
    bridge_netfilter(monkeypatch, tmp_path, value)
    with pytest.raises(McpStartFailed, match="br_netfilter") as refused:
        ensure_open_network(_Engine())
    assert words in str(refused.value)
    assert installed == []


@pytest.mark.spec("MCP-4")
def test_a_runner_that_does_not_see_the_bridge_installs_no_rules_and_starts_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, installed: list[list[str]]
) -> None:
    """A runner in a container with a network namespace of its own (a documented way to run
    one: --pid=host, not --network=host) installed the host rules in its own namespace,
    where iptables takes them without a word, and started the server on an unguarded
    bridge: the Docker host and the metadata service reachable."""
    monkeypatch.setattr(network, "BRIDGE_DEVICE", tmp_path / "absent", raising=False)
    with pytest.raises(McpStartFailed, match="not in this runner's network namespace"):
        ensure_open_network(_Engine())
    assert installed == []


@pytest.mark.spec("MCP-4")
def test_a_bridge_the_kernel_filters_gets_its_host_rules(installed: list[list[str]]) -> None:
    assert ensure_open_network(_Engine()) == OPEN_NETWORK
    assert ["INPUT", "-i", BRIDGE_INTERFACE, "-j", "DROP"] in installed


def _call_args(reference: str) -> dict:
    """mcp.call's arguments, admitted and pinned, under a risk acceptance (``bridge``)."""
    profile = {
        "server": "mcp_01ARZ3NDEKTSV4RRFFQ69G5FAV",
        "reference": reference,
        "image": "sha256:" + "a" * 64,
        "command": [],
        "workspace": "none",
        "network": "bridge",
        "risk_acceptance": "rsk_01ARZ3NDEKTSV4RRFFQ69G5FAV",
        "risk_expires_at": 2_000_000_000,
        "limits": dict(DEFAULT_LIMITS),
    }
    pinned = {
        "name": "clock",
        "profile": profile,
        "profile_sha256": profile_digest(profile),
        "tool_sha256": "b" * 64,
        "dangerous": False,
    }
    return {"server": profile["server"], "tool": "now", "arguments": {}, "pinned": pinned}


@pytest.mark.spec("MCP-4")
def test_a_managed_servers_profile_is_never_bridged_even_signed() -> None:
    """Only the control plane kept a managed server off the network in a call: the runner
    took a signed bridged profile of a managed image (its reference a tag, never a digest)
    as it came. It now refuses it, as it refuses such a discovery."""
    custom = _call_args("kestrel-test/clock@sha256:" + "a" * 64)
    assert validate_args("mcp.call", custom) == custom
    with pytest.raises(InvalidArguments) as refused:
        validate_args("mcp.call", _call_args(MANAGED_SERVERS["time"]["image"]))
    assert refused.value.field == "args.pinned.profile.reference"
