"""The one network an MCP server may be given besides none: ``kestrel-mcp-open`` (MCP-4).

Only a custom server under an org admin's risk acceptance in force gets it (the signed
profile says ``network: bridge``). It is a Docker bridge of its own, with inter-container
traffic off and its own interface name, and host firewall rules that drop everything the
bridge sends to the host itself (the gateway address and every other host address: the
INPUT chain on the bridge's interface), and forwarded traffic to the link-local range and
100.100.100.200 (cloud metadata services) and to the host's addresses reached through
Docker's port publishing (DOCKER-USER, by the original destination). The rules are checked, and
installed when missing, before every start of such a server; if that cannot be done the
server does not start (``McpStartFailed``): never a bridge without them.

Inter-container traffic off is Docker's rule for the bridge (``enable_icc``), but two
containers of one bridge talk through the bridge itself, not the host's routing: the kernel
shows those frames to iptables only while ``net.bridge.bridge-nf-call-iptables`` is 1 (the
br_netfilter module). Without it that rule never applies, and two servers (of two
organizations, on a shared runner) reach each other; so it is checked before every start
too. Both the rules and that setting are the runner's own network namespace's: it must be
the engine host's, where the bridge's interface is, which is checked first.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import docker.errors

from runners.contract.mcp import BRIDGE_BLOCKED_DESTINATIONS
from runners.mcp.errors import McpStartFailed
from runners.sandbox.docker import LABEL_PREFIX, MANAGED_LABEL

__all__ = ["BRIDGE_INTERFACE", "OPEN_NETWORK", "ensure_open_network", "host_block_rules"]

OPEN_NETWORK = "kestrel-mcp-open"
BRIDGE_INTERFACE = "kestrel-mcp0"
# The bridge's interface as the runner's network namespace sees it: there only when the
# runner shares the engine host's, where the rules it installs guard the bridge.
BRIDGE_DEVICE = Path("/sys/class/net") / BRIDGE_INTERFACE
# Whether bridged frames pass through iptables (br_netfilter), in that same namespace.
BRIDGE_NETFILTER = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
_OPTIONS = {
    "com.docker.network.bridge.enable_icc": "false",
    "com.docker.network.bridge.name": BRIDGE_INTERFACE,
}


def ensure_open_network(client: Any) -> str:
    """The open network's name, once it exists with its options and its firewall rules."""
    try:
        network = client.networks.get(OPEN_NETWORK)
    except docker.errors.NotFound:
        try:
            network = client.networks.create(
                OPEN_NETWORK,
                driver="bridge",
                options=dict(_OPTIONS),
                labels={MANAGED_LABEL: "true", f"{LABEL_PREFIX}mcp-network": "open"},
                enable_ipv6=False,
                check_duplicate=True,
            )
        except docker.errors.APIError:
            network = client.networks.get(OPEN_NETWORK)  # another process made it first
        network.reload()
    except docker.errors.DockerException as error:
        raise McpStartFailed(f"bridge networking: cannot reach the engine: {error}") from None
    attrs = network.attrs
    options = attrs.get("Options") or {}
    if attrs.get("Driver") != "bridge" or any(options.get(k) != v for k, v in _OPTIONS.items()):
        raise McpStartFailed(
            f"bridge networking refused: the network {OPEN_NETWORK} exists without "
            "inter-container traffic off on its own interface (not Kestrel's); remove it"
        )
    if attrs.get("EnableIPv6"):
        raise McpStartFailed(f"bridge networking refused: {OPEN_NETWORK} has IPv6 enabled")
    gateways = [
        c["Gateway"] for c in (attrs.get("IPAM") or {}).get("Config") or [] if c.get("Gateway")
    ]
    if not gateways:
        raise McpStartFailed(f"bridge networking refused: {OPEN_NETWORK} has no gateway address")
    if not BRIDGE_DEVICE.exists():
        # A runner in a container of its own network namespace would install every rule
        # (and read every "host" address) there, where no packet of the bridge passes.
        raise McpStartFailed(
            f"bridge networking refused: the bridge's interface {BRIDGE_INTERFACE} is not in "
            "this runner's network namespace, so the firewall rules would not guard it; run "
            "the runner on the engine's host (a container of it needs --network=host)"
        )
    _require_bridge_netfilter()
    _install(host_block_rules(gateways, _host_addresses()))
    return OPEN_NETWORK


