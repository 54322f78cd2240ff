#!/usr/bin/env bash
# Builds Jaeger (its v2 binary: an OpenTelemetry Collector with Jaeger's storage and query) from its Go module,
# cached like build.sh's:
#   ${DISAGG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/disagg}/bin/jaeger-<key>/jaeger
# The trace store of the tracing tests (e2e/jaeger.py): it receives OTLP from the router and the vLLM workers
# and answers its query API. Built without the `ui` tag: no web UI assets, the HTTP API is all the tests use.
# Neither Jaeger nor an OpenTelemetry Collector is packaged in Debian. Prints the bin directory.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"
# shellcheck source=cache.sh
source "$here/cache.sh"

key="jaeger-${JAEGER_VERSION}_$(cat "$here/build-jaeger.sh" "$here/cache.sh" | sha256sum | cut -c1-8)"
bin="$cache_root/bin/$key"
if [[ -f "$bin/.complete" ]]; then
  echo "$bin"
  exit 0
fi
echo "[jaeger-build] building Jaeger ${JAEGER_VERSION}" >&2
out="$(cache_staging "$bin")"
work="$(mktemp -d)"
trap 'rm -rf "$out" "$work"' EXIT
# Jaeger's go.mod has a replace directive (sarama), which `go install pkg@version` refuses: a wrapper module
# requires it as a tool, with the same replace, and its dependencies resolve to exactly Jaeger's own versions.
cat > "$work/go.mod" <<MOD
module disagg.dev/jaeger

go 1.24.6

replace github.com/Shopify/sarama => github.com/Shopify/sarama v1.33.0
MOD
(cd "$work" && GOFLAGS=-mod=mod go get -tool "github.com/jaegertracing/jaeger/cmd/jaeger@${JAEGER_VERSION}" >&2 \
  && CGO_ENABLED=0 GOFLAGS=-mod=mod go build -trimpath -ldflags "-s -w" -o "$out/jaeger" \
    github.com/jaegertracing/jaeger/cmd/jaeger >&2)
cache_publish "$out" "$bin"
echo "$bin"
