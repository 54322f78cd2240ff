#!/usr/bin/env bash
# Builds the local control plane's binaries from their Go modules at the pinned
# versions in versions.env, into a cache outside the repository:
#   ${DISAGG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/disagg}/bin/<key>/
# A complete cache directory is reused as it is; otherwise everything is built
# from scratch (cache.sh). Prints the bin directory on stdout.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"
# shellcheck source=k8s-module.sh
source "$here/k8s-module.sh"
# shellcheck source=cache.sh
source "$here/cache.sh"

inputs_hash="$(cat "$here/build.sh" "$here/k8s-module.sh" "$here/cache.sh" | sha256sum | cut -c1-8)"
key="k8s-${KUBERNETES_VERSION}_kwok-${KWOK_VERSION}_helm-${HELM_VERSION}_${inputs_hash}"
bin="$cache_root/bin/$key"
if [[ -f "$bin/.complete" ]]; then
  echo "$bin"
  exit 0
fi

log() { echo "[cluster-build] $*" >&2; }
work="$(mktemp -d)"
out="$(cache_staging "$bin")"
trap 'rm -rf "$work" "$out"' EXIT

export CGO_ENABLED=0 GOFLAGS=-mod=mod
log "resolving modules for Kubernetes ${KUBERNETES_VERSION}"
# etcd is imported too: it comes at exactly the version Kubernetes pins.
k8s_wrapper_module "$work" go.etcd.io/etcd/server/v3 k8s.io/kubernetes/cmd/kube-apiserver \
  k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl
cd "$work"

log "building kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, etcd (slow on a cold cache)"
go build -trimpath -ldflags "$(k8s_ldflags)" -o "$out/" \
  k8s.io/kubernetes/cmd/kube-apiserver \
  k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kube-scheduler \
  k8s.io/kubernetes/cmd/kubectl >&2
go build -trimpath -ldflags "-s -w" -o "$out/etcd" go.etcd.io/etcd/server/v3 >&2

log "installing kwok ${KWOK_VERSION} and helm ${HELM_VERSION}"
GOBIN="$out" go install -trimpath -ldflags "-s -w" sigs.k8s.io/kwok/cmd/kwok@"${KWOK_VERSION}" >&2
GOBIN="$out" go install -trimpath -ldflags "-s -w" helm.sh/helm/v3/cmd/helm@"${HELM_VERSION}" >&2

cache_publish "$out" "$bin"
log "done: $bin"
echo "$bin"