def _require_bridge_netfilter() -> None:
    """``McpStartFailed`` unless the kernel filters bridged frames (see the module's
    docstring): inter-container traffic off is a rule that would otherwise never apply."""
    try:
        value = BRIDGE_NETFILTER.read_text().strip()
    except OSError:
        value = None
    if value != "1":
        state = (
            "is not loaded" if value is None else f"filters nothing ({BRIDGE_NETFILTER} is {value})"
        )
        raise McpStartFailed(
            f"bridge networking refused: the kernel's bridge netfilter (br_netfilter) {state}, "
            "so servers on the bridge would reach each other (modprobe br_netfilter; sysctl "
            "net.bridge.bridge-nf-call-iptables=1)"
        )


def host_block_rules(gateways: list[str], host_addresses: list[str]) -> list[list[str]]:
    """The iptables rules (chain and match, without -A/-I) that keep the bridge off the host."""
    rules = [["INPUT", "-i", BRIDGE_INTERFACE, "-j", "DROP"]]
    for address in sorted(set(gateways)):
        rules.append(["INPUT", "-i", BRIDGE_INTERFACE, "-d", address, "-j", "DROP"])
    for blocked in BRIDGE_BLOCKED_DESTINATIONS:
        rules.append(["DOCKER-USER", "-i", BRIDGE_INTERFACE, "-d", blocked, "-j", "DROP"])
    for address in sorted(set(gateways) | set(host_addresses)):
        rules.append(
            [
                "DOCKER-USER",
                "-i",
                BRIDGE_INTERFACE,
                "-m",
                "conntrack",
                "--ctorigdst",
                address,
                "-j",
                "DROP",
            ]
        )
    return rules


def _host_addresses() -> list[str]:
    """Every IPv4 address of the host's interfaces (``ip -j addr``)."""
    ip = shutil.which("ip")
    if ip is None:
        raise McpStartFailed("bridge networking refused: the ip command is missing")
    try:
        out = subprocess.run(
            [ip, "-j", "-4", "addr", "show"], capture_output=True, check=True, timeout=10
        ).stdout
        interfaces = json.loads(out)
    except (OSError, subprocess.SubprocessError, ValueError) as error:
        raise McpStartFailed(
            f"bridge networking refused: cannot list host addresses: {error}"
        ) from None
    return [
        info["local"]
        for interface in interfaces
        for info in interface.get("addr_info", [])
        if info.get("family") == "inet" and info.get("local")
    ]


def _install(rules: list[list[str]]) -> None:
    iptables = shutil.which("iptables")
    if iptables is None:
        raise McpStartFailed(
            "bridge networking refused: iptables is missing, so the host cannot be blocked "
            "(deploy/scripts/ensure-docker.sh installs it)"
        )
    for rule in rules:
        try:
            present = subprocess.run(
                [iptables, "-w", "5", "-C", *rule], capture_output=True, timeout=15
            )
            if present.returncode == 0:
                continue
            added = subprocess.run(
                [iptables, "-w", "5", "-I", rule[0], "1", *rule[1:]],
                capture_output=True,
                timeout=15,
            )
        except (OSError, subprocess.SubprocessError) as error:
            raise McpStartFailed(f"bridge networking refused: iptables failed: {error}") from None
        if added.returncode != 0:
            message = added.stderr.decode(errors="replace").strip()[:300]
            raise McpStartFailed(
                f"bridge networking refused: cannot install the rule {' '.join(rule)}: {message}"
            )
