"""The project's images, built from its Dockerfile by BuildKit into a containerd's image store.

:func:`ensure_images` makes the Debian base (:mod:`.base`), and for each target whose image is not
already in the store starts buildkitd on that containerd (:mod:`.buildkit`) and builds it. An image is
tagged twice: ``disagg/<target>:<version>`` (what the chart and examples name) and
``disagg/<target>:<version>-<inputs>``, where ``<inputs>`` hashes everything that goes into it (the
Dockerfile, the build context the .dockerignore lets through, the base image's digest, BuildKit's
version). A target whose second tag is present is not built again.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import tempfile
import time
import tomllib
from pathlib import Path

from .base import STORE_ID, BaseImage, ensure_base, versions
from .buildkit import buildkitd, state_dir

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
# What runs on the local real node: the operator/planner/router image and the GPU-less worker.
# (The Dockerfile's GPU `worker` target is vLLM's CUDA image: never built here.)
TARGETS = ("control-plane", "worker-cpu")
REPOSITORY = "docker.io/disagg"
# The ARG naming the Python base of the Dockerfile's stages; the local base stands in for its default.
BASE_ARG = "PYTHON_IMAGE"
INPUTS_LABEL = "dev.disagg.image.inputs"
# Measured: the node's store grew by 21 GiB for a cold build of both targets (content 7, snapshots 14), and
# BuildKit's pip cache mount holds the worker's wheels (~5 GiB) beside it.
COLD_BUILD_DISK_GIB = 26


class ImageBuildError(RuntimeError):
    pass


def version() -> str:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def base_image_name() -> str:
    """The image the Dockerfile's Python stages start FROM by default (its ``ARG PYTHON_IMAGE=``)."""
    m = re.search(rf"^ARG {BASE_ARG}=(\S+)$", DOCKERFILE.read_text(), re.MULTILINE)
    if not m:
        raise ImageBuildError(f"the Dockerfile has no `ARG {BASE_ARG}=<image>` line")
    return m.group(1)


def context_files() -> list[Path]:
    """The files BuildKit sends as the build context, by the .dockerignore (in the form that file
    states: `*`, `!path` lines for what is sent, `**/name` lines for what is dropped everywhere)."""
    sent, dropped = [], []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if line.startswith("!"):
            sent.append(REPO / line[1:])
        elif line.startswith("**/"):
            dropped.append(line[3:])
        elif line and not line.startswith("#") and line != "*":
            raise ImageBuildError(f".dockerignore: {line!r} is not in the form e2e/images/build.py reads")
    files = []
    for top in sent:
        candidates = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file())
        for p in candidates:
            if not any(part_matches(part, dropped) for part in p.relative_to(REPO).parts):
                files.append(p)
    return files


def part_matches(name: str, patterns: list[str]) -> bool:
    return any(Path(name).match(pattern) for pattern in patterns)


def snapshot_context(dest: Path) -> str:
    """Copies the Dockerfile, the .dockerignore and the files it lets through into ``dest`` and returns
    their digest. BuildKit is given this copy, so an image holds exactly what its tag's hash says even
    when the working tree changes during a build."""
    h = hashlib.sha256()
    for p in [DOCKERFILE, DOCKERIGNORE, *context_files()]:
        rel = p.relative_to(REPO)
        data = p.read_bytes()
        h.update(str(rel).encode() + b"\0")
        h.update(hashlib.sha256(data).digest())
        out = dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(data)
        shutil.copystat(p, out)     # mode (COPY keeps it) and times
    return h.hexdigest()


def inputs_hash(target: str, base: BaseImage, context_digest: str) -> str:
    """What a target's image is made of: its name, the base image, BuildKit's version and the context."""
    key = f"{target}\0{base.digest}\0{versions()['BUILDKIT_VERSION']}\0{context_digest}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def pinned_ref(target: str, log=print) -> str:
    """The input-pinned name :func:`ensure_images` gives the target's image built from this tree; no store
    is touched."""
    base = ensure_base(log)
    with tempfile.TemporaryDirectory(prefix="disagg-context-") as context:
        digest = snapshot_context(Path(context))
    return f"{REPOSITORY}/{target}:{version()}-{inputs_hash(target, base, digest)}"


class Store:
    """The containerd image store, through containerd's own client (ctr)."""

    def __init__(self, ctr: str, socket: str, namespace: str):
        self.base = [ctr, "--address", socket, "--namespace", namespace]

    def _run(self, *args: str) -> str:
        out = subprocess.run([*self.base, *args], capture_output=True, text=True)
        if out.returncode != 0:
            raise ImageBuildError(f"ctr {' '.join(args)} failed: {out.stderr.strip()}")
        return out.stdout

    def digests(self) -> dict[str, str]:
        """Every image name in the namespace and its digest."""
        lines = self._run("images", "ls").splitlines()[1:]
        return {cols[0]: cols[2] for cols in (line.split() for line in lines) if len(cols) >= 3}

    def uuid(self) -> str:
        """The containerd's UUID (made once and kept in its root directory)."""
        for line in self._run("version").splitlines():
            if line.strip().startswith("UUID:"):
                return line.split(":", 1)[1].strip()
        raise ImageBuildError("`ctr version` shows no server UUID")

    def tag(self, source: str, target: str) -> None:
        self._run("images", "tag", "--force", source, target)

    def remove(self, names: list[str]) -> None:
        """Untags the images and waits for containerd's collection of what no other image holds."""
        if names:
            self._run("images", "rm", "--sync", *names)


