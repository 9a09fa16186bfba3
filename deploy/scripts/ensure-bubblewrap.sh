#!/usr/bin/env bash
# Make sure bubblewrap (bwrap) is installed: the single-host sandbox without Docker, and
# what the runner tests check it against.
#
# Idempotent: installs Debian's bubblewrap only when bwrap is missing. Exits non-zero with
# a message saying what failed.
set -euo pipefail

fail() {
  echo "ensure-bubblewrap: $*" >&2
  exit 1
}

if command -v bwrap >/dev/null 2>&1; then
  exit 0
fi
[ "$(id -u)" -eq 0 ] || fail "bwrap is missing and installing it needs root"
echo "ensure-bubblewrap: installing bubblewrap" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -qq bubblewrap >/dev/null 2>&1 || {
  apt-get update -qq || fail "apt-get update failed"
  apt-get install -y -qq bubblewrap >/dev/null || fail "apt-get install bubblewrap failed"
}
command -v bwrap >/dev/null 2>&1 || fail "bubblewrap installed but bwrap is not on PATH"
