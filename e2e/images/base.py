"""The images' base, made locally from Debian's packages (no image registry is reachable here).

mmdebstrap builds a minimal Debian with Debian's Python 3 and venv, the machine's CA bundle (builds reach
the Python package index through this machine's TLS setup) and a ``/etc/pip.conf`` carrying the pip
settings the builds need. The root file system becomes the single, uncompressed layer of an OCI image
layout, which BuildKit reads as the named build context standing in for the Dockerfile's
``PYTHON_IMAGE`` (``python:3.11-slim-bookworm``: a Debian bookworm with Python 3.11, which is what this
base is too).

Cached under ``<cache_root>/images/base/<key>/``; the key hashes everything that goes in (this module,
versions.env, the CA bundle, the pip settings). A complete layout (``.complete`` written last) is
reused as it is; anything else is rebuilt from scratch.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..localcluster.controlplane import cache_root

HERE = Path(__file__).resolve().parent
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
# What a python:3.11-slim-bookworm base offers the Dockerfile's stages, beyond Debian's required packages:
# Python with venv (every stage makes its own virtual environment) and the CA store. Anything more a stage
# needs (libnuma for vLLM's CPU build) it installs itself, so the Dockerfile builds on the real image too.
PACKAGES = ["python3", "python3-venv", "ca-certificates"]
# Documentation and translations are dropped, as the slim images do.
PATH_EXCLUDES = ["/usr/share/doc/*", "/usr/share/man/*", "/usr/share/info/*", "/usr/share/locale/*",
                 "/usr/share/lintian/*"]
IMAGE_ENV = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8"]
# The layout's name for BuildKit's --oci-layout (a store id must be a lower-case reference name).
STORE_ID = "disagg-base"
# Fixed timestamps make the tarball, and so the layer digest, depend on the packages only.
SOURCE_DATE_EPOCH = "0"


class BaseImageError(RuntimeError):
    pass


@dataclass(frozen=True)
class BaseImage:
    layout: Path    # an OCI image layout directory
    digest: str     # the image manifest's digest (sha256:...)

    def context(self) -> str:
        """The value of BuildKit's ``context:<name>`` option that points a FROM line at this image."""
        return f"oci-layout://{STORE_ID}@{self.digest}"


