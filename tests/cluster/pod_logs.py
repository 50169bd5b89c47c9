"""Containers' logs as a kubelet keeps and serves them, for the node agent and the emulator.

What it does as the kubelet and its container runtime do: each line a container writes
is stamped with the time it was read (CRI's log format stamps every line, in
nanoseconds, strictly increasing here), and `GET pods/{name}/log` is answered from those
lines with the API's options: `sinceSeconds` or `sinceTime`, `tailLines`, `limitBytes`,
`timestamps` (an RFC 3339 time with nanoseconds before each line) and `follow`, which
keeps the answer open until the container has ended (see tests/cluster/emulator.py).

What it does not: keep logs past a pod (a deleted pod's log is gone, as the kubelet
removes its containers), rotate files, tell stdout from stderr (one interleaved file,
as `kubectl logs` shows them), or serve `previous`: the node agent runs restartPolicy
Never only, so no container of a pod ever has a previous one.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

RFC3339 = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:\d\d)")


class LogQueryError(ValueError):
    """A log request's option the API server refuses (400 Bad Request), in its words."""


@dataclass(frozen=True)
class LogQuery:
    """The options of one `pods/{name}/log` request, as the API server reads them."""

    follow: bool = False
    timestamps: bool = False
    since_ns: int | None = None  # only lines stamped at or after this (Unix nanoseconds)
    tail_lines: int | None = None
    limit_bytes: int | None = None

    @classmethod
    def parse(cls, params: Mapping[str, str], now_ns: int | None = None) -> LogQuery:
        """The query of a request's parameters; LogQueryError for a value the server refuses."""
        now_ns = time.time_ns() if now_ns is None else now_ns
        since_ns = None
        if "sinceSeconds" in params and "sinceTime" in params:
            raise LogQueryError("at most one of sinceTime or sinceSeconds may be specified")
        if "sinceSeconds" in params:
            seconds = _integer(params, "sinceSeconds", minimum=1)
            since_ns = now_ns - seconds * 1_000_000_000
        elif "sinceTime" in params:
            since_ns = parse_time(params["sinceTime"])
        tail = _integer(params, "tailLines", minimum=0) if "tailLines" in params else None
        limit = _integer(params, "limitBytes", minimum=1) if "limitBytes" in params else None
        return cls(follow=_flag(params, "follow"), timestamps=_flag(params, "timestamps"),
                   since_ns=since_ns, tail_lines=tail, limit_bytes=limit)


def _flag(params: Mapping[str, str], name: str) -> bool:
    return params.get(name, "false").lower() in ("true", "1")


def _integer(params: Mapping[str, str], name: str, minimum: int) -> int:
    try:
        value = int(params[name])
    except ValueError:
        raise LogQueryError(f"{name}: invalid value {params[name]!r}: not an integer") from None
    if value < minimum:
        raise LogQueryError(f"{name}: Invalid value: {value}: must be at least {minimum}")
    return value


def parse_time(text: str) -> int:
    """Unix nanoseconds of an RFC 3339 time (fractions of a second up to nanoseconds)."""
    match = RFC3339.fullmatch(text)
    if match is None:
        raise LogQueryError(f"sinceTime: {text!r} is not an RFC 3339 time")
    whole, fraction, zone = match.groups()
    moment = datetime.fromisoformat(whole + ("+00:00" if zone == "Z" else zone))
    return int(moment.timestamp()) * 1_000_000_000 + int((fraction or "0").ljust(9, "0"))


def format_time(ns: int) -> str:
    """An RFC 3339 time with nanoseconds, in UTC, as the kubelet prefixes log lines."""
    moment = datetime.fromtimestamp(ns // 1_000_000_000, UTC)
    return f"{moment:%Y-%m-%dT%H:%M:%S}.{ns % 1_000_000_000:09d}Z"


def select(lines: list[tuple[int, str]], query: LogQuery) -> list[tuple[int, str]]:
    """The stamped lines a query asks for at first: since its time, then its last few."""
    chosen = [line for line in lines if query.since_ns is None or line[0] >= query.since_ns]
    if query.tail_lines is not None:
        chosen = chosen[len(chosen) - query.tail_lines:] if query.tail_lines else []
    return chosen


def render(line: tuple[int, str], query: LogQuery) -> bytes:
    """One line as the answer carries it: with its time first when `timestamps` is asked."""
    stamp, text = line
    return ((format_time(stamp) + " " if query.timestamps else "") + text + "\n").encode()


@dataclass
class ContainerLog:
    """One container's output file (`path`, written by its runtime) read as stamped lines.

    `collect` reads what was written since it last read and stamps each complete line
    with the time of reading (`clock`, Unix nanoseconds); the node agent calls it on every
    tick, and each reader before it reads. `finish` marks the container ended: the last
    partial line counts. Safe to use from the agent's thread and the API server's event
    loop at once.
    """

    path: Path
    clock: Callable[[], int] = time.time_ns
    _lines: list[tuple[int, str]] = field(default_factory=list)
    _offset: int = 0
    _partial: bytes = b""
    _last_ns: int = 0
    finished: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def collect(self) -> None:
        """Stamp the complete lines written since the last call."""
        with self._lock:
            if not self.finished:
                self._read()

    def finish(self) -> None:
        """The container ended: read the rest, a last line without a newline included."""
        with self._lock:
            if self.finished:
                return
            self._read()
            if self._partial:
                self._stamp([self._partial])
                self._partial = b""
            self.finished = True

    def lines(self) -> list[tuple[int, str]]:
        """Every line so far, (Unix nanoseconds, text), oldest first."""
        self.collect()
        with self._lock:
            return list(self._lines)

    def _read(self) -> None:
        try:
            with open(self.path, "rb") as file:
                file.seek(self._offset)
                data = file.read()
        except FileNotFoundError:
            return
        self._offset += len(data)
        *complete, self._partial = (self._partial + data).split(b"\n")
        self._stamp(complete)

    def _stamp(self, raw: list[bytes]) -> None:
        for line in raw:
            # Strictly increasing, as a reader resuming after its last line's time relies on.
            self._last_ns = max(self.clock(), self._last_ns + 1)
            self._lines.append((self._last_ns, line.decode(errors="replace")))
