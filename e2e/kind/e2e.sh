#!/usr/bin/env bash
# The end-to-end suite on kind (needs Docker, kind, kubectl, curl; helm is taken from PATH or the
# repository's cache). See e2e/kind/README.md.
#
#   bash e2e/kind/e2e.sh          # up, images, test, down (the cluster is kept when a step fails)
#   bash e2e/kind/e2e.sh up       # create the cluster and advertise its GPUs
#   bash e2e/kind/e2e.sh images   # build the Dockerfile's targets and the stub worker, load them into kind
#   bash e2e/kind/e2e.sh test     # run tests/test_e2e_helm.py with DISAGG_E2E_PROVIDER=kind
#   bash e2e/kind/e2e.sh down     # delete the cluster
#
# Environment: KIND_CLUSTER_NAME (disagg-e2e), KIND_NODE_IMAGE (kindest/node:v1.37.2, the local control
# plane's Kubernetes version), DISAGG_E2E_SKIP_WORKER_IMAGE=1 (do not build and load the vLLM worker
# image, about 10 GB: the suite's pods run the stub worker anyway), PYTHON (.venv/bin/python).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
name="${KIND_CLUSTER_NAME:-disagg-e2e}"
node_image="${KIND_NODE_IMAGE:-kindest/node:v1.37.2}"
state="${DISAGG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/disagg}/kind/$name"
kubeconfig="$state/kubeconfig"
python="${PYTHON:-$repo/.venv/bin/python}"
version="$(sed -n 's/^version: //p' "$repo/charts/disagg/Chart.yaml")"
control_plane_image="disagg/control-plane:$version"
worker_image="disagg/worker:$version"
stub_image="disagg/e2e-stub-worker:$version"
stub_image_next="disagg/e2e-stub-worker:$version-next"

proxy_pid=""

log() { printf '[kind-e2e] %s\n' "$*" >&2; }

stop_proxy() {
  if [[ -n "$proxy_pid" ]]; then
    kill "$proxy_pid" 2>/dev/null || true
    proxy_pid=""
  fi
}
trap stop_proxy EXIT

need() {
  local tool
  for tool in "$@"; do
    command -v "$tool" >/dev/null || { log "missing: $tool (see e2e/kind/README.md)"; exit 2; }
  done
}

kctl() { kubectl --kubeconfig "$kubeconfig" "$@"; }

# Advertise each GPU-labelled node's GPUs (its nvidia.com/gpu.count label) as the extended resource
# nvidia.com/gpu: a JSON patch of the node's status through `kubectl proxy`, as the Kubernetes docs on
# extended resources describe. kind nodes have no device plugin, so nothing takes it away again.
advertise_gpus() {
  local port=18001 node count
  kctl proxy --port "$port" >"$state/proxy.log" 2>&1 &
  proxy_pid=$!
  for _ in $(seq 50); do
    curl -fsS "http://127.0.0.1:$port/api" >/dev/null 2>&1 && break
    sleep 0.2
  done
  for node in $(kctl get nodes -l nvidia.com/gpu.present=true -o jsonpath='{.items[*].metadata.name}'); do
    count="$(kctl get node "$node" -o jsonpath='{.metadata.labels.nvidia\.com/gpu\.count}')"
    log "node $node: nvidia.com/gpu=$count"
    curl -fsS --header "Content-Type: application/json-patch+json" --request PATCH \
      --data "[{\"op\": \"add\", \"path\": \"/status/capacity/nvidia.com~1gpu\", \"value\": \"$count\"}]" \
      "http://127.0.0.1:$port/api/v1/nodes/$node/status" >/dev/null
  done
  stop_proxy
  # the kubelet copies capacity into allocatable at its next status update
  for node in $(kctl get nodes -l nvidia.com/gpu.present=true -o jsonpath='{.items[*].metadata.name}'); do
    for _ in $(seq 60); do
      [[ "$(kctl get node "$node" -o jsonpath='{.status.allocatable.nvidia\.com/gpu}')" != "" ]] && break
      sleep 1
    done
  done
  kctl get nodes -o custom-columns='NAME:.metadata.name,GPUS:.status.allocatable.nvidia\.com/gpu,CLIQUE:.metadata.labels.nvidia\.com/gpu\.clique' >&2
}

up() {
  need docker kind kubectl curl
  mkdir -p "$state"
  if kind get clusters 2>/dev/null | grep -qx "$name"; then
    log "cluster $name exists: reused"
  else
    log "creating cluster $name from $here/cluster.yaml ($node_image)"
    kind create cluster --name "$name" --config "$here/cluster.yaml" --image "$node_image" --wait 180s
  fi
  kind get kubeconfig --name "$name" >"$kubeconfig"
  chmod 600 "$kubeconfig"
  advertise_gpus
  log "KUBECONFIG=$kubeconfig"
}

gpu_nodes() {
  kctl get nodes -l nvidia.com/gpu.present=true -o jsonpath='{.items[*].metadata.name}' | tr ' ' ','
}

images() {
  need docker kind kubectl
  log "building $control_plane_image (Dockerfile target control-plane)"
  docker build --target control-plane -t "$control_plane_image" "$repo"
  log "building $stub_image (e2e/kind/stub-worker)"
  docker build -t "$stub_image" "$here/stub-worker"
  docker tag "$stub_image" "$stub_image_next"
  kind load docker-image --name "$name" "$control_plane_image" "$stub_image" "$stub_image_next"
  if [[ "${DISAGG_E2E_SKIP_WORKER_IMAGE:-0}" != 1 ]]; then
    log "building $worker_image (Dockerfile target worker; vLLM, large)"
    docker build --target worker -t "$worker_image" "$repo"
    kind load docker-image --name "$name" --nodes "$(gpu_nodes)" "$worker_image"
  fi
}

run_tests() {
  [[ -x "$python" ]] || { log "no $python: run \`make venv\` first"; exit 2; }
  log "running tests/test_e2e_helm.py on kind"
  cd "$repo"
  DISAGG_E2E_PROVIDER=kind KUBECONFIG="$kubeconfig" \
    DISAGG_E2E_CONTROL_PLANE_IMAGE="$control_plane_image" \
    DISAGG_E2E_WORKER_IMAGE="$stub_image" DISAGG_E2E_WORKER_IMAGE_NEXT="$stub_image_next" \
    "$python" -m pytest -p no:cacheprovider tests/test_e2e_helm.py "$@"
}

down() {
  need kind
  kind delete cluster --name "$name"
  rm -rf "$state"
}

case "${1:-all}" in
  up) up ;;
  images) images ;;
  test) shift; run_tests "$@" ;;
  down) down ;;
  all)
    up
    images
    run_tests
    down
    ;;
  *) log "usage: $0 [all|up|images|test [pytest args]|down]"; exit 2 ;;
esac
