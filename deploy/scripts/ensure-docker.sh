#!/usr/bin/env bash
# Make sure a Docker engine answers on this machine, starting one if needed.
#
# Idempotent: installs docker.io only when dockerd is missing, starts dockerd only when
# `docker info` fails, and waits (bounded) until the engine answers. Works as root on a
# fresh Debian machine without systemd (developer machines and CI), where nothing starts
# dockerd for us. Exits non-zero with a message saying what failed.
set -euo pipefail

readonly DOCKERD_LOG="${DOCKERD_LOG:-/var/log/dockerd.log}"
readonly WAIT_SECONDS="${DOCKER_WAIT_SECONDS:-60}"

fail() {
  echo "ensure-docker: $*" >&2
  exit 1
}

# A bridged MCP server (runners/mcp/network.py) starts only once iptables rules keep it off
# the host, and the host's addresses are read with ip: both must exist beside the engine.
ensure_firewall_tools() {
  local missing=()
  command -v iptables >/dev/null 2>&1 || missing+=(iptables)
  command -v ip >/dev/null 2>&1 || missing+=(iproute2)
  [ "${#missing[@]}" -eq 0 ] && return 0
  [ "$(id -u)" -eq 0 ] || fail "${missing[*]} missing and installing needs root"
  echo "ensure-docker: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq || fail "apt-get update failed"
  apt-get install -y -qq "${missing[@]}" >/dev/null || fail "apt-get install ${missing[*]} failed"
}

if docker info >/dev/null 2>&1; then
  ensure_firewall_tools
  exit 0
fi

if ! command -v dockerd >/dev/null 2>&1; then
  [ "$(id -u)" -eq 0 ] || fail "dockerd is missing and installing it needs root"
  echo "ensure-docker: installing docker.io" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq || fail "apt-get update failed"
  apt-get install -y -qq docker.io >/dev/null || fail "apt-get install docker.io failed"
fi

# Another start may be on its way (a concurrent run of this script): only start dockerd
# when no daemon process exists, then wait for whichever one is coming up. pidof comes
# with every Debian (sysvinit-utils is essential); procps may be absent.
if ! pidof dockerd >/dev/null 2>&1; then
  [ "$(id -u)" -eq 0 ] || fail "dockerd is not running and starting it needs root"
  echo "ensure-docker: starting dockerd (log: $DOCKERD_LOG)" >&2
  nohup dockerd >>"$DOCKERD_LOG" 2>&1 </dev/null &
fi

for _ in $(seq 1 "$WAIT_SECONDS"); do
  if docker info >/dev/null 2>&1; then
    echo "ensure-docker: docker engine ready" >&2
    ensure_firewall_tools
    exit 0
  fi
  sleep 1
done

tail -n 20 "$DOCKERD_LOG" >&2 2>/dev/null || true
fail "docker engine did not answer within ${WAIT_SECONDS}s (see $DOCKERD_LOG)"