def versions() -> dict[str, str]:
    out = {}
    for line in (HERE / "versions.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            k, _, v = line.partition("=")
            out[k] = v
    return out


def pip_conf(environ: os._Environ | dict = os.environ) -> str:
    """/etc/pip.conf for the base: the CA bundle, and the index and timeout settings this machine's pip
    uses (PIP_* variables), so RUN steps reach the same index the same way. No machine path goes in."""
    lines = ["[global]", f"cert = {HOST_CA_BUNDLE}",
             f"timeout = {environ.get('PIP_DEFAULT_TIMEOUT') or environ.get('PIP_TIMEOUT') or 120}",
             "retries = 10", "disable-pip-version-check = true"]
    for var, key in (("PIP_INDEX_URL", "index-url"), ("PIP_EXTRA_INDEX_URL", "extra-index-url"),
                     ("PIP_TRUSTED_HOST", "trusted-host")):
        if environ.get(var):
            lines.append(f"{key} = {environ[var]}")
    return "\n".join(lines) + "\n"


def _key(v: dict[str, str], conf: str) -> str:
    h = hashlib.sha256()
    for part in (Path(__file__).read_bytes(), (HERE / "versions.env").read_bytes(), HOST_CA_BUNDLE.read_bytes(),
                 conf.encode()):
        h.update(hashlib.sha256(part).digest())
    return f"debian-{v['DEBIAN_SUITE']}_{h.hexdigest()[:12]}"


def _arch() -> str:
    machine = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def _blob(layout: Path, data: bytes, media_type: str) -> dict:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256" / digest.removeprefix("sha256:")).write_bytes(data)
    return {"mediaType": media_type, "digest": digest, "size": len(data)}


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def _write_layout(layout: Path, rootfs_tar: Path, suite: str) -> str:
    """An OCI image layout holding one image: the tarball as its only layer. Returns the manifest digest."""
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    diff_id = _file_digest(rootfs_tar)
    layer = {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": diff_id,
             "size": rootfs_tar.stat().st_size}
    # The layer is the uncompressed tarball itself (a 2-core machine spends minutes gzipping it).
    rootfs_tar.rename(blobs / diff_id.removeprefix("sha256:"))
    config = {"architecture": _arch(), "os": "linux", "created": "1970-01-01T00:00:00Z",
              "config": {"Env": IMAGE_ENV, "Cmd": ["python3"]},
              "rootfs": {"type": "layers", "diff_ids": [diff_id]},
              "history": [{"created": "1970-01-01T00:00:00Z",
                           "created_by": f"mmdebstrap {suite} ({', '.join(PACKAGES)}), disagg.e2e.images.base"}]}
    cfg = _blob(layout, json.dumps(config, sort_keys=True).encode(), "application/vnd.oci.image.config.v1+json")
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": cfg, "layers": [layer]}
    m = _blob(layout, json.dumps(manifest, sort_keys=True).encode(), "application/vnd.oci.image.manifest.v1+json")
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
             "manifests": [{**m, "annotations": {"org.opencontainers.image.ref.name": suite}}]}
    (layout / "index.json").write_text(json.dumps(index, sort_keys=True))
    (layout / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    return m["digest"]


def ensure_base(log=print) -> BaseImage:
    """The cached base image, made first when absent or incomplete (about a minute and ~70 MB of packages)."""
    v = versions()
    conf = pip_conf()
    if not HOST_CA_BUNDLE.is_file():
        raise BaseImageError(f"{HOST_CA_BUNDLE} is missing: the base carries the machine's CA bundle "
                             "(apt-get install -y ca-certificates)")
    layout = cache_root() / "images" / "base" / _key(v, conf)
    layout.parent.mkdir(parents=True, exist_ok=True)
    # One maker at a time (a second caller waits, then finds the layout complete).
    with open(layout.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _ensure(layout, v, conf, log)


def _ensure(layout: Path, v: dict[str, str], conf: str, log) -> BaseImage:
    done = layout / ".complete"
    if done.is_file():
        return BaseImage(layout, done.read_text().strip())
    if not shutil.which("mmdebstrap"):
        raise BaseImageError("mmdebstrap is missing: the base images are made from Debian's packages with it "
                             "(apt-get install -y mmdebstrap)")
    shutil.rmtree(layout, ignore_errors=True)
    suite = v["DEBIAN_SUITE"]
    mirrors = [f"deb {v['DEBIAN_MIRROR']} {suite} main", f"deb {v['DEBIAN_MIRROR']} {suite}-updates main",
               f"deb {v['DEBIAN_SECURITY_MIRROR']} {suite}-security main"]
    with tempfile.TemporaryDirectory(dir=layout.parent, prefix=".base-") as tmp:
        conf_file = Path(tmp) / "pip.conf"
        conf_file.write_text(conf)
        tar = Path(tmp) / "rootfs.tar"
        argv = ["mmdebstrap", "--mode=auto", "--variant=minbase", "--format=tar", "--quiet",
                "--include=" + ",".join(PACKAGES),
                *[f"--dpkgopt=path-exclude={p}" for p in PATH_EXCLUDES],
                f"--customize-hook=upload {HOST_CA_BUNDLE} {HOST_CA_BUNDLE}",
                f"--customize-hook=upload {conf_file} /etc/pip.conf",
                suite, str(tar), *mirrors]
        log(f"[images] making the {suite} base with mmdebstrap ({', '.join(PACKAGES)})")
        out = subprocess.run(argv, env={**os.environ, "SOURCE_DATE_EPOCH": SOURCE_DATE_EPOCH},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if out.returncode != 0:
            raise BaseImageError(f"mmdebstrap failed ({out.returncode}):\n{out.stdout[-4000:]}")
        staging = Path(tmp) / "layout"
        digest = _write_layout(staging, tar, suite)
        staging.rename(layout)
    done.write_text(digest + "\n")
    return BaseImage(layout, digest)

