"""Goodput: where every second of a job's wall time went, cumulative across restarts.

Owns the accounting only; the loop (loop.py) says when a stretch of time ends
and what it was spent on, the reporter (metrics.py) exports the totals. Goodput
is productive step time over wall time, as Google's ml-goodput-measurement
defines it; the rest ("badput") is split by cause:

    productive        optimizer steps that the job keeps (goodput)
    data_wait         fetching a step's micro-batches
    checkpoint_save   the blocking part of checkpoint saves (and the final export)
    checkpoint_load   loading the checkpoint a restart resumes from; split apart by the
                      tier it came from (`load_seconds`): "memory" (the ranks' own
                      in-memory snapshots), "partner" (some ranks' parts from a partner's
                      copy), "s3" (the durable tier). A load that found nothing to resume
                      from (a fresh start, pretrained weights) is in no tier
    startup           process start to the first step: imports, rendezvous, build, compile
    preflight         the health check before each attempt's first step (preflight.py)
    evaluation        validation passes
    lost_progress     step time once spent on steps that a restart made the job redo
    downtime          the last heartbeat of one attempt to the start of the next:
                      pod replacement, scheduling, backoff; seen only from outside
    oom               lost progress and downtime of an attempt that ran out of memory:
                      the restart with half the micro-batch is counted apart, so a job
                      that keeps running out of memory shows it
    degraded          spec.faultTolerance's steps trained by fewer than all replica groups:
                      of a step trained by k of N groups, the (N - k) / N that the absent
                      groups' share of the batch stands for (what a degraded stretch cost)
    straggler         the group's time lost while a rank is a straggler: per logged
                      interval, its wall time over the healthy pace, moved out of
                      productive, and a save's time over a healthy save's, moved out of
                      checkpoint_save (`move`; `StragglerBooking` decides)

The split by tier is beside the causes, not one of them: `seconds` sums to the wall time,
`load_seconds` sums to at most `seconds["checkpoint_load"]`. The checkpoint keeps it
apart from the ledger's own state (`tier_state`, an app_state entry of its own), so that
checkpoints written before the split existed still load.

The ledger charges contiguous stretches: each `charge(cause)` books the time
since the previous one, so the causes always sum to the wall time since the
job's first attempt started (`origin`), by construction.

Across restarts. The ledger is a Stateful in the checkpoint, so a resumed
attempt starts from the totals at the checkpoint. What happened after that
checkpoint lives in the *heartbeat*: rank 0 writes the same totals to
`goodput.json` next to the checkpoints once the attempt is ready for its first step
and at every logged step. On resume the
stretch from the checkpoint to the last heartbeat keeps its causes, except that
its productive time becomes lost progress (those steps are done again); the
stretch from the last heartbeat to this attempt's start is downtime. The
resolution is therefore the log interval: steps after the last heartbeat count
as downtime, not lost progress. Whether the attempt being resumed ran out of
memory the ledger tells from the job's count of out-of-memory restarts
(status.effective, in the trainer's snapshot): one more than it has booked means
this resume follows one.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from torch.distributed.checkpoint.stateful import Stateful

from kubetrain.pod_conventions import ATTEMPT_STARTED_ENV
from kubetrain.straggler_groups import by_group
from kubetrain.trainer.storage import Storage

log = logging.getLogger(__name__)

PRODUCTIVE = "productive"
DATA_WAIT = "data_wait"
CHECKPOINT_SAVE = "checkpoint_save"
CHECKPOINT_LOAD = "checkpoint_load"
STARTUP = "startup"
EVALUATION = "evaluation"
LOST_PROGRESS = "lost_progress"
DOWNTIME = "downtime"
OUT_OF_MEMORY = "oom"
PREFLIGHT = "preflight"
STRAGGLER = "straggler"
DEGRADED = "degraded"
CAUSES = (PRODUCTIVE, DATA_WAIT, CHECKPOINT_SAVE, CHECKPOINT_LOAD, STARTUP, EVALUATION,
          LOST_PROGRESS, DOWNTIME, OUT_OF_MEMORY, PREFLIGHT, STRAGGLER, DEGRADED)
# Where a resumed checkpoint came from (checkpoint_load's split; memory_checkpoint.Restored).
MEMORY_TIER = "memory"
PARTNER_TIER = "partner"
S3_TIER = "s3"
LOAD_TIERS = (MEMORY_TIER, PARTNER_TIER, S3_TIER)

HEARTBEAT_NAME = "goodput.json"


def process_started_at() -> float:
    """Unix time this process started (Linux: /proc; elsewhere: now)."""
    try:
        with open("/proc/self/stat") as stat:
            # Field 22, after the parenthesised command name (which may hold spaces).
            started_ticks = int(stat.read().rpartition(")")[2].split()[19])
        since_boot = started_ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


def attempt_started_at() -> float:
    """When this attempt of the worker group started: the launcher's time, else the process's."""
    launched = os.environ.get(ATTEMPT_STARTED_ENV)
    # torchrun restarts in place keep the agent's environment: only its first round's is true.
    if launched and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        try:
            return min(float(launched), time.time())
        except ValueError:
            pass
    return process_started_at()


def _zero() -> dict[str, float]:
    return dict.fromkeys(CAUSES, 0.0)


def _tiers(seconds: Mapping[str, Any] | None) -> dict[str, float]:
    return {tier: float((seconds or {}).get(tier, 0.0)) for tier in LOAD_TIERS}


class LoadTierState(Stateful):
    """The ledger's checkpoint_load seconds by tier as a checkpoint entry of its own
    (app_state's `checkpoint_load_tiers`, optional: older checkpoints lack it)."""

    def __init__(self, ledger: GoodputLedger) -> None:
        self.ledger = ledger

    def state_dict(self) -> dict[str, Any]:
        return {"seconds": self.ledger.load_seconds}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Applied by the ledger's `resume`, with the rest of its checkpointed state.
        self.ledger._restored_tiers = _tiers(state_dict.get("seconds"))


class GoodputLedger(Stateful):
    """Seconds by cause since the job's first start; see the module docstring.

    `attempt_started` is the unix time this attempt began; `clock` returns unix
    seconds (injectable for tests).
    """

    def __init__(self, attempt_started: float, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.attempt_started = attempt_started
        self.origin = attempt_started
        self.step = 0
        self._before = _zero()  # earlier attempts (and the gap before this one)
        self._attempt = _zero()  # this attempt, from attempt_started to _mark
        self._mark = attempt_started
        self._restored: dict[str, Any] | None = None
        self.out_of_memory_restarts = 0  # the job's OOM restarts this ledger has booked
        self._tiers_before = _tiers(None)  # checkpoint_load by tier, as _before
        self._tiers_attempt = _tiers(None)
        self._restored_tiers: dict[str, float] | None = None
        self.tier_state = LoadTierState(self)

    def agree(self, attempt_started: float) -> None:
        """Take the group's start of this attempt (rank 0's) as this ledger's, before
        `resume`: a checkpoint keeps one rank's ledger, and rank 0's heartbeat must name
        the same job (`origin`) for the next attempt to book what came after it."""
        self.attempt_started = self.origin = attempt_started

    # --- charging -------------------------------------------------------------------

    def charge(self, cause: str) -> float:
        """Book the time since the previous charge to `cause`; returns those seconds."""
        now = max(self.clock(), self._mark)
        seconds = now - self._mark
        self._attempt[cause] += seconds
        self._mark = now
        return seconds

    def charge_load(self, tier: str | None) -> float:
        """Book the time since the previous charge to `checkpoint_load`, and to `tier`
        (one of LOAD_TIERS; None: nothing was resumed from); returns those seconds."""
        seconds = self.charge(CHECKPOINT_LOAD)
        if tier is not None:
            self._tiers_attempt[tier] += seconds
        return seconds

    def move(self, source: str, target: str, seconds: float) -> float:
        """Rebook up to `seconds` of this attempt's `source` time as `target` (the wall
        time is unchanged); returns the seconds moved."""
        moved = min(max(0.0, seconds), self._attempt[source])
        self._attempt[source] -= moved
        self._attempt[target] += moved
        return moved

    def stepped(self, step: int) -> None:
        """The step counter after a step (charge its time first)."""
        self.step = step

    # --- totals ---------------------------------------------------------------------

    @property
    def seconds(self) -> dict[str, float]:
        """Seconds by cause, `productive` included, up to the last charge."""
        return {cause: self._before[cause] + self._attempt[cause] for cause in CAUSES}

    @property
    def load_seconds(self) -> dict[str, float]:
        """checkpoint_load's seconds by the tier the checkpoint came from (LOAD_TIERS)."""
        return {tier: self._tiers_before[tier] + self._tiers_attempt[tier]
                for tier in LOAD_TIERS}

    @property
    def wall_seconds(self) -> float:
        """Wall time from the job's first start to the last charge (the sum of all causes)."""
        return sum(self.seconds.values())

    @property
    def ratio(self) -> float:
        """Productive seconds over wall seconds (1.0 before any time has passed)."""
        wall = self.wall_seconds
        return self.seconds[PRODUCTIVE] / wall if wall > 0 else 1.0

    def snapshot(self) -> dict[str, Any]:
        """The totals as of the last charge: what the heartbeat keeps (the checkpoint the
        same, with `checkpoint_load_tiers` in `tier_state`)."""
        return {"origin": self.origin, "time": self._mark, "step": self.step,
                "seconds": self.seconds, "oom_restarts": self.out_of_memory_restarts,
                "checkpoint_load_tiers": self.load_seconds}

    # --- restarts -------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        # The shape checkpoints have always had: the tiers are in `tier_state`.
        snapshot = self.snapshot()
        del snapshot["checkpoint_load_tiers"]
        return snapshot

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Applied by `resume`, once the heartbeat is known too.
        self._restored = {"origin": float(state_dict["origin"]),
                          "time": float(state_dict["time"]),
                          "step": int(state_dict["step"]),
                          "seconds": {cause: float(state_dict["seconds"].get(cause, 0.0))
                                      for cause in CAUSES},
                          "oom_restarts": int(state_dict.get("oom_restarts", 0))}

    def adopt(self, state: Mapping[str, Any]) -> None:
        """Take a live replica group's totals (its `state_dict` and `tier_state`'s, as
        fault_tolerance.py sends them) in place of this attempt's: the peer's ledger covers
        the job's wall time up to when it sent them, this group's own start-up included,
        so booking starts again from now."""
        self.origin = float(state["origin"])
        self.step = int(state["step"])
        self.out_of_memory_restarts = int(state.get("oom_restarts", 0))
        self._before = {cause: float(state["seconds"].get(cause, 0.0)) for cause in CAUSES}
        self._tiers_before = _tiers(state.get("checkpoint_load_tiers"))
        self._attempt, self._tiers_attempt = _zero(), _tiers(None)
        self._mark = max(self.clock(), self._mark)

    def resume(self, heartbeat: Mapping[str, Any] | None, *,
               from_this_job: bool = True, out_of_memory_restarts: int = 0) -> int | None:
        """Carry the earlier attempts' time into this one.

        Call once, after the checkpoint was loaded (or none was). `heartbeat` is
        the last one written (or None); `from_this_job` is False when the
        checkpoint came from another job (`resumeFrom`): then neither it nor the
        heartbeat's totals are this job's time, and accounting starts afresh.
        `out_of_memory_restarts` is the job's count so far: above the one booked, the
        attempt being resumed ran out of memory and its lost time is charged to `oom`.

        Returns the step of the heartbeat whose time was carried past the checkpoint: the
        steps up to it are booked as lost progress, the time after it as downtime. None
        when no heartbeat was newer than the checkpoint.
        """
        restored, self._restored = self._restored, None
        restored_tiers, self._restored_tiers = self._restored_tiers, None
        booked = max(int((restored or {}).get("oom_restarts", 0)),
                     int((heartbeat or {}).get("oom_restarts", 0)))
        after_oom = out_of_memory_restarts > booked
        self.out_of_memory_restarts = out_of_memory_restarts
        if not from_this_job:
            return None
        if heartbeat is not None and restored is not None \
                and float(heartbeat["origin"]) != restored["origin"]:
            heartbeat = None  # another job wrote it (a reused checkpoint URI)
        if restored is None:
            if heartbeat is None:
                return None
            # Killed before its first checkpoint: everything it trained is redone.
            restored = {"origin": float(heartbeat["origin"]), "time": float(heartbeat["origin"]),
                        "step": 0, "seconds": _zero()}
            restored_tiers = None
        self.origin = restored["origin"]
        before = dict(restored["seconds"])
        tiers = dict(restored_tiers or _tiers(None))
        gap_started = restored["time"]
        redone_through = None
        if heartbeat is not None and float(heartbeat["time"]) > gap_started:
            redone_through = int(heartbeat["step"])
            for cause in CAUSES:
                spent = float(heartbeat["seconds"].get(cause, 0.0)) - restored["seconds"][cause]
                lost = OUT_OF_MEMORY if after_oom else LOST_PROGRESS
                before[lost if cause == PRODUCTIVE else cause] += spent
            # A heartbeat of an older kubetrain has no split: nothing is added from it.
            for tier, seconds in _tiers(heartbeat.get("checkpoint_load_tiers")).items():
                tiers[tier] += max(0.0, seconds - (restored_tiers or {}).get(tier, 0.0))
            gap_started = float(heartbeat["time"])
        # Clocks of different machines may disagree a little; downtime is never negative.
        before[OUT_OF_MEMORY if after_oom else DOWNTIME] += max(
            0.0, self.attempt_started - gap_started)
        self._before = before
        self._tiers_before = tiers
        return redone_through


class StragglerBooking:
    """Which of a logged interval's time, and of a save's, is goodput's `straggler` cause.

    The operator's rule (`kubetrain.operator.stragglers`) applied to each logged interval
    on the figures every rank gathers (rank_timing): a rank's slowness is its compute time
    over the median rank's; above `threshold` for `window` consecutive intervals it is a
    straggler, and it stays one until it has been at or under the threshold for as many.
    Time is booked only once a rank is judged one: the jitter between healthy ranks is
    productive.

    While a rank is a straggler the group as a whole runs at its pace: the others wait for
    it in the steps' collectives, in the logged interval's gathers and in checkpoint
    saves. So what is booked is the group's loss, priced on this rank's clock:
    - an interval: its productive wall time (`wall`: the steps and the log between them,
      not data waits or saves, which are booked apart) over the healthy pace, the median
      of the last healthy intervals' wall time per step, times its steps. Before there is
      a healthy interval (a rank slow from the start) the pace is this interval's less what
      the slow rank cost it: the ranks within the threshold's compute plus the least wait
      (the slow rank's, which waits for nobody), for the median rank's compute plus wait;
    - a save (`saved`): its seconds over the median of the last healthy saves of the same
      kind; nothing before there is one.

    An episode is longer than its judgement. A slow rank's compute does not look slow in
    every interval (where it was held up inside a collective, the time counts as its wait),
    so its streaks break while the whole group stays slow. The episode is therefore the
    stretch of intervals in which a rank is slow or the group's pace is over `threshold`
    times the healthy one: what the stretch cost before the rank was judged (or between
    two judgements of it) is booked when it is, and dropped if the stretch ends first.

    Under tensor parallelism (`tensor_parallel` above 1) a tensor-parallel group is
    judged as one, as the operator judges it (`kubetrain.straggler_groups`).

    Every rank judges the same, from the same gathered figures; each prices the loss on
    its own clock, and the ranks' clocks agree to within a step's jitter, since each step
    ends in collectives that all of them wait for.
    """

    def __init__(self, threshold: float, window: int, remembered: int = 8,
                 tensor_parallel: int = 1) -> None:
        self.threshold = threshold
        self.window = max(1, window)
        self.tensor_parallel = tensor_parallel
        self.straggling = False
        self.slow_intervals = 0
        self.normal_intervals = 0
        self._remembered = remembered
        # the episode's loss so far, by the cause it is moved from, booked if it is judged
        self._pending = {PRODUCTIVE: 0.0, CHECKPOINT_SAVE: 0.0}
        self._healthy: deque[float] = deque(maxlen=remembered)  # wall seconds per step
        self._saves: dict[str, deque[float]] = {}  # healthy saves' seconds, by kind

    @property
    def in_episode(self) -> bool:
        return self.straggling or any(self._pending.values()) or self.slow_intervals > 0

    def pace_changed(self) -> None:
        """The group's healthy pace is another from here (spec.faultTolerance: replica groups
        left or joined the quorum, and the all-reduce across them with them): what was healthy
        before says nothing of the steps to come, so judging starts again; an episode
        pending is dropped, as one that ends before its judgement."""
        self.straggling = False
        self.slow_intervals = self.normal_intervals = 0
        self._pending = dict.fromkeys(self._pending, 0.0)
        self._healthy.clear()
        self._saves.clear()

    def lost(self, computes: Sequence[float], waits: Sequence[float], steps: int,
             wall: float) -> dict[str, float]:
        """The seconds to book as `straggler` after this logged interval, by the cause they
        move from (`productive`, and `checkpoint_save` for an episode's earlier saves):
        nothing unless a rank is judged one. `computes` and `waits` are each rank's
        seconds per step over the interval, in rank order; `wall` is the interval's
        productive seconds on this rank."""
        if len(computes) < 2 or steps <= 0:
            return {}
        judged, compared = by_group(range(len(computes)), computes, self.tensor_parallel)
        median = statistics.median(compared)
        slowness = [compute / median if median > 0 else 1.0 for compute in judged]
        slow = max(slowness) > self.threshold
        pace = wall / steps
        self.slow_intervals = self.slow_intervals + 1 if slow else 0
        self.normal_intervals = 0 if slow else self.normal_intervals + 1
        healthy = statistics.median(self._healthy) if self._healthy else pace - (
            statistics.median(c + w for c, w in zip(computes, waits, strict=True))
            - min(waits) - statistics.median(
                c for c, s in zip(computes, slowness, strict=True) if s <= self.threshold))
        loss = max(0.0, pace - healthy) * steps
        group_slow = bool(self._healthy) and pace > self.threshold * healthy
        if self.straggling:
            if self.normal_intervals < self.window:
                return {PRODUCTIVE: loss} if loss else {}
            self.straggling = False  # judged over; the episode goes on while the group is slow
        if not (slow or group_slow):
            self._healthy.append(pace)
            self._pending = dict.fromkeys(self._pending, 0.0)
            return {}
        self._pending[PRODUCTIVE] += loss
        if self.slow_intervals < self.window:
            return {}
        self.straggling = True
        booked, self._pending = self._pending, dict.fromkeys(self._pending, 0.0)
        return {source: seconds for source, seconds in booked.items() if seconds}

    def saved(self, kind: str, seconds: float) -> float:
        """The seconds of a save of `kind` (S3, memory) to book as `straggler` now: what it
        took over the healthy saves while a rank is one. In an episode not yet judged that
        is kept for the judgement; outside one the save becomes the reference."""
        healthy = self._saves.setdefault(kind, deque(maxlen=self._remembered))
        excess = max(0.0, seconds - statistics.median(healthy)) if healthy else 0.0
        if self.straggling:
            return excess
        if self.in_episode:
            self._pending[CHECKPOINT_SAVE] += excess
        else:
            healthy.append(seconds)
        return 0.0


class Heartbeat:
    """Rank 0's `goodput.json` under the checkpoint URI: the ledger after the last logged step.

    Writes run in one background thread and never hold a step up; snapshots that
    arrive while one is being written collapse into the newest, written next.
    """

    def __init__(self, store: Storage) -> None:
        self.store = store
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="goodput")
        self._lock = threading.Lock()
        self._pending: dict[str, Any] | None = None
        self._draining = False
        self._in_flight: Future[None] | None = None

    def read(self) -> dict[str, Any] | None:
        """The last heartbeat written, or None when there is none (or it is unreadable)."""
        try:
            data = json.loads(self.store.read_unchecked(HEARTBEAT_NAME))
        except FileNotFoundError:
            return None
        except Exception as error:  # a storage or JSON error: account as if there were none
            log.warning("ignoring %s/%s: %s", self.store.uri, HEARTBEAT_NAME, error)
            return None
        return data if isinstance(data, dict) and {"origin", "time", "seconds"} <= set(data) \
            else None

    def write(self, snapshot: dict[str, Any], *, wait: bool = False) -> None:
        """Write `snapshot` in the background; `wait` returns once it is written."""
        with self._lock:
            self._pending = snapshot
            if not self._draining:
                self._draining = True
                self._in_flight = self._writer.submit(self._drain)
        if wait:
            self.flush()

    def flush(self) -> None:
        """Wait until every snapshot given so far is written."""
        with self._lock:
            in_flight = self._in_flight
        if in_flight is not None:
            in_flight.result()

    def close(self) -> None:
        self.flush()
        self._writer.shutdown(wait=True)

    def _drain(self) -> None:
        while True:
            with self._lock:
                snapshot, self._pending = self._pending, None
                if snapshot is None:
                    self._draining = False
                    return
            self._put(snapshot)

    def _put(self, snapshot: dict[str, Any]) -> None:
        try:
            self.store.write_bytes(HEARTBEAT_NAME, json.dumps(snapshot).encode())
        except Exception as error:  # accounting must never stop training
            log.warning("cannot write %s/%s: %s", self.store.uri, HEARTBEAT_NAME, error)
