"""Tiny OCI images packed from local files, for the real node (no registry is reachable).

``pack`` writes an OCI image-layout archive (one uncompressed layer, a config and
a manifest) that ``ctr images import`` loads into containerd's image store. The
archive is byte-for-byte reproducible (fixed times and owners, sorted entries), so
the same inputs always give the same image digest and re-importing is a no-op.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

MANIFEST = "application/vnd.oci.image.manifest.v1+json"
CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER = "application/vnd.oci.image.layer.v1.tar"


@dataclass
class Image:
    """One image: ``files`` maps a path in the image to a host file copied in (kept executable);
    ``links`` maps a path to a symlink target."""

    name: str
    files: dict[str, Path] = field(default_factory=dict)
    links: dict[str, str] = field(default_factory=dict)
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    env: list[str] = field(default_factory=lambda: ["PATH=/bin:/usr/bin:/sbin:/usr/sbin"])


def _info(name: str, kind: bytes, mode: int, size: int = 0, target: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.size, info.linkname = kind, mode, size, target
    info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "root", "root"
    return info


def _layer(image: Image) -> bytes:
    entries: dict[str, tuple[tarfile.TarInfo, bytes | None]] = {}
    paths = [p.strip("/") for p in [*image.files, *image.links]]
    for path in paths:  # parent directories first, each once
        parts = path.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            d = "/".join(parts[:i])
            entries.setdefault(d, (_info(d, tarfile.DIRTYPE, 0o755), None))
    for path, source in image.files.items():
        data = Path(source).read_bytes()
        entries[path.strip("/")] = (_info(path.strip("/"), tarfile.REGTYPE, 0o755, len(data)), data)
    for path, target in image.links.items():
        entries[path.strip("/")] = (_info(path.strip("/"), tarfile.SYMTYPE, 0o777, target=target), None)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(entries):
            info, data = entries[name]
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _blob(blobs: dict[str, bytes], data: bytes, media_type: str) -> dict:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blobs[digest] = data
    return {"mediaType": media_type, "digest": digest, "size": len(data)}


def pack(image: Image, out: Path) -> Path:
    """Write ``image`` as an OCI image-layout tar at ``out``; returns ``out``."""
    blobs: dict[str, bytes] = {}
    layer = _layer(image)
    layer_desc = _blob(blobs, layer, LAYER)
    config = {
        "architecture": "amd64", "os": "linux",
        "config": {"Entrypoint": image.entrypoint or None, "Cmd": image.cmd or None, "Env": image.env,
                   "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [layer_desc["digest"]]},  # uncompressed: same digest
    }
    config_desc = _blob(blobs, json.dumps(config, sort_keys=True).encode(), CONFIG)
    manifest = {"schemaVersion": 2, "mediaType": MANIFEST, "config": config_desc, "layers": [layer_desc]}
    manifest_desc = _blob(blobs, json.dumps(manifest, sort_keys=True).encode(), MANIFEST)
    manifest_desc["annotations"] = {"io.containerd.image.name": image.name,
                                    "org.opencontainers.image.ref.name": image.name.rsplit(":", 1)[-1]}
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
             "manifests": [manifest_desc]}
    members = {"oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
               "index.json": json.dumps(index, sort_keys=True).encode(),
               **{f"blobs/sha256/{d.split(':', 1)[1]}": data for d, data in blobs.items()}}
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for d in ("blobs", "blobs/sha256"):
            tar.addfile(_info(d, tarfile.DIRTYPE, 0o755))
        for name in sorted(members):
            data = members[name]
            tar.addfile(_info(name, tarfile.REGTYPE, 0o644, len(data)), io.BytesIO(data))
    return out
