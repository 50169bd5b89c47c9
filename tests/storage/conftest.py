"""Fixtures of the storage tests: a storage of each backend, moto's StorageSpec, and a
fault-injecting proxy in front of moto.

`faulty_s3(fault_ratio=..., delay=..., seed=...)` starts a `FaultyProxy` (stopped at
the end of the test) and returns it; its `endpoint` is what the code under test
gets. Some requests then get a 500, a TCP reset, or half a body followed by a reset
(`faults` narrows the draw, or makes it a 403); faults are drawn from a seeded
generator, and `delay` slows requests that carry data (PUT/POST) so that a test can act
while an upload is in flight. `injected` counts what was injected, `served` the bytes of
the GET answers it forwarded.
"""

from __future__ import annotations

import gc
import http.client
import random
import socket
import struct
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kubetrain.api.trainingjob import StorageSpec
from kubetrain.trainer.storage import Storage, open_storage


@pytest.fixture
def s3_spec(s3_endpoint: str) -> StorageSpec:
    """spec.storage pointing at the test's moto server."""
    return StorageSpec(endpoint=s3_endpoint, region="us-east-1")


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    """An empty storage on local disk, then on S3 (moto over HTTP)."""
    if request.param == "local":
        return open_storage(str(tmp_path / "root"))
    bucket = request.getfixturevalue("s3_bucket")
    return open_storage(f"s3://{bucket}/root", request.getfixturevalue("s3_spec"))


@pytest.fixture
def faulty_s3(s3_endpoint: str) -> Iterator[Callable[..., FaultyProxy]]:
    """Starts fault-injecting proxies in front of moto; see the module docstring."""
    started: list[FaultyProxy] = []

    def start(**options: Any) -> FaultyProxy:
        proxy = FaultyProxy(s3_endpoint, **options)
        proxy.start()
        started.append(proxy)
        return proxy

    yield start
    for proxy in started:
        proxy.stop()


# The S3 error answers it injects, by status: botocore retries a 500, not a 403.
_ERRORS = {status: (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>' + code
                    + b"</Code><Message>injected by the test proxy</Message></Error>")
           for status, code in ((500, b"InternalError"), (403, b"AccessDenied"))}
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length"}


class FaultyProxy:
    """Forwards to `target` (http://host:port), failing `fault_ratio` of the requests with
    a fault drawn from `faults`: "500", "reset", "truncate", or "403" (access denied,
    which botocore does not retry: a failure that costs no backoff)."""

    def __init__(self, target: str, *, fault_ratio: float = 0.1, delay: float = 0.0,
                 seed: int = 0, faults: tuple[str, ...] = ("500", "reset", "truncate"),
                 ) -> None:
        self.target = target.removeprefix("http://")
        self.fault_ratio = fault_ratio
        self.faults = faults
        self.delay = delay
        self.injected: Counter[str] = Counter()
        self.forwarded = 0
        self.served = 0
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        # Polled every 50 ms, so `stop` waits that long for the loop, not 0.5 s.
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _draw(self) -> str | None:
        with self._lock:
            if self._random.random() >= self.fault_ratio:
                self.forwarded += 1
                return None
            fault = self._random.choice(self.faults)
            self.injected[fault] += 1
            return fault

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                        if size == 0:
                            return b"".join(chunks)
                return self.rfile.read(int(self.headers.get("Content-Length", 0)))

            def _reset(self) -> None:
                # SO_LINGER 0: close with a TCP RST, as a crashed or overloaded server does.
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                           struct.pack("ii", 1, 0))
                self.close_connection = True
                self.connection.close()

            def _forward(self) -> None:
                body = self._body()
                fault = proxy._draw()
                if fault == "reset":
                    return self._reset()
                if fault in {"500", "403"}:
                    error = _ERRORS[int(fault)]
                    self.send_response(int(fault))
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(error)))
                    self.end_headers()
                    self.wfile.write(error)
                    return None
                if proxy.delay and self.command in {"PUT", "POST"}:
                    threading.Event().wait(proxy.delay)
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in _HOP_BY_HOP}
                if self.command in {"PUT", "POST"} or body:
                    headers["Content-Length"] = str(len(body))
                upstream = http.client.HTTPConnection(proxy.target, timeout=60)
                try:
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    response = upstream.getresponse()
                    data = response.read()
                    reply_headers = response.getheaders()
                finally:
                    upstream.close()
                if fault == "truncate" and len(data) <= 1:
                    return self._reset()  # applied upstream, but the client never hears
                self.send_response(response.status)
                for key, value in reply_headers:
                    if key.lower() not in _HOP_BY_HOP:
                        self.send_header(key, value)
                length = (dict((k.lower(), v) for k, v in reply_headers).get("content-length", "0")
                          if self.command == "HEAD" else str(len(data)))
                self.send_header("Content-Length", length)
                self.end_headers()
                if fault == "truncate":
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    return self._reset()
                if self.command != "HEAD":
                    self.wfile.write(data)
                if self.command == "GET":
                    with proxy._lock:
                        proxy.served += len(data)
                return None

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        return Handler


@pytest.fixture
def process_group() -> Iterator[None]:
    """A one-process gloo group, as the trainer has when it runs outside torchrun."""
    import torch.distributed as dist

    owned = not dist.is_initialized()
    # What the process held before the group (torch, transformers, ...) is set aside while
    # the test runs, so the collection below walks only what the test made: walking the
    # whole heap took 0.3 s a test. Not when something else froze objects: unfreezing
    # would hand back theirs too.
    set_aside = owned and gc.get_freeze_count() == 0
    if set_aside:
        gc.freeze()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if owned:
        try:
            dist.destroy_process_group()
            # Collect the dead groups now, with their threads alive: left as garbage, a group
            # is destroyed wherever the next collection runs, and in a process forked later
            # (a DataLoader worker) its destructor waits forever for threads the child lacks.
            gc.collect()
        finally:
            if set_aside:
                gc.unfreeze()
