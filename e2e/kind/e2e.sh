#!/usr/bin/env bash
# The end-to-end suite on kind. Everything comes from this machine: Debian's Docker engine started for
# the run and stopped after it (engine.sh), kind and kubeadm from their Go modules (build.sh), and a
# node image built from the project's own binaries (node-image.sh). See e2e/kind/README.md.
#
#   bash e2e/kind/e2e.sh          # engine, node image, up, images, test, down, engine stop
#   bash e2e/kind/e2e.sh up       # start the engine, create the cluster and advertise its GPUs
#   bash e2e/kind/e2e.sh images   # build the Dockerfile's targets and the stub worker, load them into kind
#   bash e2e/kind/e2e.sh test     # run tests/test_e2e_helm.py with DISAGG_E2E_PROVIDER=kind
#   bash e2e/kind/e2e.sh down     # delete the cluster and its network, stop the engine
#
# Environment: DISAGG_KIND_KEEP=1 (keep the cluster and engine when a step fails), KIND_CLUSTER_NAME
# (disagg-e2e), KIND_NODE_IMAGE (default: the image node-image.sh builds for the local control plane's
# Kubernetes version), DISAGG_E2E_SKIP_WORKER_IMAGE=1 (do not build and load the vLLM worker image, about
# 10 GB; skipped anyway where its vLLM base cannot be had: the suite's pods run the stub worker),
# DISAGG_E2E_SKIP_CPU_WORKER_IMAGE=1 (do not stream the CPU worker image onto its node: the tiny model's
# serving test skips), DISAGG_REAL_NODE_LOCK (a file locked while the real node's store builds that image),
# DISAGG_E2E_TOKENIZER (a tokenizer the nodes can download, for the examples' routers), PYTHON
# (.venv/bin/python), DOCKER_HOST (an engine of your own; engine.sh's is started when unset).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
name="${KIND_CLUSTER_NAME:-disagg-e2e}"
state="${DISAGG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/disagg}/kind/$name"
kubeconfig="$state/kubeconfig"
python="${PYTHON:-$repo/.venv/bin/python}"
version="$(sed -n 's/^version: //p' "$repo/charts/disagg/Chart.yaml")"
control_plane_image="disagg/control-plane:$version"
worker_image="disagg/worker:$version"
stub_image="disagg/e2e-stub-worker:$version"
stub_image_next="disagg/e2e-stub-worker:$version-next"
# kind's network, made before kind would make it: its own bridge name and addresses off the private
# ranges and off this machine's own (engine.sh says which).
kind_network=kind
kind_subnet=198.51.100.0/24
kind_bridge=disagg-kind0

log() { printf '[kind-e2e] %s\n' "$*" >&2; }
stage_start=$SECONDS
stage() {  # stage NAME: logs how long the previous stage took, then NAME
  log "stage done in $((SECONDS - stage_start)) s; next: $1"
  stage_start=$SECONDS
}

# kind and kubeadm's build (build.sh), kubectl and helm from the local control plane's (PATH first).
tools() {
  local kind_bin k8s_bin
  kind_bin="$(bash "$here/build.sh")"
  k8s_bin="$(bash "$repo/e2e/localcluster/build.sh")"
  export PATH="$PATH:$kind_bin:$k8s_bin"
  command -v kind >/dev/null || export PATH="$kind_bin:$PATH"
}

# The engine: the caller's (DOCKER_HOST set) or engine.sh's, started here.
engine_started=""
engine() {
  if [[ -z "${DOCKER_HOST:-}" ]]; then
    export "$(bash "$here/engine.sh" start)"
    engine_started=1
  fi
}
engine_stop() {
  if [[ -n "$engine_started" ]]; then
    bash "$here/engine.sh" stop
    engine_started=""
  fi
}


need() {
  local tool
  for tool in "$@"; do
    command -v "$tool" >/dev/null || { log "missing: $tool (see e2e/kind/README.md)"; exit 2; }
  done
}

kctl() { kubectl --kubeconfig "$kubeconfig" "$@"; }

