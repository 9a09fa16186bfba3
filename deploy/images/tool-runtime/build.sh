#!/usr/bin/env bash
# Build the tool image `kestrel/tool-runtime:latest` locally, without any registry.
#
# A Debian bookworm minbase rootfs (debootstrap) with Python, a non-root `kestrel` user
# (uid/gid 10001), an empty /workspace and the adapter client `kestrel-adapter` on the PATH
# (/usr/local/bin; docs/runners.md, "The adapter broker"), imported with `docker import`.
# Idempotent: when the image already exists with this client (its sha256 is the image's
# label io.kestrel.adapter-client) nothing is built; a changed client rebuilds it. The debootstrap output is cached (outside
# git) so a rebuild after `docker rmi` takes seconds. Prints the image id (sha256:...):
# runners pin tools to that id, never to the mutable tag.
#
# Environment: KESTREL_IMAGE_CACHE (default /var/cache/kestrel/tool-runtime),
# KESTREL_DEBIAN_MIRROR (default: the machine's first apt source, else deb.debian.org).
set -euo pipefail

readonly IMAGE="kestrel/tool-runtime:latest"
readonly SUITE="bookworm"
readonly PACKAGES="python3"
readonly RUNTIME_UID=10001
readonly CACHE_DIR="${KESTREL_IMAGE_CACHE:-/var/cache/kestrel/tool-runtime}"
readonly ROOTFS="$CACHE_DIR/rootfs-$SUITE"
readonly CLIENT="$(dirname "$(readlink -f "$0")")/kestrel-adapter"
readonly CLIENT_SHA256="$(sha256sum "$CLIENT" | cut -d' ' -f1)"

fail() {
  echo "tool-runtime: $*" >&2
  exit 1
}

image_id() {
  docker image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null
}

default_mirror() {
  local uri
  uri=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  echo "${uri:-http://deb.debian.org/debian}"
}

docker info >/dev/null 2>&1 || fail "no docker engine answers (run deploy/scripts/ensure-docker.sh)"

if id=$(image_id); then
  label=$(docker image inspect --format '{{index .Config.Labels "io.kestrel.adapter-client"}}' \
    "$IMAGE" 2>/dev/null || true)
  if [ "$label" = "$CLIENT_SHA256" ]; then
    echo "$id"
    exit 0
  fi
  echo "tool-runtime: $IMAGE has another adapter client; rebuilding it" >&2
fi

if ! command -v debootstrap >/dev/null 2>&1; then
  [ "$(id -u)" -eq 0 ] || fail "debootstrap is missing and installing it needs root"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null \
    || fail "apt-get install debootstrap failed"
fi

mkdir -p "$CACHE_DIR"
if [ ! -e "$ROOTFS/.kestrel-complete" ]; then
  # Bootstrap beside the cache and rename at the end, so an interrupted run never leaves
  # a half-built rootfs that a later run would trust.
  partial="$CACHE_DIR/partial.$$"
  rm -rf "$partial"
  echo "tool-runtime: debootstrap $SUITE into $partial" >&2
  debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$partial" \
    "${KESTREL_DEBIAN_MIRROR:-$(default_mirror)}" >"$CACHE_DIR/debootstrap.log" 2>&1 \
    || fail "debootstrap failed (see $CACHE_DIR/debootstrap.log)"
  touch "$partial/.kestrel-complete"
  rm -rf "$ROOTFS"
  mv "$partial" "$ROOTFS"
fi

# Customize a copy, so the cached rootfs stays exactly what debootstrap produced.
staging="$CACHE_DIR/staging.$$"
trap 'rm -rf "$staging"' EXIT
rm -rf "$staging"
cp -a "$ROOTFS" "$staging"
rm -f "$staging/.kestrel-complete"
# Nothing in the image installs packages at run time (the root filesystem is read-only),
# so apt's lists and caches and the documentation are dead weight.
rm -rf "$staging"/var/lib/apt/lists/* "$staging"/var/cache/apt/* \
  "$staging"/usr/share/doc/* "$staging"/usr/share/man/* "$staging"/usr/share/info/*
echo "kestrel:x:$RUNTIME_UID:$RUNTIME_UID:Kestrel tool runtime:/workspace:/usr/sbin/nologin" \
  >>"$staging/etc/passwd"
echo "kestrel:x:$RUNTIME_UID:" >>"$staging/etc/group"
echo "kestrel:!:19000::::::" >>"$staging/etc/shadow"
mkdir -p "$staging/workspace"
chown "$RUNTIME_UID:$RUNTIME_UID" "$staging/workspace"
# The workload's only way to an adapter: a client of the broker's socket (stdlib Python).
install -D -m 0755 -o 0 -g 0 "$CLIENT" "$staging/usr/local/bin/kestrel-adapter"

echo "tool-runtime: importing $IMAGE" >&2
tar --numeric-owner -C "$staging" -c . | docker import \
  --change "USER $RUNTIME_UID:$RUNTIME_UID" \
  --change "WORKDIR /workspace" \
  --change "ENV PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8 HOME=/workspace" \
  --change 'CMD ["python3"]' \
  --change "LABEL io.kestrel.image=tool-runtime" \
  --change "LABEL io.kestrel.adapter-client=$CLIENT_SHA256" \
  --message "kestrel tool-runtime: debootstrap $SUITE minbase + $PACKAGES" \
  - "$IMAGE" >/dev/null || fail "docker import failed"

image_id || fail "image $IMAGE missing right after import"
