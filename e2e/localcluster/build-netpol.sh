#!/usr/bin/env bash
# Builds the real node's NetworkPolicy enforcer (kube-router, run with its firewall alone) from its Go
# module, cached like build.sh's:
#   ${DISAGG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/disagg}/bin/netpol-<key>/kube-router
# versions.env says why kube-router. Its rules need iptables and ipset (Debian's packages, checked here).
# Prints the bin directory.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"
# shellcheck source=cache.sh
source "$here/cache.sh"

key="netpol-kube-router-${KUBE_ROUTER_VERSION}_$(cat "$here/build-netpol.sh" "$here/cache.sh" | sha256sum | cut -c1-8)"
bin="$cache_root/bin/$key"
if [[ -f "$bin/.complete" ]]; then
  echo "$bin"
  exit 0
fi
missing=()
for tool in iptables ipset; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if ((${#missing[@]})); then
  echo "[netpol-build] missing ${missing[*]}; install Debian's packages: apt-get install -y iptables ipset" >&2
  exit 1
fi
echo "[netpol-build] building kube-router ${KUBE_ROUTER_VERSION}" >&2
out="$(cache_staging "$bin")"
trap 'rm -rf "$out"' EXIT
CGO_ENABLED=0 GOBIN="$out" GOFLAGS=-mod=mod go install -trimpath -ldflags "-s -w" \
  "github.com/cloudnativelabs/kube-router/v2/cmd/kube-router@${KUBE_ROUTER_VERSION}" >&2
cache_publish "$out" "$bin"
echo "$bin"
