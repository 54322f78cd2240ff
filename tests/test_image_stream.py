"""e2e/images/stream.py's archive, read back: what `ctr images import -` takes from the pipe. Large layers go
zstd-compressed under their compressed digest (decompressing to the stored layer, so the config's diff_ids
still hold), small ones as they are, and the index names the image. The stream into a kind node's
containerd runs in `make e2e-kind` (tests/test_e2e_helm.py's tiny-model test serves from it)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import tarfile

import pytest

from disagg.e2e.images import stream


def _layer(path, payload: bytes) -> stream.Blob:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("data.bin")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    data = buf.getvalue()
    path.write_bytes(data)
    return stream.Blob({"mediaType": "application/vnd.oci.image.layer.v1.tar",
                        "digest": f"sha256:{hashlib.sha256(data).hexdigest()}", "size": len(data)}, open(path, "rb"))


def test_large_layers_travel_compressed_small_ones_as_they_are(tmp_path, monkeypatch):
    monkeypatch.setattr(stream, "COMPRESS_FROM_BYTES", 100_000)
    big = _layer(tmp_path / "big", os.urandom(1000) * 300)      # compressible, over the threshold
    small = _layer(tmp_path / "small", b"x" * 1000)
    originals = {b.desc["digest"]: (tmp_path / n).read_bytes() for b, n in ((big, "big"), (small, "small"))}
    config = json.dumps({"architecture": "amd64", "os": "linux", "rootfs": {
        "type": "layers", "diff_ids": [big.desc["digest"], small.desc["digest"]]}}).encode()
    out = io.BytesIO()
    stream.write_archive(out, "docker.io/disagg/worker-cpu:0.1.0", config, [big, small], log=lambda *_: None)
    out.seek(0)
    with tarfile.open(fileobj=out, mode="r|") as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}
    for name, data in members.items():
        if name.startswith("blobs/sha256/"):
            assert hashlib.sha256(data).hexdigest() == name.rsplit("/", 1)[1], name
    index = json.loads(members["index.json"])
    (entry,) = index["manifests"]
    assert entry["annotations"]["io.containerd.image.name"] == "docker.io/disagg/worker-cpu:0.1.0"
    assert entry["platform"] == {"architecture": "amd64", "os": "linux"}
    manifest = json.loads(members[f"blobs/sha256/{entry['digest'].removeprefix('sha256:')}"])
    assert members[f"blobs/sha256/{manifest['config']['digest'].removeprefix('sha256:')}"] == config
    first, second = manifest["layers"]
    assert first["mediaType"] == stream.LAYER_ZSTD and first["digest"] != big.desc["digest"]
    sent = members[f"blobs/sha256/{first['digest'].removeprefix('sha256:')}"]
    assert first["size"] == len(sent) < big.desc["size"] // 10
    unpacked = subprocess.run(["zstd", "-d", "-c"], input=sent, capture_output=True, check=True).stdout
    assert unpacked == originals[big.desc["digest"]]   # the config's diff_id still names it
    assert second == {k: small.desc[k] for k in ("mediaType", "digest", "size")}
    assert members[f"blobs/sha256/{second['digest'].removeprefix('sha256:')}"] == originals[small.desc["digest"]]


def test_a_terminal_is_refused(monkeypatch):
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    with pytest.raises(SystemExit):
        stream.main(["worker-cpu"])
