#!/usr/bin/env bash
# What `make run` needs on this machine besides Python, set up when missing and possible:
#
# 1. The embedded broker: Debian's redis-server (unless REDIS_URL names a broker). Installed
#    with apt when missing and root, without starting the system's own Redis service: serve
#    runs it as its child, on a Unix socket in the data folder, with no TCP port.
# 2. A sandbox backend: when a Docker engine answers, the locally built tool image (built on
#    the first run); otherwise, or when the image cannot be built, bubblewrap (installed when
#    missing and root). Docker itself is never installed or started here.
#
# Never fails: where something cannot be had (not root, no network), `serve` starts anyway,
# says so in one line, and refuses what needs it (a call that would execute gets a 503; a
# process tool with no sandbox fails closed). Nothing ever runs unsandboxed.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"

apt_install() {
  # policy-rc.d answering 101 keeps the package's service from being started (Debian's
  # documented switch); removed again only if this script made it.
  local made_policy=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d \
      && made_policy=1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq --no-install-recommends "$@" >/dev/null 2>&1 || {
    apt-get update -qq >/dev/null 2>&1
    apt-get install -y -qq --no-install-recommends "$@" >/dev/null 2>&1
  }
  local status=$?
  [ -n "$made_policy" ] && rm -f /usr/sbin/policy-rc.d
  return $status
}

if [ -z "${REDIS_URL:-}" ] && ! command -v redis-server >/dev/null 2>&1 \
  && [ "$(id -u)" -eq 0 ]; then
  echo "make run: installing redis-server (the embedded broker; its system service stays off)"
  apt_install redis-server || echo "make run: apt-get install redis-server failed"
fi

if docker info >/dev/null 2>&1; then
  if ! docker image inspect kestrel/tool-runtime:latest >/dev/null 2>&1; then
    echo "make run: building the tool image kestrel/tool-runtime (first run only, a few minutes)"
    if bash "$repo/deploy/images/tool-runtime/build.sh" >/dev/null; then
      exit 0
    fi
    echo "make run: the tool image could not be built; falling back to bubblewrap"
  else
    exit 0
  fi
fi

if ! command -v bwrap >/dev/null 2>&1 && [ "$(id -u)" -eq 0 ]; then
  echo "make run: installing bubblewrap (the sandbox without Docker)"
  apt_install bubblewrap || echo "make run: apt-get install bubblewrap failed"
fi
exit 0
