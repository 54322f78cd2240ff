#!/usr/bin/env bash
# Builds Prometheus with its Kubernetes service discovery from its Go module, cached like build.sh's:
#   ${DISAGG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/disagg}/bin/prometheus-<key>/prometheus
# Debian's prometheus package (the planner's and dashboards' tests use it) is built without Kubernetes
# service discovery; the end-to-end suite on the real node discovers pods the way the chart's monitors
# do, so it needs this one. Only the Kubernetes discovery plugin is compiled in (Prometheus' own build
# tags), and no web UI assets: the HTTP API is all the tests use. Prints the bin directory.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"
# shellcheck source=cache.sh
source "$here/cache.sh"

key="prometheus-${PROMETHEUS_MODULE_VERSION}_$(cat "$here/build-prometheus.sh" "$here/cache.sh" | sha256sum | cut -c1-8)"
bin="$cache_root/bin/$key"
if [[ -f "$bin/.complete" ]]; then
  echo "$bin"
  exit 0
fi
echo "[prometheus-build] building Prometheus ${PROMETHEUS_MODULE_VERSION} with Kubernetes discovery" >&2
out="$(cache_staging "$bin")"
trap 'rm -rf "$out"' EXIT
CGO_ENABLED=0 GOBIN="$out" GOFLAGS=-mod=mod go install -trimpath -tags remove_all_sd,enable_kubernetes_sd \
  -ldflags "-s -w" "github.com/prometheus/prometheus/cmd/prometheus@${PROMETHEUS_MODULE_VERSION}" >&2
cache_publish "$out" "$bin"
echo "$bin"
