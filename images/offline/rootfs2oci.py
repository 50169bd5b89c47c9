#!/usr/bin/env python3
"""Wrap a root-filesystem tar (e.g. from `mmdebstrap --format=tar`) as a one-layer OCI image
archive that `ctr images import` (containerd) and `buildah pull oci-archive:` accept.
Standard library only.

usage: rootfs2oci.py ROOTFS.tar OUT.oci.tar NAME:TAG [--env K=V]... [--cmd JSON]
                     [--entrypoint JSON] [--workdir DIR] [--user U] [--label K=V]...

NAME:TAG is written both as `org.opencontainers.image.ref.name` (tag) and
`io.containerd.image.name` (full name, e.g. docker.io/kubetrain/debian:bookworm), which is
the name ctr gives the imported image. Device nodes, anything under ./dev/ but the
directory itself, and ./proc ./sys contents are left out, as image builders do.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import tarfile
import tempfile
import time
from collections.abc import Sequence
from typing import Any

MANIFEST = "application/vnd.oci.image.manifest.v1+json"
CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
DEFAULT_PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def full_name(name: str) -> str:
    """docker.io/library/NAME:latest from NAME, as docker and containerd normalise it."""
    if "/" not in name.split(":")[0]:
        name = "library/" + name
    host = name.split("/")[0]
    if "." not in host and ":" not in host and host != "localhost":
        name = "docker.io/" + name
    if ":" not in name.split("/")[-1]:
        name += ":latest"
    return name


class _HashingWriter(io.RawIOBase):
    """Passes bytes on to a file while hashing them (the layer's uncompressed diff_id)."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.sha = hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self.sha.update(b)
        self.f.write(b)
        return len(b)


def _write_layer(rootfs: str, layer_path: str) -> str:
    """Copy ROOTFS into a gzipped layer tar at LAYER_PATH; return its diff_id."""
    with open(layer_path, "wb") as lf:
        gz = gzip.GzipFile(fileobj=lf, mode="wb", compresslevel=6, mtime=0)
        hw = _HashingWriter(gz)
        with tarfile.open(rootfs, "r:*") as src, \
                tarfile.open(fileobj=hw, mode="w|", format=tarfile.PAX_FORMAT) as dst:
            for m in src:
                n = m.name[2:] if m.name.startswith("./") else m.name.lstrip("/")
                n = "" if n in (".", "") else n
                if not n or n.startswith(("dev/", "proc/", "sys/")) or m.ischr() or m.isblk():
                    continue
                m.name = n
                if m.islnk() and m.linkname.startswith("./"):
                    m.linkname = m.linkname[2:]
                dst.addfile(m, src.extractfile(m) if m.isfile() else None)
        gz.close()
    return "sha256:" + hw.sha.hexdigest()


def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def _add_bytes(t: tarfile.TarFile, path: str, data: bytes) -> None:
    ti = tarfile.TarInfo(path)
    ti.size = len(data)
    ti.mode = 0o644
    t.addfile(ti, io.BytesIO(data))


def rootfs_to_oci(rootfs: str, out: str, name: str, *, env: Sequence[str] = (),
                  cmd: list[str] | None = None, entrypoint: list[str] | None = None,
                  workdir: str = "/", user: str = "",
                  labels: dict[str, str] | None = None) -> str:
    """Write ROOTFS (a tar) as the one-layer OCI archive OUT named NAME; return the full name."""
    name = full_name(name)
    tag = name.rsplit(":", 1)[1]
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(out))) as tmp:
        layer_path = os.path.join(tmp, "layer.tar.gz")
        diff_id = _write_layer(rootfs, layer_path)
        layer_digest = _file_digest(layer_path)
        layer_size = os.path.getsize(layer_path)

        created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        cfg: dict[str, Any] = {
            "Env": list(env) or [DEFAULT_PATH],
            "Cmd": cmd,
            "WorkingDir": workdir,
            "Labels": labels or None,
            "Entrypoint": entrypoint,
            "User": user or None,
        }
        config = {
            "created": created,
            "architecture": "amd64",
            "os": "linux",
            "config": {k: v for k, v in cfg.items() if v is not None},
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
            "history": [{"created": created,
                         "created_by": "rootfs2oci.py " + os.path.basename(rootfs)}],
        }
        config_b = json.dumps(config, separators=(",", ":")).encode()
        config_digest = "sha256:" + hashlib.sha256(config_b).hexdigest()
        manifest = {
            "schemaVersion": 2,
            "mediaType": MANIFEST,
            "config": {"mediaType": CONFIG, "digest": config_digest, "size": len(config_b)},
            "layers": [{"mediaType": LAYER, "digest": layer_digest, "size": layer_size}],
        }
        manifest_b = json.dumps(manifest, separators=(",", ":")).encode()
        manifest_digest = "sha256:" + hashlib.sha256(manifest_b).hexdigest()
        index = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [{
                "mediaType": MANIFEST,
                "digest": manifest_digest,
                "size": len(manifest_b),
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {"io.containerd.image.name": name,
                                "org.opencontainers.image.ref.name": tag},
            }],
        }
        with tarfile.open(out, "w") as tar:
            _add_bytes(tar, "oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
            _add_bytes(tar, "index.json", json.dumps(index).encode())
            for dg, data in ((config_digest, config_b), (manifest_digest, manifest_b)):
                _add_bytes(tar, "blobs/sha256/" + dg.split(":")[1], data)
            tar.add(layer_path, "blobs/sha256/" + layer_digest.split(":")[1])
    return name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rootfs")
    ap.add_argument("out")
    ap.add_argument("name")
    ap.add_argument("--env", action="append", default=[])
    ap.add_argument("--cmd", default='["/bin/bash"]')
    ap.add_argument("--entrypoint", default=None)
    ap.add_argument("--workdir", default="/")
    ap.add_argument("--user", default="")
    ap.add_argument("--label", action="append", default=[])
    a = ap.parse_args()
    name = rootfs_to_oci(
        a.rootfs, a.out, a.name, env=a.env,
        cmd=json.loads(a.cmd) if a.cmd else None,
        entrypoint=json.loads(a.entrypoint) if a.entrypoint else None,
        workdir=a.workdir, user=a.user,
        labels=dict(kv.split("=", 1) for kv in a.label))
    print(f"{a.out}: {name}")


if __name__ == "__main__":
    main()
