#!/usr/bin/env bash
# Builds BuildKit's daemon and client (buildkitd, buildctl) from the Go module at
# the version pinned in versions.env, into a cache outside the repository:
#   ${DISAGG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/disagg}/buildkit/<key>/
# A complete directory (marked by .complete, written last) is reused as it is;
# an absent or partial one is built from scratch. Prints the directory.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"

cache_root="${DISAGG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/disagg}"
key="buildkit-${BUILDKIT_VERSION}_$(sha256sum "$here/build-buildkit.sh" | cut -c1-8)"
bin="$cache_root/buildkit/$key"
if [[ -f "$bin/.complete" ]]; then
  echo "$bin"
  exit 0
fi

log() { echo "[buildkit-build] $*" >&2; }
rm -rf "$bin"
mkdir -p "$bin"

# `go install module@version` refuses BuildKit: its go.mod has exclude
# directives. Download the module and build inside its own source tree, so its
# go.mod and go.sum (and so exactly its pinned dependencies) are what resolve.
log "downloading github.com/moby/buildkit@${BUILDKIT_VERSION}"
src="$(go mod download -json "github.com/moby/buildkit@${BUILDKIT_VERSION}" \
  | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
[[ -d "$src" ]] || { log "go mod download gave no source directory"; exit 1; }
cd "$src"

pkg=github.com/moby/buildkit
ldflags="-s -w -X $pkg/version.Version=${BUILDKIT_VERSION} -X $pkg/version.Package=$pkg"
# Static and without cgo, as BuildKit's own release binaries are built.
export CGO_ENABLED=0 GOFLAGS=-mod=mod
log "building buildctl and buildkitd ${BUILDKIT_VERSION} (a few minutes on a cold Go cache)"
go build -trimpath -ldflags "$ldflags" -o "$bin/buildctl" ./cmd/buildctl >&2
go build -trimpath -ldflags "$ldflags" -tags "osusergo netgo static_build" -o "$bin/buildkitd" ./cmd/buildkitd >&2

touch "$bin/.complete"
log "done: $bin"
echo "$bin"
