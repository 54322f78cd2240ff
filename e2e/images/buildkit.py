"""BuildKit's daemon on a containerd: what e2e/images builds with (no Docker daemon).

buildkitd runs with the containerd worker only, so what it builds is stored by that containerd (content,
snapshots, images in the given namespace) and the images it exports are there at once, unpacked for the
snapshotter the kubelet's CRI uses. Its own state (cache metadata; the pip cache mounts live in
containerd's snapshots) stays under ``<cache_root>/buildkit-state/`` between runs, so a rebuild reuses
every unchanged step.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from ..localcluster.controlplane import cache_root

HERE = Path(__file__).resolve().parent
# BuildKit's cache collection, "reserved,min-free,max-used" in MB. Its default (and a bare reserved size)
# prunes down to the reserved size after every build, least recently used first, and the pip cache mount
# (torch and its CUDA wheels, ~5 GB) is the largest record no image holds: it was gone by the next build.
# Here nothing is pruned below 12 GB, nor while under 30 GB and the disk keeps 15 GB free.
GC_KEEP_STORAGE_MB = "12000,15000,30000"
START_TIMEOUT_S = 60


class BuildKitError(RuntimeError):
    pass


def binaries() -> Path:
    """The directory with buildkitd and buildctl, built from BuildKit's Go module first when not cached."""
    out = subprocess.run(["bash", str(HERE / "build-buildkit.sh")], stdout=subprocess.PIPE, text=True)
    if out.returncode != 0:
        raise BuildKitError("building BuildKit failed (e2e/images/build-buildkit.sh; its log is above)")
    return Path(out.stdout.strip().splitlines()[-1])


def state_dir(containerd_uuid: str, namespace: str) -> Path:
    """One state directory per containerd store and namespace, since BuildKit's records name that store's
    snapshots and leases. The store is known by the UUID containerd keeps in its root (its socket path
    changes with every cluster; the root, and so the images and this cache, persist)."""
    return cache_root() / "buildkit-state" / f"{containerd_uuid}-{namespace}"


@contextlib.contextmanager
def buildkitd(containerd_socket: str, containerd_uuid: str, namespace: str = "k8s.io",
              log=print) -> Iterator[list[str]]:
    """Runs buildkitd on the containerd for the duration; yields the buildctl command prefix.

    One daemon at a time per state directory (a file lock; a second caller waits). Stopped with SIGTERM
    (then SIGKILL) on exit, whatever happened inside."""
    if not Path(containerd_socket).is_socket():
        raise BuildKitError(f"no containerd socket at {containerd_socket}: start the node first")
    bin_dir = binaries()
    state = state_dir(containerd_uuid, namespace)
    state.mkdir(parents=True, exist_ok=True)
    with open(state / "lock", "w") as lock, tempfile.TemporaryDirectory(prefix="disagg-buildkit-") as run:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # The socket lives in a short temporary path: a Unix socket path must fit in 108 bytes.
        addr = f"unix://{run}/buildkitd.sock"
        argv = [str(bin_dir / "buildkitd"), "--root", str(state / "root"), "--addr", addr,
                "--oci-worker=false", "--containerd-worker=true",
                f"--containerd-worker-addr={containerd_socket}", f"--containerd-worker-namespace={namespace}",
                "--containerd-worker-snapshotter=overlayfs",
                # RUN steps use the host's network: the builds reach the package registries from here.
                "--containerd-worker-net=host",
                "--containerd-worker-gc", f"--containerd-worker-gc-keepstorage={GC_KEEP_STORAGE_MB}"]
        log_path = state / "buildkitd.log"
        with open(log_path, "w") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        buildctl = [str(bin_dir / "buildctl"), "--addr", addr]
        try:
            _wait_ready(proc, buildctl, log_path)
            log(f"[images] buildkitd {proc.pid} on {containerd_socket} (namespace {namespace}), log {log_path}")
            yield buildctl
        finally:
            _stop(proc)


def _wait_ready(proc: subprocess.Popen, buildctl: list[str], log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BuildKitError(f"buildkitd exited ({proc.returncode}):\n{log_path.read_text()[-3000:]}")
        # `debug workers` answers once the daemon serves and its containerd worker is up.
        out = subprocess.run([*buildctl, "debug", "workers"], capture_output=True, text=True)
        if out.returncode == 0 and len(out.stdout.strip().splitlines()) > 1:
            return
        time.sleep(0.2)
    raise BuildKitError(f"buildkitd did not answer in {START_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