def stale_images(names, targets, current: set[str]) -> list[str]:
    """The input-pinned tags of the targets' images other than the current ones."""
    pinned = re.compile(f"{re.escape(REPOSITORY)}/({'|'.join(map(re.escape, targets))}):.+-[0-9a-f]{{16}}")
    return sorted(name for name in names if pinned.fullmatch(name) and name not in current)


def default_ctr() -> str:
    """containerd's client from the local node's binaries (built with containerd)."""
    out = subprocess.run(["bash", str(REPO / "e2e" / "localcluster" / "build-node.sh")],
                         stdout=subprocess.PIPE, text=True)
    if out.returncode != 0:
        raise ImageBuildError("building the node's binaries failed (e2e/localcluster/build-node.sh)")
    return str(Path(out.stdout.strip().splitlines()[-1]) / "ctr")


def ensure_images(containerd_socket: str, namespace: str = "k8s.io", targets: tuple[str, ...] = TARGETS,
                  ctr: str | None = None, log=print) -> dict[str, str]:
    """Each target's image reference (``docker.io/disagg/<target>:<version>``), built into the containerd
    at ``containerd_socket`` unless an image of the same inputs is there already."""
    started = time.monotonic()
    store = Store(ctr or default_ctr(), containerd_socket, namespace)
    base = ensure_base(log)
    tag = version()
    with tempfile.TemporaryDirectory(prefix="disagg-context-") as context:
        context_digest = snapshot_context(Path(context))
        refs, todo, current = {}, [], set()
        present = store.digests()
        for target in targets:
            inputs = inputs_hash(target, base, context_digest)
            ref, pinned = f"{REPOSITORY}/{target}:{tag}", f"{REPOSITORY}/{target}:{tag}-{inputs}"
            refs[target] = ref
            current.add(pinned)
            if pinned not in present:
                todo.append((target, ref, pinned, inputs))
            elif present.get(ref) != present[pinned]:
                store.tag(pinned, ref)      # the version tag was moved by a build of other inputs: move it back
                log(f"[images] {target}: reusing {pinned}")
            else:
                log(f"[images] {target}: {ref} is up to date ({inputs})")
        if todo:
            store_uuid = store.uuid()
            with buildkitd(containerd_socket, store_uuid, namespace, log) as buildctl:
                for target, ref, pinned, inputs in todo:
                    build(buildctl, Path(context), target, [ref, pinned], base, inputs,
                          state_dir(store_uuid, namespace) / f"build-{target}.log", log)
            missing = [pinned for _, _, pinned, _ in todo if pinned not in store.digests()]
            if missing:
                raise ImageBuildError(f"BuildKit finished but containerd has no {', '.join(missing)}")
        # Every commit that changes the context makes new images; the ones they replace would keep their own
        # layers (the CPU worker's are GBs) on the node's disk for ever.
        stale = stale_images(store.digests(), targets, current)
        if stale:
            store.remove(stale)
            log(f"[images] removed replaced images: {', '.join(stale)}")
    log(f"[images] ready in {time.monotonic() - started:.0f} s: {', '.join(refs.values())}")
    return refs


def build(buildctl: list[str], context: Path, target: str, names: list[str], base: BaseImage, inputs: str,
          log_path: Path, log=print) -> None:
    argv = [*buildctl, "build", "--progress", "plain",
            "--frontend", "dockerfile.v0", "--local", f"context={context}", "--local", f"dockerfile={context}",
            "--opt", f"target={target}",
            # The locally made Debian base stands in for the Dockerfile's Python image (named context).
            "--oci-layout", f"{STORE_ID}={base.layout}",
            "--opt", f"context:{base_image_name()}={base.context()}",
            "--opt", f"label:{INPUTS_LABEL}={inputs}",
            # Straight into containerd's store, unpacked for the kubelet's snapshotter; layers stay
            # uncompressed (gzip of the CPU worker's ~7 GB costs minutes on two cores, and nothing is pushed).
            "--output", f'type=image,"name={",".join(names)}",unpack=true,compression=uncompressed,'
                        "oci-mediatypes=true"]
    log(f"[images] building {target} (log {log_path})")
    started = time.monotonic()
    with open(log_path, "w") as out:
        rc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = log_path.read_text()[-4000:]
        if "no space left on device" in tail:
            free = shutil.disk_usage(log_path.parent).free / 2**30
            raise ImageBuildError(
                f"building {target} ran out of disk: {free:.1f} GiB free under {log_path.parent} now. A cold "
                f"build of the CPU worker needs about {COLD_BUILD_DISK_GIB} GiB free there (its layers are "
                f"written to containerd's content store, unpacked into its snapshots, and held in BuildKit's "
                f"cache); free some, or move the cache with XDG_CACHE_HOME. The end of {log_path}:\n{tail}")
        raise ImageBuildError(f"building {target} failed ({rc}); the end of {log_path}:\n{tail}")
    log(f"[images] built {target} in {time.monotonic() - started:.0f} s")
