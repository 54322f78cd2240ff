#!/usr/bin/env bash
# Builds the local real node's binaries, cached like build.sh's:
#   ${DISAGG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/disagg}/bin/node-<key>/
# containerd, containerd-shim-runc-v2 and ctr from containerd's Go module; kubelet
# and kube-proxy from the same pinned Kubernetes module as the control plane; the
# pods' sandbox program (pause.c). runc, the CNI plugins and nft come from Debian
# (checked here, not built). A complete directory (marked by .complete, written
# last) is reused; anything else is built from scratch. Prints the bin directory.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"
# shellcheck source=k8s-module.sh
source "$here/k8s-module.sh"

cache_root="${DISAGG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/disagg}"
inputs_hash="$(cat "$here/build-node.sh" "$here/k8s-module.sh" "$here/pause.c" | sha256sum | cut -c1-8)"
key="node-k8s-${KUBERNETES_VERSION}_containerd-${CONTAINERD_VERSION}_${inputs_hash}"
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

rm -rf "$bin"
mkdir -p "$bin"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export CGO_ENABLED=0

# containerd first: the image builder needs it before the kubelet is done.
# Without cgo the btrfs and devmapper snapshotters are left out (overlayfs is used).
log "building containerd ${CONTAINERD_VERSION}"
GOBIN="$bin" GOFLAGS=-mod=mod go install -trimpath \
  -ldflags "-s -w -X github.com/containerd/containerd/v2/version.Version=${CONTAINERD_VERSION}" \
  "github.com/containerd/containerd/v2/cmd/containerd@${CONTAINERD_VERSION}" \
  "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2@${CONTAINERD_VERSION}" \
  "github.com/containerd/containerd/v2/cmd/ctr@${CONTAINERD_VERSION}" >&2
touch "$bin/.containerd-complete"

log "building the pods' sandbox program (pause)"
gcc -static -Os -s -Wall -Wextra -Werror -o "$bin/pause" "$here/pause.c"

log "building kubelet and kube-proxy ${KUBERNETES_VERSION}"
k8s_wrapper_module "$work" k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy
(cd "$work" && GOFLAGS=-mod=mod go build -trimpath -ldflags "$(k8s_ldflags)" -o "$bin/" \
  k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy >&2)

touch "$bin/.complete"
log "done: $bin"
echo "$bin"
