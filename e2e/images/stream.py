"""One of the project's images, from the real node's containerd store to a pipe, as an OCI archive.

``python -m disagg.e2e.images.stream worker-cpu | ctr images import -`` is how the kind provider puts the
CPU worker image (about 7 GB unpacked) into a kind node without a copy in Docker's store or a tarball on
disk. The image of this tree's inputs is read from the real node's store as it is (nothing there is tagged
or removed); only when the store lacks it does :func:`ensure_images` build it there first. The blobs are
opened there and streamed. Large layers travel zstd-compressed (the real node keeps them uncompressed, see
build.py): the worker's 6.3 GiB layer as about 3 GiB, which the importing containerd's content store holds
only until ``--discard-unpacked-layers`` lets it go.

The real node's store is only reachable through a containerd on its root. When a local cluster's real
node runs, its containerd is used; otherwise one is started on that root for the moment it takes to check
the image and open its blobs, with its own socket and state, no CRI, under the real node's machine lock
(a cluster that starts its real node meanwhile waits for it). The opened blobs are read after that
containerd has stopped: content is immutable and an open file outlives a deletion.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import BinaryIO, Iterator

from ..localcluster.controlplane import cache_root
from ..localcluster.node import CONTAINERD_NAMESPACE, RealNode, node_binaries
from .build import TARGETS, ImageBuildError, ensure_images, pinned_ref

MANIFEST = "application/vnd.oci.image.manifest.v1+json"
INDEX = "application/vnd.oci.image.index.v1+json"
LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
UNCOMPRESSED = ("application/vnd.oci.image.layer.v1.tar", "application/vnd.docker.image.rootfs.diff.tar")
# Layers below this travel as they are: compressing them saves little and costs a pass.
COMPRESS_FROM_BYTES = 64 * 2**20
ZSTD = ["zstd", "-1", "-T0", "-q", "-c"]   # fast; deterministic for the same input, level and threads
START_TIMEOUT_S = 60
LOCK_ENV = "DISAGG_REAL_NODE_LOCK"


@contextlib.contextmanager
def _locked(path: str | None) -> Iterator[None]:
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


@contextlib.contextmanager
def real_node_store(log=print) -> Iterator[tuple[str, Path]]:
    """(socket, content root) of a containerd serving the real node's image store, for the duration."""
    node = RealNode(Path(tempfile.gettempdir()) / "disagg-store-unused")
    bins = node_binaries()
    ctr = [str(bins / "ctr")]
    with node._machine_lock():
        owner = node._owner()
        if owner and node._owner_alive(owner):
            socket = Path(owner["state_dir"]) / "run" / "containerd.sock"
            _wait_serving(ctr, socket, None)
            log(f"[stream] using the running real node's containerd ({socket})")
            yield str(socket), node.root
            return
        with tempfile.TemporaryDirectory(prefix="disagg-store-") as tmp:
            socket = Path(tmp) / "containerd.sock"
            config = Path(tmp) / "containerd.toml"
            config.write_text(f"""\
version = 3
root = '{node.root}'
state = '{tmp}/state'
imports = []
# The store only: no CRI (it would restore the node's pods), nothing that creates machine-wide paths.
disabled_plugins = ['io.containerd.internal.v1.opt', 'io.containerd.nri.v1.nri', 'io.containerd.cri.v1.images',
                    'io.containerd.cri.v1.runtime', 'io.containerd.grpc.v1.cri',
                    'io.containerd.podsandbox.controller.v1.podsandbox']
[grpc]
  address = '{socket}'
[ttrpc]
  address = '{socket}.ttrpc'
""")
            with open(Path(tmp) / "containerd.log", "w") as out:
                proc = subprocess.Popen([str(bins / "containerd"), f"--config={config}"], stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True,
                                        env={**os.environ, "PATH": f"{bins}:{os.environ.get('PATH', '')}"})
            try:
                _wait_serving(ctr, socket, proc, Path(tmp) / "containerd.log")
                log(f"[stream] containerd {proc.pid} on the real node's store ({node.root})")
                yield str(socket), node.root
            finally:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                for m in _mounts_under(Path(tmp)):
                    subprocess.run(["umount", "--lazy", m], check=False)


