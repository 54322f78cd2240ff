#!/usr/bin/env bash
# guidellm's own environment for bench/field_clients.py --guidellm (bench only; nothing in `make test` uses it).
#
# guidellm 0.8.1 cannot share the project's environment (it pins click~=8.4, the project another) and it
# imports torch (its data loaders are torch DataLoaders), so it gets its own venv, cached like aiperf's.
# torch is the problem: the CPU-only wheel index is not reachable from here, and the registry's torch is the
# CUDA build, which with triton and the nvidia-* libraries it pulls in is about 4.6 GB installed, over this
# machine's disk budget for a bench client. So the venv installs guidellm and its pinned closure without torch
# (bench/guidellm-requirements.txt, --no-deps) and borrows the worker environment's torch (the same registry
# build, already on disk, imported read-only) through a .pth file naming a folder of links to it: about 0.6 GB
# new instead of 5.
#
#   bash bench/guidellm_env.sh            # into ~/.cache/disagg/guidellm-env (DISAGG_GUIDELLM_ENV to move it)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(dirname "$here")"
env_dir="${DISAGG_GUIDELLM_ENV:-$HOME/.cache/disagg/guidellm-env}"
worker_python="$("$repo/.venv/bin/python" -c 'from disagg.workers.envpath import worker_python; print(worker_python())')"
worker_site="$("$worker_python" -P -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
for pkg in torch torchgen functorch triton nvidia; do
    [ -e "$worker_site/$pkg" ] || { echo "guidellm_env: $worker_site has no $pkg (build the worker environment first)" >&2; exit 1; }
done
python3 -m venv "$env_dir"
"$env_dir/bin/pip" install --quiet --no-cache-dir --no-deps -r "$here/guidellm-requirements.txt"
borrowed="$env_dir/borrowed-torch"
rm -rf "$borrowed" && mkdir -p "$borrowed"
for pkg in torch torchgen functorch triton nvidia; do ln -s "$worker_site/$pkg" "$borrowed/$pkg"; done
site="$("$env_dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$borrowed" > "$site/borrowed-torch.pth"
"$env_dir/bin/python" -P -c 'import torch, guidellm; from importlib.metadata import version; print("guidellm", version("guidellm"), "torch", torch.__version__)'
du -sh "$env_dir"
