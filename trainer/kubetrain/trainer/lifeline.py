"""The trainer's lifeline: a beat to whoever follows this pod's trainer, and a last word.

A restart that torchrun does in place (a trainer killed, a collective that failed) changes
nothing the Kubernetes API shows: the pod and its container keep running. So each trainer
process of a worker pod serves a lifeline on the metrics port + 1 + its local rank
(`kubetrain.protocol`): a `beat` line every
half second to each connection, and one `end` line with the exit code and the failure class
when `fit` ends in order. A process that dies closes its connections without one: the
kernel does that at once, even for kill -9, so the operator (`kubetrain.operator.lifeline_watch`)
knows within milliseconds, and a node that goes silent stops the beats.

Torch-free and self-contained: served only in a pod (KUBETRAIN_POD_NAME, which the operator
sets), and never worth failing a run over: a port it cannot bind is logged and skipped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading

from kubetrain.pod_conventions import POD_NAME_ENV
from kubetrain.protocol import LIFELINE_BEAT_SECONDS, end_line, lifeline_port

log = logging.getLogger(__name__)

BEAT = b"beat\n"


class Lifeline:
    """Serves `beat` lines on `port` until `end`; see the module docstring."""

    def __init__(self, port: int, beat_seconds: float = LIFELINE_BEAT_SECONDS,
                 host: str = "0.0.0.0") -> None:
        self.port = port
        self.beat_seconds = beat_seconds
        self.host = host
        self._listener: socket.socket | None = None
        self._followers: list[socket.socket] = []
        self._lock = threading.Lock()
        self._ended = threading.Event()

    @classmethod
    def for_this_process(cls, metrics_port: int) -> Lifeline | None:
        """The lifeline this process serves, in a worker pod only (none elsewhere)."""
        if not os.environ.get(POD_NAME_ENV):
            return None
        port = lifeline_port(metrics_port, int(os.environ.get("LOCAL_RANK", "0")))
        return cls(port) if port <= 65535 else None

    def start(self) -> bool:
        """Listen and beat in daemon threads; False when the port cannot be bound."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((self.host, self.port))
            listener.listen(16)
        except OSError as error:
            listener.close()
            log.warning("no lifeline on port %d: %s", self.port, error)
            return False
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, name="lifeline-accept", daemon=True).start()
        threading.Thread(target=self._beat, name="lifeline-beat", daemon=True).start()
        return True

    def end(self, exit_code: int, failure_class: str, words: str = "") -> None:
        """Tell every follower how this process ends, then close (once; later calls do nothing)."""
        with self._lock:
            if self._ended.is_set():
                return
            self._ended.set()
            followers, self._followers = self._followers, []
            listener, self._listener = self._listener, None
        line = end_line(exit_code, failure_class, words)
        for follower in followers:
            with contextlib.suppress(OSError):
                follower.sendall(line)
            follower.close()
        if listener is not None:
            with contextlib.suppress(OSError):  # wakes the accepting thread (Linux)
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()

    def _accept(self) -> None:
        while not self._ended.is_set():
            listener = self._listener
            if listener is None:
                return
            try:
                follower, _ = listener.accept()
            except OSError:
                return  # closed by `end`
            follower.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._ended.is_set():
                    follower.close()
                    return
                self._followers.append(follower)
            self._send(follower, BEAT)

    def _beat(self) -> None:
        while not self._ended.wait(self.beat_seconds):
            with self._lock:
                followers = list(self._followers)
            for follower in followers:
                self._send(follower, BEAT)

    def _send(self, follower: socket.socket, line: bytes) -> None:
        try:
            follower.sendall(line)
        except OSError:  # the follower went away
            with self._lock:
                if follower in self._followers:
                    self._followers.remove(follower)
            follower.close()
