"""The pod's lifeline: a beat to whoever follows the pod, and each trainer process's last word.

A restart that torchrun does in place (a trainer killed, a collective that failed) changes
nothing the Kubernetes API shows: the pod and its container keep running. So each worker
pod serves a lifeline (`kubetrain.protocol`): its agent (`kubetrain.trainer.launch`, the
process that runs torchrun, which outlives every trainer process) serves `PodLifeline` on
the metrics port + 1: a `beat` every half second to each follower from a thread of its
own, and a line for each trainer process that ends. Each trainer process holds a
`Lifeline` to its agent over the pod's own socket and says how it ends; a process that
dies without a word closes it, which the kernel does at once even for kill -9, so the
operator (`kubetrain.operator.lifeline_watch`) knows within milliseconds, and a node that
goes silent stops the beats. One connection from the operator a pod, whatever its
processes (issue 53: each process served its own before, 8,192 connections for 1,024 pods
of 8).

Torch-free and self-contained: served only in a pod (KUBETRAIN_POD_NAME, which the operator
sets), and never worth failing a run over: a port it cannot bind, or an agent it cannot
reach, is logged and skipped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
import threading

from kubetrain.pod_conventions import NODE_NAME_ENV, POD_NAME_ENV
from kubetrain.protocol import (
    AGENT_PID_ENV,
    BEAT,
    BYE,
    LIFELINE_BEAT_SECONDS,
    POD_LIFELINE,
    end_line,
    lifeline_port,
    lifeline_socket,
    rank_line,
)

log = logging.getLogger(__name__)


def in_a_pod() -> bool:
    """Whether this process runs in a worker pod the operator made (and follows)."""
    return bool(os.environ.get(POD_NAME_ENV))


def where_am_i() -> tuple[str, str]:
    """This process's pod and node: the downward API's (the operator sets both), else the host."""
    host = socket.gethostname()
    return (os.environ.get(POD_NAME_ENV) or host, os.environ.get(NODE_NAME_ENV) or host)


class PodLifeline:
    """The pod's lifeline, served by its agent: see the module docstring.

    Followers connect over TCP on `port`; the pod's trainer processes over the abstract Unix
    socket `local_name`, each saying `rank <local rank>` first and then, as it ends in
    order, its `end` line. One thread accepts and reads them all; another beats.
    """

    def __init__(self, port: int, local_name: str,
                 beat_seconds: float = LIFELINE_BEAT_SECONDS, host: str = "0.0.0.0") -> None:
        self.port = port
        self.local_name = local_name
        self.beat_seconds = beat_seconds
        self.host = host
        self._followers: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._listener: socket.socket | None = None

    @classmethod
    def for_this_pod(cls, metrics_port: int) -> PodLifeline | None:
        """The lifeline this agent serves, in a worker pod only (none elsewhere)."""
        if not in_a_pod():
            return None
        port = lifeline_port(metrics_port)
        return cls(port, lifeline_socket(os.getpid())) if port <= 65535 else None

    def start(self) -> bool:
        """Listen and beat in daemon threads; False when either socket cannot be bound."""
        followers = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        followers.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        processes = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            followers.bind((self.host, self.port))
            followers.listen(16)
            processes.bind(self.local_name)
            processes.listen(64)
        except OSError as error:
            followers.close()
            processes.close()
            log.warning("no lifeline on port %d: %s", self.port, error)
            return False
        self.port = followers.getsockname()[1]
        self._listener = followers
        for listener, kind in ((followers, "follower"), (processes, "process"),
                               (self._wake_r, "wake")):
            listener.setblocking(False)
            self._selector.register(listener, selectors.EVENT_READ, (kind, None))
        threading.Thread(target=self._serve, name="lifeline", daemon=True).start()
        threading.Thread(target=self._beat, name="lifeline-beat", daemon=True).start()
        return True

    def close(self) -> None:
        """Say BYE to every follower (the agent ends in order) and stop (once)."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            followers, self._followers = self._followers, []
        for follower in followers:
            self._say_bye(follower)
        for follower in self._waiting_followers():
            self._say_bye(follower, welcome=True)
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")  # the serving thread closes its sockets

    def _serve(self) -> None:
        lines: dict[socket.socket, bytearray] = {}  # a process's unread bytes
        ranks: dict[socket.socket, int] = {}
        ended: set[socket.socket] = set()  # processes that said their last word
        while not self._closed.is_set():
            for key, _ in self._selector.select():
                kind, _ = key.data
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if kind == "wake":
                    break
                if kind in ("follower", "process"):
                    with contextlib.suppress(BlockingIOError, OSError):
                        accepted, _ = sock.accept()
                        if kind == "follower":
                            self._welcome(accepted)
                        else:
                            accepted.setblocking(False)
                            lines[accepted] = bytearray()
                            self._selector.register(accepted, selectors.EVENT_READ,
                                                    ("said", None))
                    continue
                try:
                    data = sock.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                lines[sock] += data
                while b"\n" in lines[sock]:
                    line, _, rest = bytes(lines[sock]).partition(b"\n")
                    lines[sock] = bytearray(rest)
                    if line.startswith(b"rank "):
                        with contextlib.suppress(ValueError):
                            ranks[sock] = int(line.split()[1])
                    elif line.startswith(b"end") and sock not in ended:
                        ended.add(sock)
                        self._tell(rank_line(ranks.get(sock, -1), line + b"\n"))
                if not data:  # the process ended: without a word, unless it said one
                    if sock not in ended:
                        self._tell(rank_line(ranks.get(sock, -1), None))
                    self._selector.unregister(sock)
                    sock.close()
                    lines.pop(sock, None)
                    ranks.pop(sock, None)
                    ended.discard(sock)
        for key in list(self._selector.get_map().values()):
            with contextlib.suppress(OSError):
                key.fileobj.close()  # type: ignore[union-attr]
        self._selector.close()
        self._wake_w.close()

    def _waiting_followers(self) -> list[socket.socket]:
        """The followers the kernel connected that the serving thread has not accepted yet
        (a follower that came just before the end): they hear the BYE too, not a line that
        closes without a word, which the operator would take for a killed pod."""
        waiting: list[socket.socket] = []
        with contextlib.suppress(OSError):  # BlockingIOError: none waits
            while self._listener is not None:
                accepted, _ = self._listener.accept()
                waiting.append(accepted)
        return waiting

    def _say_bye(self, follower: socket.socket, welcome: bool = False) -> None:
        with contextlib.suppress(OSError):
            follower.sendall((POD_LIFELINE if welcome else b"") + BYE)
        follower.close()

    def _welcome(self, follower: socket.socket) -> None:
        follower.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            ending = self._closed.is_set()
            if not ending:
                self._followers.append(follower)
        if ending:  # accepted while the agent ends
            self._say_bye(follower, welcome=True)
        else:
            self._send(follower, POD_LIFELINE + BEAT)

    def _tell(self, line: bytes) -> None:
        with self._lock:
            followers = list(self._followers)
        for follower in followers:
            self._send(follower, line)

    def _beat(self) -> None:
        while not self._closed.wait(self.beat_seconds):
            self._tell(BEAT)

    def _send(self, follower: socket.socket, line: bytes) -> None:
        try:
            follower.sendall(line)
        except OSError:  # the follower went away
            with self._lock:
                if follower in self._followers:
                    self._followers.remove(follower)
            follower.close()


