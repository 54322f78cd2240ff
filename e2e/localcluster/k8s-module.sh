# Sourced by build.sh and build-node.sh: the wrapper module that builds
# k8s.io/kubernetes commands at the version pinned in versions.env.
#
# k8s.io/kubernetes pins its staging modules at v0.0.0 with replace directives
# that only work inside its own repository; a wrapper module re-points each
# staging module at its published version so `go build` can resolve them.
k8s_staging=(api apiextensions-apiserver apimachinery apiserver cli-runtime client-go
  cloud-provider cluster-bootstrap code-generator component-base component-helpers
  controller-manager cri-api cri-client cri-streaming csi-translation-lib
  dynamic-resource-allocation endpointslice externaljwt kms kube-aggregator
  kube-controller-manager kube-proxy kube-scheduler kubectl kubelet metrics
  mount-utils pod-security-admission sample-apiserver sample-cli-plugin
  sample-controller streaming)

# k8s_wrapper_module DIR PACKAGE...: writes DIR/go.mod and DIR/tools.go importing
# the packages, and downloads k8s.io/kubernetes (only that requirement: its
# dependencies come at exactly the versions Kubernetes was released with).
k8s_wrapper_module() {
  local dir="$1" m p
  shift
  {
    echo "module disagg.dev/localcluster"
    echo
    echo "go 1.26.0"
    echo
    echo "require k8s.io/kubernetes ${KUBERNETES_VERSION}"
    echo
    echo "replace ("
    for m in "${k8s_staging[@]}"; do
      echo "	k8s.io/$m => k8s.io/$m ${KUBERNETES_STAGING_VERSION}"
    done
    echo ")"
  } > "$dir/go.mod"
  {
    printf '//go:build tools\n\npackage tools\n\nimport (\n'
    for p in "$@"; do printf '\t_ "%s"\n' "$p"; done
    printf ')\n'
  } > "$dir/tools.go"
  (cd "$dir" && GOFLAGS=-mod=mod go mod download k8s.io/kubernetes >&2)
}

# Without these the binaries report v0.0.0, and versioned feature gates
# (Beta in 1.37) would be resolved against the wrong emulation version.
k8s_ldflags() {
  local minor="${KUBERNETES_VERSION#v1.}" p flags="-s -w"
  minor="${minor%%.*}"
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    flags+=" -X $p.gitVersion=${KUBERNETES_VERSION} -X $p.gitMajor=1 -X $p.gitMinor=${minor}"
    flags+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
  done
  echo "$flags"
}