# Advertise each GPU-labelled node's GPUs (its nvidia.com/gpu.count label) as the extended resource
# nvidia.com/gpu: a JSON patch of the node's status, as the Kubernetes docs on extended resources describe
# (kubectl's --subresource=status in place of their curl through `kubectl proxy`). kind nodes have no
# device plugin, so nothing takes it away again. Retried: right after `kind create` a node's status is
# still being written by its kubelet and the API server may answer 500 or a conflict.
advertise_gpus() {
  local node count ok
  for node in $(kctl get nodes -l nvidia.com/gpu.present=true -o jsonpath='{.items[*].metadata.name}'); do
    count="$(kctl get node "$node" -o jsonpath='{.metadata.labels.nvidia\.com/gpu\.count}')"
    log "node $node: nvidia.com/gpu=$count"
    ok=""
    for _ in $(seq 30); do
      if kctl patch node "$node" --subresource=status --type=json \
        -p "[{\"op\": \"add\", \"path\": \"/status/capacity/nvidia.com~1gpu\", \"value\": \"$count\"}]" >/dev/null; then
        ok=1
        break
      fi
      sleep 2
    done
    [[ -n "$ok" ]] || { log "could not advertise nvidia.com/gpu on $node"; exit 1; }
  done
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
  need docker kind kubectl
  mkdir -p "$state"
  if kind get clusters 2>/dev/null | grep -qx "$name"; then
    log "cluster $name exists: reused"
  else
    local node_image="${KIND_NODE_IMAGE:-}"
    if [[ -z "$node_image" ]]; then
      log "building the node image (node-image.sh)"
      node_image="$(bash "$here/node-image.sh")"
      stage "cluster"
    fi
    if ! docker network inspect "$kind_network" >/dev/null 2>&1; then
      docker network create --driver bridge --subnet "$kind_subnet" \
        -o com.docker.network.bridge.name="$kind_bridge" \
        -o com.docker.network.bridge.enable_ip_masquerade=false "$kind_network" >/dev/null
    fi
    log "creating cluster $name from $here/cluster.yaml ($node_image)"
    kind create cluster --name "$name" --config "$here/cluster.yaml" --image "$node_image" --wait 300s \
      --kubeconfig "$kubeconfig"
  fi
  kind get kubeconfig --name "$name" >"$kubeconfig"
  chmod 600 "$kubeconfig"
  advertise_gpus
  log "KUBECONFIG=$kubeconfig"
}

cpu_nodes() {
  kctl get nodes -l topology.disagg.dev/pool=cpu -o jsonpath='{.items[*].metadata.name}' | tr ' ' ','
}

gpu_nodes() {
  kctl get nodes -l nvidia.com/gpu.present=true -o jsonpath='{.items[*].metadata.name}' | tr ' ' ','
}