class Lifeline:
    """This trainer process's line to its pod's lifeline: its local rank, then its last word.

    The agent's `PodLifeline` passes the word on; a process that dies without one closes
    the line (the kernel does), which the agent passes on as `gone`.
    """

    def __init__(self, local_name: str, local_rank: int) -> None:
        self.local_name = local_name
        self.local_rank = local_rank
        self._socket: socket.socket | None = None
        self._lock = threading.Lock()

    @classmethod
    def for_this_process(cls) -> Lifeline | None:
        """This process's line, in a worker pod whose agent serves the lifeline (none
        elsewhere)."""
        agent = os.environ.get(AGENT_PID_ENV)
        if not in_a_pod() or not agent:
            return None
        return cls(lifeline_socket(int(agent)), int(os.environ.get("LOCAL_RANK", "0")))

    def start(self) -> bool:
        """Reach the agent and say which process this is; False when it cannot be reached."""
        line = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            line.connect(self.local_name)
            line.sendall(f"rank {self.local_rank}\n".encode())
        except OSError as error:
            line.close()
            log.warning("no pod lifeline to tell how this process ends: %s", error)
            return False
        self._socket = line
        return True

    def end(self, exit_code: int, failure_class: str, words: str = "") -> None:
        """Tell the pod's lifeline how this process ends, then close (once; later calls do
        nothing)."""
        with self._lock:
            line, self._socket = self._socket, None
        if line is None:
            return
        with contextlib.suppress(OSError):
            line.sendall(end_line(exit_code, failure_class, words))
        line.close()
