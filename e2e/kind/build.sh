#!/usr/bin/env bash
# Builds the kind provider's binaries, cached like the local cluster's (e2e/localcluster/cache.sh):
#   ${DISAGG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/disagg}/bin/kind-<key>/
# kind and crictl from their Go modules; kubeadm (kind's nodes bootstrap with it) from the same pinned Kubernetes module
# as the control plane and the real node; capsrunc (capsrunc/), the runc wrapper the Docker engine and the
# node image run containers through. A complete directory is reused. Prints the bin directory.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
lc="$here/../localcluster"
# shellcheck source=../localcluster/versions.env
source "$lc/versions.env"
# shellcheck source=../localcluster/k8s-module.sh
source "$lc/k8s-module.sh"
# shellcheck source=../localcluster/cache.sh
source "$lc/cache.sh"

inputs_hash="$(cat "$here/build.sh" "$lc/k8s-module.sh" "$lc/cache.sh" "$here/capsrunc/main.go" "$here/capsrunc/go.mod" \
  | sha256sum | cut -c1-8)"
key="kind-${KIND_VERSION}_k8s-${KUBERNETES_VERSION}_crictl-${CRI_TOOLS_VERSION}_${inputs_hash}"
bin="$cache_root/bin/$key"
if [[ -f "$bin/.complete" ]]; then
  echo "$bin"
  exit 0
fi

log() { echo "[kind-build] $*" >&2; }
work="$(mktemp -d)"
out="$(cache_staging "$bin")"
trap 'rm -rf "$work" "$out"' EXIT
export CGO_ENABLED=0

log "building capsrunc"
(cd "$here/capsrunc" && go build -trimpath -ldflags "-s -w" -o "$out/capsrunc" . >&2)

log "building kind ${KIND_VERSION}"
GOBIN="$out" GOFLAGS=-mod=mod go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kind@${KIND_VERSION}" >&2

log "building crictl ${CRI_TOOLS_VERSION}"
GOBIN="$out" GOFLAGS=-mod=mod go install -trimpath -ldflags "-s -w" "sigs.k8s.io/cri-tools/cmd/crictl@${CRI_TOOLS_VERSION}" >&2

log "building kubeadm ${KUBERNETES_VERSION}"
k8s_wrapper_module "$work" k8s.io/kubernetes/cmd/kubeadm
(cd "$work" && GOFLAGS=-mod=mod go build -trimpath -ldflags "$(k8s_ldflags)" -o "$out/" k8s.io/kubernetes/cmd/kubeadm >&2)

cache_publish "$out" "$bin"
log "done: $bin"
echo "$bin"
