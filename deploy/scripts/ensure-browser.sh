#!/usr/bin/env bash
# Make sure the console's browser tests and the MCP endpoint's client tests can run:
# Debian's chromium (Playwright drives it through executable_path; Playwright's own browser
# downloads are not reachable here) and the npm packages the tests use, from
# package-lock.json into node_modules: axe-core, the MCP conformance suite and the MCP
# Inspector's CLI (tests/mcp_endpoint run them with `npx --no-install`, so nothing is
# downloaded while the tests run).
#
# Idempotent: installs chromium only when it is missing, runs npm ci only when the lock
# file changed. Exits non-zero with a message saying what failed.
set -euo pipefail

fail() {
  echo "ensure-browser: $*" >&2
  exit 1
}

if ! command -v chromium >/dev/null 2>&1; then
  [ "$(id -u)" -eq 0 ] || fail "chromium is missing and installing it needs root"
  echo "ensure-browser: installing chromium" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq chromium >/dev/null 2>&1 || {
    apt-get update -qq || fail "apt-get update failed"
    apt-get install -y -qq chromium >/dev/null || fail "apt-get install chromium failed"
  }
  command -v chromium >/dev/null 2>&1 || fail "chromium installed but not on PATH"
fi

command -v npm >/dev/null 2>&1 || fail "npm is missing (Debian's nodejs and npm packages)"
# The conformance suite is pinned to 0.1.13: later versions import fs.globSync (Node 22).
node -e 'process.exit(Number(process.versions.node.split(".")[0]) >= 20 ? 0 : 1)' ||
  fail "Node.js 20 or later is needed (found $(node --version)); Debian's nodejs package"
stamp="node_modules/.installed-$(sha256sum package-lock.json | cut -c1-16)"
if [ ! -e "$stamp" ]; then
  npm ci --no-audit --no-fund --loglevel=error >/dev/null || fail "npm ci failed"
  touch "$stamp"
fi