def _mounts_under(root: Path) -> list[str]:
    points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    return sorted((p for p in points if p == str(root) or p.startswith(f"{root}/")), key=len, reverse=True)


def _wait_serving(ctr: list[str], socket: Path, proc: subprocess.Popen | None, log_path: Path | None = None) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ImageBuildError(f"containerd on the real node's store exited ({proc.returncode}):\n"
                                  f"{log_path.read_text()[-3000:] if log_path else ''}")
        if subprocess.run([*ctr, "--address", str(socket), "version"], capture_output=True).returncode == 0:
            return
        time.sleep(0.2)
    raise ImageBuildError(f"no containerd answered at {socket} within {START_TIMEOUT_S} s")


class Blob:
    """A content-store blob held open: its descriptor fields and the open file."""

    def __init__(self, desc: dict, file: BinaryIO):
        self.desc, self.file = desc, file


def open_image(target: str, log=print) -> tuple[str, bytes, list[Blob]]:
    """The target's image built from this tree: its name, config and open layers, opened before the store's
    containerd stops. Where the store holds it already, it is only read (a running real node's tests are
    not disturbed: no tag moves); otherwise :func:`ensure_images` builds it first, with the file that
    ``LOCK_ENV`` names locked, where several users' test runs share the real node and serialize on one."""
    pinned = pinned_ref(target, log)
    ref = pinned.rsplit("-", 1)[0]
    opened = _open(pinned, ref, log)
    if opened is None:
        with _locked(os.environ.get(LOCK_ENV)):
            opened = _open(pinned, ref, log, build=target)
    if opened is None:
        raise ImageBuildError(f"{pinned} is not in the real node's store after ensure_images")
    return opened


def _open(pinned: str, ref: str, log, build: str = "") -> tuple[str, bytes, list[Blob]] | None:
    with real_node_store(log) as (socket, root):
        ctr = str(node_binaries() / "ctr")
        if build:
            ensure_images(socket, CONTAINERD_NAMESPACE, (build,), ctr=ctr, log=log)
        base = [ctr, "--address", socket, "--namespace", CONTAINERD_NAMESPACE]
        lines = subprocess.run([*base, "images", "ls"], capture_output=True, text=True, check=True).stdout
        digest = {c[0]: c[2] for c in (line.split() for line in lines.splitlines()[1:]) if len(c) >= 3}.get(pinned)
        if not digest:
            return None
        log(f"[stream] {pinned} in the real node's store")

        def content(d: str) -> bytes:
            return subprocess.run([*base, "content", "get", d], capture_output=True, check=True).stdout
        manifest = json.loads(content(digest))
        if manifest.get("mediaType") == INDEX or "manifests" in manifest:
            (entry,) = [m for m in manifest["manifests"] if m.get("platform", {}).get("os", "linux") == "linux"
                        and m.get("platform", {}).get("architecture", "amd64") == "amd64"]
            manifest = json.loads(content(entry["digest"]))
        config = content(manifest["config"]["digest"])
        blobs = root / "io.containerd.content.v1.content" / "blobs" / "sha256"
        layers = []
        for desc in manifest["layers"]:
            path = blobs / desc["digest"].removeprefix("sha256:")
            f = open(path, "rb")
            if os.fstat(f.fileno()).st_size != desc["size"]:
                raise ImageBuildError(f"{pinned}: layer {desc['digest']} is {os.fstat(f.fileno()).st_size} bytes "
                                      f"in {path}, its manifest says {desc['size']}")
            layers.append(Blob(desc, f))
    return ref, config, layers


class _Hashing(io.RawIOBase):
    """Reads through ``stream``, hashing and counting what passes."""

    def __init__(self, stream: BinaryIO):
        self.stream, self.sha, self.size = stream, hashlib.sha256(), 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = self.stream.read(len(b))
        n = len(data)
        b[:n] = data
        self.sha.update(data)
        self.size += n
        return n


@contextlib.contextmanager
def _zstd(f: BinaryIO) -> Iterator[BinaryIO]:
    f.seek(0)
    proc = subprocess.Popen(ZSTD, stdin=f, stdout=subprocess.PIPE)
    try:
        yield proc.stdout
    finally:
        proc.stdout.close()
        if proc.wait() not in (0, -signal.SIGPIPE):
            raise ImageBuildError(f"zstd exited {proc.returncode}")


