#!/usr/bin/env bash
# Builds the local control plane's binaries from their Go modules at the pinned
# versions in versions.env, into a cache outside the repository:
#   ${DISAGG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/disagg}/bin/<key>/
# A complete cache directory (marked by .complete) is reused as it is; an empty
# or partial one is built from scratch. Prints the bin directory on stdout.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"

cache_root="${DISAGG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/disagg}"
key="k8s-${KUBERNETES_VERSION}_kwok-${KWOK_VERSION}_helm-${HELM_VERSION}_$(sha256sum "$here/build.sh" | cut -c1-8)"
bin="$cache_root/bin/$key"
if [[ -f "$bin/.complete" ]]; then
  echo "$bin"
  exit 0
fi

log() { echo "[cluster-build] $*" >&2; }
mkdir -p "$bin"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# k8s.io/kubernetes pins its staging modules at v0.0.0 with replace directives
# that only work inside its own repository; a wrapper module re-points each
# staging module at its published version so `go build` can resolve them.
staging=(api apiextensions-apiserver apimachinery apiserver cli-runtime client-go
  cloud-provider cluster-bootstrap code-generator component-base component-helpers
  controller-manager cri-api cri-client cri-streaming csi-translation-lib
  dynamic-resource-allocation endpointslice externaljwt kms kube-aggregator
  kube-controller-manager kube-proxy kube-scheduler kubectl kubelet metrics
  mount-utils pod-security-admission sample-apiserver sample-cli-plugin
  sample-controller streaming)
{
  echo "module disagg.dev/localcluster"
  echo
  echo "go 1.26.0"
  echo
  echo "require k8s.io/kubernetes ${KUBERNETES_VERSION}"
  echo
  echo "replace ("
  for m in "${staging[@]}"; do
    echo "	k8s.io/$m => k8s.io/$m ${KUBERNETES_STAGING_VERSION}"
  done
  echo ")"
} > "$work/go.mod"
cat > "$work/tools.go" <<'GO'
//go:build tools

package tools

import (
	_ "go.etcd.io/etcd/server/v3"
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
GO

export CGO_ENABLED=0 GOFLAGS=-mod=mod
cd "$work"
log "resolving modules for Kubernetes ${KUBERNETES_VERSION}"
# Only the requirement above: etcd comes at exactly the version Kubernetes pins,
# and no dependency is upgraded past what Kubernetes was released with.
go mod download k8s.io/kubernetes >&2

# Without these the binaries report v0.0.0, and versioned feature gates
# (Beta in 1.37) would be resolved against the wrong emulation version.
minor="${KUBERNETES_VERSION#v1.}"; minor="${minor%%.*}"
ldflags="-s -w"
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $p.gitVersion=${KUBERNETES_VERSION} -X $p.gitMajor=1 -X $p.gitMinor=${minor}"
  ldflags+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
done

log "building kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, etcd (slow on a cold cache)"
go build -trimpath -ldflags "$ldflags" -o "$bin/" \
  k8s.io/kubernetes/cmd/kube-apiserver \
  k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kube-scheduler \
  k8s.io/kubernetes/cmd/kubectl >&2
go build -trimpath -ldflags "-s -w" -o "$bin/etcd" go.etcd.io/etcd/server/v3 >&2

log "installing kwok ${KWOK_VERSION} and helm ${HELM_VERSION}"
GOBIN="$bin" go install -trimpath -ldflags "-s -w" sigs.k8s.io/kwok/cmd/kwok@"${KWOK_VERSION}" >&2
GOBIN="$bin" go install -trimpath -ldflags "-s -w" helm.sh/helm/v3/cmd/helm@"${HELM_VERSION}" >&2

touch "$bin/.complete"
log "done: $bin"
echo "$bin"
