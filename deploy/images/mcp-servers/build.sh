#!/usr/bin/env bash
# Build the managed MCP server images locally, without any registry (docs/runners.md,
# "Managed images"):
#   kestrel/mcp-python:latest      python3 + the `mcp` SDK (the base of custom test servers)
#   kestrel/mcp-time:latest        PyPI mcp-server-time
#   kestrel/mcp-git:latest         PyPI mcp-server-git + Debian's git
#   kestrel/mcp-filesystem:latest  npm @modelcontextprotocol/server-filesystem on Debian's nodejs
#
# Each is `docker build` FROM kestrel/tool-runtime:latest (deploy/images/tool-runtime/build.sh,
# built first when missing), so it has the same Debian rootfs and non-root `kestrel` user
# (uid/gid 10001). Every version is pinned in this directory: the Python packages (all of
# them, dependencies included) in <image>/requirements.txt, the npm ones in
# filesystem/package-lock.json (with integrity hashes), the Debian ones in the Dockerfiles.
# The packages are fetched here, on the host, with its own pip and npm as they are set up
# (a build container need not trust the host's certificate authorities); the build
# containers install them offline and only reach Debian's archive through apt.
#
# The images run as any uid with a read-only root, /tmp as a tmpfs, no network and no
# writable home (HOME=/tmp): exactly how the runner starts an MCP server (runners/mcp/).
#
# Idempotent: an image whose label io.kestrel.build-inputs equals the hash of its inputs
# (its directory, this script, the id of the image it is built FROM) is kept; anything else
# rebuilds it (the image it replaces stays, untagged, for whoever runs it by id). Prints one
# line per image: "<tag> <image id>". Runners pin servers to the id
# (MANAGED_SERVERS in runners/contract/mcp.py names the tags they resolve).
#
# Environment: KESTREL_BUILD_PYTHON (the Python whose pip fetches wheels; default the
# repository's .venv, else python3), KESTREL_MCP_IMAGES (space-separated subset of
# "python time git filesystem" to build; default all).
set -euo pipefail

readonly HERE="$(dirname "$(readlink -f "$0")")"
readonly ROOT="$(readlink -f "$HERE/../../..")"
readonly BASE="kestrel/tool-runtime:latest"
readonly LABEL="io.kestrel.build-inputs"
# The pip that installs the wheels inside the build container (run from its own wheel,
# so the images carry no pip at all).
readonly PIP_VERSION="24.3.1"
readonly PIP_SHA256="3790624780082365f47549d032f3770eeb2b1e8bd1f7b2e02dace1afa361b4ed"
# The wheels must fit the images' interpreter (Debian bookworm's python3.11), not the host's.
readonly WHEEL_TARGET=(--only-binary=:all: --implementation cp --python-version 3.11
  --abi cp311 --abi abi3 --abi none --platform manylinux_2_28_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)

fail() {
  echo "mcp-servers: $*" >&2
  exit 1
}

image_id() {
  docker image inspect --format '{{.Id}}' "$1" 2>/dev/null
}

build_python() {
  if [ -n "${KESTREL_BUILD_PYTHON:-}" ]; then
    echo "$KESTREL_BUILD_PYTHON"
  elif [ -x "$ROOT/.venv/bin/python" ]; then
    echo "$ROOT/.venv/bin/python"
  else
    echo python3
  fi
}

# The hash of everything that shapes an image: its directory's files (names and contents),
# this script and the id of the image it is built FROM.
inputs_hash() {
  local dir="$1" parent_id="$2"
  {
    (cd "$dir" && find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum)
    sha256sum <"$HERE/build.sh"
    echo "$parent_id"
  } | sha256sum | cut -d' ' -f1
}

# build NAME: docker build kestrel/mcp-NAME:latest from NAME/ unless it is current.
build() {
  local name="$1" tag="kestrel/mcp-$1:latest" dir="$HERE/$1" parent_id hash label ctx id
  parent_id=$(image_id "$BASE") || fail "$BASE is missing"
  hash=$(inputs_hash "$dir" "$parent_id")
  if id=$(image_id "$tag"); then
    label=$(docker image inspect --format "{{index .Config.Labels \"$LABEL\"}}" "$tag" 2>/dev/null || true)
    if [ "$label" = "$hash" ]; then
      echo "$tag $id"
      return 0
    fi
    echo "mcp-servers: $tag was built from other inputs; rebuilding it" >&2
  fi

  ctx="$WORK/$name"
  mkdir -p "$ctx"
  cp -a "$dir/." "$ctx/"
  if [ -f "$dir/requirements.txt" ]; then
    echo "mcp-servers: fetching $name's wheels" >&2
    # The requirements list every package (dependencies included) at its pinned version
    # and hash, so nothing is resolved here (--no-deps) and nothing else is accepted.
    "$(build_python)" -m pip download --quiet --disable-pip-version-check --no-deps \
      --require-hashes "${WHEEL_TARGET[@]}" --dest "$ctx/wheels" -r "$dir/requirements.txt" \
      >"$WORK/pip.log" 2>&1 || { cat "$WORK/pip.log" >&2; fail "pip download for $name failed"; }
    "$(build_python)" -m pip download --quiet --disable-pip-version-check --no-deps \
      "${WHEEL_TARGET[@]}" --dest "$WORK/pip" "pip==$PIP_VERSION" >"$WORK/pip.log" 2>&1 \
      || { cat "$WORK/pip.log" >&2; fail "pip download of pip failed"; }
    echo "$PIP_SHA256  $WORK/pip/pip-$PIP_VERSION-py3-none-any.whl" | sha256sum --check --quiet \
      || fail "pip-$PIP_VERSION's wheel does not have its pinned sha256"
    cp "$WORK/pip/pip-$PIP_VERSION-py3-none-any.whl" "$ctx/pip.whl"
  fi
  if [ -f "$dir/package-lock.json" ]; then
    command -v npm >/dev/null 2>&1 || fail "npm is missing (needed for $name)"
    echo "mcp-servers: npm ci for $name" >&2
    (cd "$ctx" && npm ci --omit=dev --ignore-scripts --no-audit --no-fund) >"$WORK/npm.log" 2>&1 \
      || { cat "$WORK/npm.log" >&2; fail "npm ci for $name failed"; }
  fi

  echo "mcp-servers: building $tag" >&2
  docker build --quiet --pull=false \
    --label "$LABEL=$hash" --label "io.kestrel.image=mcp-$name" \
    --tag "$tag" "$ctx" >"$WORK/build.log" 2>&1 \
    || { tail -n 40 "$WORK/build.log" >&2; fail "docker build of $tag failed"; }
  id=$(image_id "$tag") || fail "image $tag missing right after its build"
  echo "$tag $id"
}

WORK=$(mktemp -d "${TMPDIR:-/tmp}/kestrel-mcp-images.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

docker info >/dev/null 2>&1 || fail "no docker engine answers (run deploy/scripts/ensure-docker.sh)"
image_id "$BASE" >/dev/null || bash "$ROOT/deploy/images/tool-runtime/build.sh" >/dev/null

for name in ${KESTREL_MCP_IMAGES:-python time git filesystem}; do
  [ -d "$HERE/$name" ] || fail "no such image: $name"
  build "$name"
done
# The install stages' images (labelled in the Dockerfiles) serve no later build.
docker image prune --force --filter "label=io.kestrel.build-stage=mcp-servers" >/dev/null
