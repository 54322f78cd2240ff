#!/usr/bin/env bash
# Builds the local real node's binaries, cached like build.sh's:
#   ${DISAGG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/disagg}/bin/node-<key>/
# containerd, containerd-shim-runc-v2 and ctr from containerd's Go module; CoreDNS
# (the cluster's DNS) from its Go module; kubelet
# and kube-proxy from the same pinned Kubernetes module as the control plane; the
# pods' sandbox program (pause.c). runc, the CNI plugins and nft come from Debian
# (checked here, not built). A complete directory is reused; otherwise everything
# is built from scratch (cache.sh). Prints the bin directory.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"
# shellcheck source=k8s-module.sh
source "$here/k8s-module.sh"
# shellcheck source=cache.sh
source "$here/cache.sh"

inputs_hash="$(cat "$here/build-node.sh" "$here/k8s-module.sh" "$here/cache.sh" "$here/pause.c" | sha256sum | cut -c1-8)"
key="node-k8s-${KUBERNETES_VERSION}_containerd-${CONTAINERD_VERSION}_coredns-${COREDNS_VERSION}_${inputs_hash}"
bin="$cache_root/bin/$key"
if [[ -f "$bin/.complete" ]]; then
  echo "$bin"
  exit 0
fi

log() { echo "[node-build] $*" >&2; }
missing=()
for tool in runc nft gcc; do command -v "$tool" >/dev/null || missing+=("$tool"); done
for plugin in bridge host-local loopback; do [[ -x /usr/lib/cni/$plugin ]] || missing+=("cni:$plugin"); done
if ((${#missing[@]})); then
  log "missing ${missing[*]}; install Debian's packages:"
  log "  apt-get install -y runc containernetworking-plugins nftables gcc libc6-dev"
  exit 1
fi

work="$(mktemp -d)"
out="$(cache_staging "$bin")"
trap 'rm -rf "$work" "$out"' EXIT
export CGO_ENABLED=0

# Without cgo the btrfs and devmapper snapshotters are left out (overlayfs is used).
log "building containerd ${CONTAINERD_VERSION}"
GOBIN="$out" GOFLAGS=-mod=mod go install -trimpath \
  -ldflags "-s -w -X github.com/containerd/containerd/v2/version.Version=${CONTAINERD_VERSION}" \
  "github.com/containerd/containerd/v2/cmd/containerd@${CONTAINERD_VERSION}" \
  "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2@${CONTAINERD_VERSION}" \
  "github.com/containerd/containerd/v2/cmd/ctr@${CONTAINERD_VERSION}" >&2

log "building CoreDNS ${COREDNS_VERSION}"
GOBIN="$out" GOFLAGS=-mod=mod go install -trimpath -ldflags "-s -w" "github.com/coredns/coredns@${COREDNS_VERSION}" >&2

log "building the pods' sandbox program (pause)"
gcc -static -Os -s -Wall -Wextra -Werror -o "$out/pause" "$here/pause.c"

log "building kubelet and kube-proxy ${KUBERNETES_VERSION}"
k8s_wrapper_module "$work" k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy
(cd "$work" && GOFLAGS=-mod=mod go build -trimpath -ldflags "$(k8s_ldflags)" -o "$out/" \
  k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy >&2)

cache_publish "$out" "$bin"
log "done: $bin"
echo "$bin"