def _compressed_desc(layer: Blob) -> dict:
    """The layer's descriptor once compressed (a first pass that only counts and hashes)."""
    with _zstd(layer.file) as out:
        h = _Hashing(out)
        while h.read(1 << 20):
            pass
    return {"mediaType": LAYER_ZSTD, "digest": f"sha256:{h.sha.hexdigest()}", "size": h.size}


def _info(name: str, size: int = 0, directory: bool = False) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE if directory else tarfile.REGTYPE
    info.mode, info.size, info.mtime = (0o755 if directory else 0o644), size, 0
    return info


def write_archive(out: BinaryIO, ref: str, config: bytes, layers: list[Blob], log=print) -> None:
    """An OCI image-layout tar of the image on ``out``, written as it is read: layers first, the small
    documents last (containerd's importer takes the members in any order)."""
    if layers and not shutil.which(ZSTD[0]):
        raise ImageBuildError("zstd not found: apt-get install zstd")
    started = time.monotonic()
    sent = []
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for d in ("blobs", "blobs/sha256"):
            tar.addfile(_info(d, directory=True))
        for layer in layers:
            desc = layer.desc
            if desc["mediaType"] in UNCOMPRESSED and desc["size"] >= COMPRESS_FROM_BYTES:
                new = _compressed_desc(layer)
                with _zstd(layer.file) as stream:
                    h = _Hashing(stream)
                    tar.addfile(_info(f"blobs/sha256/{new['digest'].removeprefix('sha256:')}", new["size"]), h)
                if f"sha256:{h.sha.hexdigest()}" != new["digest"]:
                    raise ImageBuildError(f"zstd gave {desc['digest']} two different outputs")
                log(f"[stream] layer {desc['digest'][:19]}: {desc['size'] / 2**30:.2f} GiB sent as "
                    f"{new['size'] / 2**30:.2f} GiB (zstd)")
                sent.append(new)
            else:
                layer.file.seek(0)
                tar.addfile(_info(f"blobs/sha256/{desc['digest'].removeprefix('sha256:')}", desc["size"]),
                            layer.file)
                sent.append({k: desc[k] for k in ("mediaType", "digest", "size")})
        docs = {}
        config_desc = {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": f"sha256:{hashlib.sha256(config).hexdigest()}", "size": len(config)}
        docs[config_desc["digest"]] = config
        manifest = json.dumps({"schemaVersion": 2, "mediaType": MANIFEST, "config": config_desc,
                               "layers": sent}).encode()
        manifest_digest = f"sha256:{hashlib.sha256(manifest).hexdigest()}"
        docs[manifest_digest] = manifest
        cfg = json.loads(config)
        index = {"schemaVersion": 2, "mediaType": INDEX, "manifests": [{
            "mediaType": MANIFEST, "digest": manifest_digest, "size": len(manifest),
            "platform": {"architecture": cfg.get("architecture", "amd64"), "os": cfg.get("os", "linux")},
            "annotations": {"io.containerd.image.name": ref,
                            "org.opencontainers.image.ref.name": ref.rsplit(":", 1)[-1]}}]}
        members = {**{f"blobs/sha256/{d.removeprefix('sha256:')}": data for d, data in docs.items()},
                   "oci-layout": b'{"imageLayoutVersion": "1.0.0"}', "index.json": json.dumps(index).encode()}
        for name, data in members.items():
            tar.addfile(_info(name, len(data)), io.BytesIO(data))
    for layer in layers:
        layer.file.close()
    log(f"[stream] {ref} sent in {time.monotonic() - started:.0f} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m disagg.e2e.images.stream", description=__doc__.split("\n\n")[0])
    p.add_argument("target", choices=TARGETS)
    args = p.parse_args(argv)
    if sys.stdout.isatty():
        p.error("stdout is a terminal: pipe it into `ctr images import -`")

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)
    ref, config, layers = open_image(args.target, log)
    write_archive(sys.stdout.buffer, ref, config, layers, log)
    sys.stdout.buffer.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["open_image", "real_node_store", "write_archive"]
