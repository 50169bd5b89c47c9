"""Reading the trainer's JSONL metrics log while it is being written, and what it says so far.

Rank 0 of the trainer appends one JSON object per line (`step`, `eval`,
`checkpoint`, `resumed`, `start`, `finished` events; the format is part of the
trainer's contract). The local runner follows the file as it grows, like
`tail -f`: `MetricsLogReader` returns only complete new lines, and `RunHistory`
folds the events into the facts the progress bar, the restart policy and the
final summary need. Unknown events and fields are ignored, so the trainer may
log more without breaking the runner. For own code, which writes no such log, the runner
itself appends the events (`append_event`): steps from the local status endpoint's
reports, checkpoints from the commits under checkpoint.uri, resumes and failures.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Event = dict[str, Any]


class MetricsLogReader:
    """Follows one metrics log file from a byte offset, returning each complete line once."""

    def __init__(self, path: Path, offset: int = 0) -> None:
        self.path = path
        self.offset = offset

    def read_new(self) -> list[Event]:
        """Events appended since the last call; a partly written last line waits for the next."""
        try:
            with self.path.open("rb") as log:
                log.seek(self.offset)
                data = log.read()
        except FileNotFoundError:
            return []
        complete = data.rfind(b"\n") + 1
        self.offset += complete
        return parse_lines(data[:complete].decode("utf-8", errors="replace"))


_appending = threading.Lock()


def append_event(path: Path, event: Event) -> None:
    """Append `event` as one line; the runner's threads (the status endpoint's and its
    own) take turns, so lines never interleave."""
    line = json.dumps(event) + "\n"
    with _appending, path.open("a") as log:
        log.write(line)


def parse_lines(text: str) -> list[Event]:
    """The events in JSONL text; lines that are not JSON objects with an "event" are skipped."""
    events = []
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict) and isinstance(event.get("event"), str):
            events.append(event)
    return events


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


@dataclass
class Checkpoint:
    """A checkpoint the trainer reported as committed."""

    step: int
    uri: str


@dataclass
class BestCheckpoint(Checkpoint):
    """The checkpoint with the lowest validation loss (checkpoint.keepBest)."""

    val_loss: float


@dataclass
class RunHistory:
    """What the metrics log has said so far (across earlier runs of the same job, too)."""

    step: int = 0
    max_steps: int | None = None
    epoch: float | None = None
    """Passes over the training data at the last logged step."""
    first_loss: float | None = None
    loss: float | None = None
    ce_loss: float | None = None
    kd_loss: float | None = None
    """Knowledge distillation: the two terms of the loss at the last logged step."""
    tokens_per_second: float | None = None
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    checkpoints: list[Checkpoint] = field(default_factory=list)
    best_checkpoint: BestCheckpoint | None = None
    """The checkpoint with the lowest validation loss, kept out of rotation (keepBest)."""
    resumed_from: list[int] = field(default_factory=list)
    """Step of each resume from a checkpoint, in order."""
    finished: Event | None = None
    """The `finished` event, once the trainer has written it."""
    goodput: dict[str, float] = field(default_factory=dict)
    """Seconds by cause since the job first started, from the latest `goodput` event."""
    checkpoint_load_tiers: dict[str, float] = field(default_factory=dict)
    """The same event's checkpoint_load seconds by tier (memory, partner, s3)."""

    def apply(self, event: Event) -> None:
        """Fold one event into the history."""
        kind = event["event"]
        step = event.get("step")
        if isinstance(step, int) and kind in {"step", "resumed", "start", "finished"}:
            # A resume may go back to an earlier step than the last one logged.
            self.step = step
        if kind in {"step", "start"}:
            self.max_steps = event.get("max_steps", self.max_steps)
        if kind == "step":
            self.epoch = _number(event.get("epoch"))
            self.loss = _number(event.get("loss"))
            self.ce_loss = _number(event.get("ce_loss"))
            self.kd_loss = _number(event.get("kd_loss"))
            if self.first_loss is None:
                self.first_loss = self.loss
            self.tokens_per_second = _number(event.get("tokens_per_second"))
        elif kind == "eval":
            val_loss = _number(event.get("val_loss"))
            if isinstance(step, int) and val_loss is not None:
                self.val_losses.append((step, val_loss))
        elif kind == "checkpoint" and isinstance(step, int):
            self.checkpoints.append(Checkpoint(step, str(event.get("uri", ""))))
            val_loss = _number(event.get("val_loss"))
            if event.get("best") is True and val_loss is not None:
                self.best_checkpoint = BestCheckpoint(step, str(event.get("uri", "")), val_loss)
        elif kind == "resumed" and isinstance(step, int):
            self.resumed_from.append(step)
        elif kind == "finished":
            self.finished = event
        elif kind == "goodput" and isinstance(event.get("seconds"), dict):
            seconds = {str(cause): _number(value) for cause, value in event["seconds"].items()}
            self.goodput = {cause: value for cause, value in seconds.items() if value is not None}
            tiers = event.get("checkpoint_load_tiers")
            tiers = {str(tier): _number(value)
                     for tier, value in (tiers.items() if isinstance(tiers, dict) else ())}
            self.checkpoint_load_tiers = {tier: value for tier, value in tiers.items()
                                          if value is not None}

    @property
    def best_val_loss(self) -> float | None:
        """Lowest validation loss: the trainer's own figure once finished, else the lowest seen."""
        if self.finished is not None and _number(self.finished.get("best_val_loss")) is not None:
            return _number(self.finished.get("best_val_loss"))
        return min((loss for _, loss in self.val_losses), default=None)

    @property
    def latest_checkpoint(self) -> Checkpoint | None:
        return max(self.checkpoints, key=lambda c: c.step, default=None)