# The CPU worker image (vLLM's CPU build) goes onto one node only, the one 8-GPU node of NVLink domain
# ...-nvl-1 (cluster.yaml), where the tiny model's prefill and decode pods are pinned: each node that holds
# it keeps its own unpacked copy, about 7 GB.
cpu_worker_ref() {  # the name e2e/images gives it
  (cd "$repo" && "$python" -c 'from disagg.e2e.images.build import REPOSITORY, version
print(f"{REPOSITORY}/worker-cpu:{version()}")')
}
cpu_worker_node() {
  kctl get nodes -l nvidia.com/gpu.clique=h100.zone-a-rack-0-nvl-1 -o jsonpath='{.items[0].metadata.name}'
}
# What streaming it needs free where the engine keeps the nodes' volumes: the unpacked image (about
# 7 GB), its compressed layers until they are discarded (about 3 GB), and room left for everything else.
cpu_worker_free_gib=14

# The CPU worker image from the real node's store (e2e/images/stream.py: built there by the project's
# BuildKit when that store lacks the current inputs), streamed into the node's containerd: no copy in the
# engine's store, no tarball; the importer drops the compressed layers once unpacked.
cpu_worker() {
  local node free cpu_worker_image
  cpu_worker_image="$(cpu_worker_ref)"
  if [[ "${DISAGG_E2E_SKIP_CPU_WORKER_IMAGE:-0}" == 1 ]]; then
    log "skipping $cpu_worker_image (DISAGG_E2E_SKIP_CPU_WORKER_IMAGE=1)"
    return
  fi
  free=$(($(df --output=avail -k "$(docker info --format '{{.DockerRootDir}}')" | tail -1) / 1024 / 1024))
  if ((free < cpu_worker_free_gib)); then
    log "skipping $cpu_worker_image: $free GiB free for the engine's data, streaming it needs $cpu_worker_free_gib"
    return
  fi
  node="$(cpu_worker_node)"
  log "streaming $cpu_worker_image from the real node's store into $node"
  (cd "$repo" && "$python" -m disagg.e2e.images.stream worker-cpu) |
    docker exec -i "$node" ctr --namespace=k8s.io images import --local --all-platforms --discard-unpacked-layers \
      --snapshotter=overlayfs - >/dev/null
  docker exec "$node" ctr --namespace=k8s.io images ls -q "name==$cpu_worker_image" | grep -qx "$cpu_worker_image" ||
    { log "$cpu_worker_image is not in $node's containerd after the import"; exit 1; }
}

# docker build with BuildKit (the Dockerfile's RUN --mount lines need it): Debian's docker.io client
# (20.10) builds through the engine's own BuildKit; a newer client without the buildx plugin cannot.
# RUN steps use the host's network (the engine's only network is kind's, which reaches nothing).
build() {
  local client=docker
  [[ -x /usr/bin/docker ]] && client=/usr/bin/docker
  DOCKER_BUILDKIT=1 "$client" build --network host "$@"
}

# The Dockerfile's Python base (python:3.11-slim-bookworm, and the stub worker's python:3.11-slim), where
# no registry serves it: the project's own Debian base (e2e/images/base.py, mmdebstrap), imported once.
base_images() {
  local layer
  docker image inspect python:3.11-slim-bookworm >/dev/null 2>&1 && return
  layer="$(cd "$repo" && "$python" -c '
import json, sys
from disagg.e2e.images.base import ensure_base
b = ensure_base(log=lambda *a: print(*a, file=sys.stderr))
index = json.loads((b.layout / "index.json").read_text())
blob = lambda d: b.layout / "blobs" / "sha256" / d.removeprefix("sha256:")
manifest = json.loads(blob(b.digest).read_text())
print(blob(manifest["layers"][0]["digest"]))
')"
  log "importing the project's Debian base as python:3.11-slim-bookworm"
  docker import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' "$layer" disagg.local/debian-python:base >/dev/null
  # The official image's `python` command (the stub worker's entrypoint runs it); Debian names it python3.
  printf 'FROM disagg.local/debian-python:base\nRUN ln -s /usr/bin/python3 /usr/local/bin/python\n' |
    build -t python:3.11-slim-bookworm -
  docker tag python:3.11-slim-bookworm python:3.11-slim
}

images() {
  need docker kind kubectl
  [[ -x "$python" ]] || { log "no $python: run \`make venv\` first"; exit 2; }
  base_images
  log "building $control_plane_image (Dockerfile target control-plane)"
  build --target control-plane -t "$control_plane_image" "$repo"
  log "building $stub_image (e2e/kind/stub-worker)"
  build -t "$stub_image" "$here/stub-worker"
  docker tag "$stub_image" "$stub_image_next"
  # Each image onto the nodes that run it (every node unpacks its own copy): the control-plane image
  # (operator, planner, routers) onto the CPU pool, the worker stub onto the GPU nodes.
  kind load docker-image --name "$name" --nodes "$(cpu_nodes)" "$control_plane_image"
  kind load docker-image --name "$name" --nodes "$(gpu_nodes)" "$stub_image" "$stub_image_next"
  # The GPU worker image starts FROM vLLM's CUDA image: built where that image can be had (present in
  # the engine or pulled), skipped with a note where no registry serves it (the suite runs the stub).
  local vllm_image
  vllm_image="$(sed -n 's/^ARG VLLM_IMAGE=//p' "$repo/Dockerfile")"
  if [[ "${DISAGG_E2E_SKIP_WORKER_IMAGE:-0}" != 1 ]] && ! docker image inspect "$vllm_image" >/dev/null 2>&1 &&
    ! timeout 600 docker pull "$vllm_image" >/dev/null; then
    log "skipping $worker_image: its base $vllm_image is not available here (no registry serves it)"
  elif [[ "${DISAGG_E2E_SKIP_WORKER_IMAGE:-0}" != 1 ]]; then
    log "building $worker_image (Dockerfile target worker; vLLM, large)"
    build --target worker -t "$worker_image" "$repo"
    kind load docker-image --name "$name" --nodes "$(gpu_nodes)" "$worker_image"
  fi
  cpu_worker
}

# The nodes reach no model hub: the tiny model (workers/tinymodel.py, 2 MB; made once by the worker
# environment, which a machine without it builds first, as `make test` does) goes into every node at
# $model_node_dir. The provider gives each test namespace a read-only volume of it: the examples' routers
# load its tokenizer (unless DISAGG_E2E_TOKENIZER names one the nodes can download), the tiny model's
# workers the model.
model_node_dir=/disagg-e2e/tiny-model
tiny_model() {
  local dir node
  dir="$(cd "$repo" && "$python" -c '
from disagg.workers.tinymodel import cache_dir, ensure
if (cache_dir() / ".complete").exists():
    print(cache_dir())
else:  # made once by the worker environment (built first when missing, as make test does)
    from disagg.workers.envpath import worker_python
    print(ensure(worker_python()))')"
  for node in $(kind get nodes --name "$name"); do
    docker exec "$node" mkdir -p "$model_node_dir"
    docker cp "$dir/." "$node:$model_node_dir/"
    docker exec "$node" chmod -R a+rX "$model_node_dir"
  done
  export DISAGG_E2E_MODEL_NODE_DIR="$model_node_dir"
}

run_tests() {
  [[ -x "$python" ]] || { log "no $python: run \`make venv\` first"; exit 2; }
  tiny_model
  local node cpu_worker_image
  node="$(cpu_worker_node)"
  cpu_worker_image="$(cpu_worker_ref)"
  if docker exec "$node" ctr --namespace=k8s.io images ls -q "name==$cpu_worker_image" | grep -qx "$cpu_worker_image"; then
    export DISAGG_E2E_CPU_WORKER_IMAGE="$cpu_worker_image" DISAGG_E2E_CPU_WORKER_NODE="$node"
  fi
  log "running tests/test_e2e_helm.py on kind"
  cd "$repo"
  DISAGG_E2E_PROVIDER=kind KUBECONFIG="$kubeconfig" \
    DISAGG_E2E_CONTROL_PLANE_IMAGE="$control_plane_image" \
    DISAGG_E2E_WORKER_IMAGE="$stub_image" DISAGG_E2E_WORKER_IMAGE_NEXT="$stub_image_next" \
    "$python" -m pytest -p no:cacheprovider tests/test_e2e_helm.py "$@"
}

down() {
  need kind
  kind delete cluster --name "$name" --kubeconfig "$kubeconfig"
  docker network rm "$kind_network" >/dev/null 2>&1 || true
  # the nodes' /var volumes (kind removes them with the nodes; an interrupted run may leave some)
  docker volume prune -f >/dev/null 2>&1 || true
  rm -rf "$state"
}

# The end of `all`: everything it made goes, unless a step failed and DISAGG_KIND_KEEP=1.
finish() {
  local rc=$?
  set +e
  if [[ $rc != 0 && "${DISAGG_KIND_KEEP:-0}" == 1 ]]; then
    log "kept for a look (DOCKER_HOST=$DOCKER_HOST; \`bash e2e/kind/e2e.sh down\` removes it)"
  else
    down
    engine_stop
  fi
  log "total $SECONDS s"
  exit "$rc"
}

tools
case "${1:-all}" in
  up) engine; up ;;
  images) engine; images ;;
  test) shift; engine; run_tests "$@" ;;
  down)
    engine
    down
    engine_stop
    ;;
  all)
    # Whatever happens, the cluster, its network and the engine go at the end (DISAGG_KIND_KEEP=1 keeps
    # them after a failure, for a look; `e2e.sh down` removes them then).
    trap finish EXIT
    engine
    stage "up"
    up
    stage "images"
    images
    stage "test"
    run_tests
    stage "down"
    ;;
  *) log "usage: $0 [all|up|images|test [pytest args]|down]"; exit 2 ;;
esac
