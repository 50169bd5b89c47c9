"""The straggler rule: which rank the others wait for, judged from each rank's compute time.

A synchronous job runs at the pace of its slowest rank, so one slow GPU, link or node
slows every rank. Each rank reports its compute time per step over each logged interval
(the trainer's kubetrain_rank_compute_seconds, gathered to rank 0, which the operator
scrapes). A rank's slowness is its compute time over the median rank's: the median, not
the mean or the fastest, so that one slow rank does not move the bar it is measured
against, and ordinary jitter between healthy ranks stays near 1. A rank above the
threshold for `window` consecutive judged intervals is a straggler: one slow interval
(a checkpoint, a burst of data loading, a noisy neighbour) is not.

Pure: no Kubernetes, no clock. `reconcile` keeps the result in status.ranks, which
carries each rank's streak from one scrape to the next and across operator restarts.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from kubetrain.api.trainingjob import RankSlowness, RanksStatus
from kubetrain.operator.observed import RankSample


def judge(previous: RanksStatus | None, step: int, ranks: Sequence[RankSample],
          threshold: float) -> RanksStatus:
    """Every rank's slowness in the interval ending at `step`, and how long it has been slow.

    The same `step` as `previous` is the same interval, scraped again: nothing changes.
    A rank's streak goes on only while the same pod holds that rank; after a membership
    change the ranks are new processes and start again from 0.
    """
    if previous is not None and previous.step == step:
        return previous
    computes = [rank.compute_seconds for rank in ranks]
    median = statistics.median(computes) if computes else 0.0
    before = {(rank.rank, rank.pod): rank.slow_intervals
              for rank in (previous.ranks if previous is not None else [])}
    judged = []
    for rank in ranks:
        slowness = rank.compute_seconds / median if median > 0 else 1.0
        streak = before.get((rank.rank, rank.pod), 0) + 1 if slowness > threshold else 0
        judged.append(RankSlowness(rank=rank.rank, pod=rank.pod, node=rank.node,
                                   slowness=round(slowness, 3), slow_intervals=streak))
    return RanksStatus(step=step, ranks=judged)


def stragglers(status: RanksStatus, window: int) -> list[RankSlowness]:
    """The ranks slow for at least `window` consecutive intervals, slowest first."""
    slow = [rank for rank in status.ranks if rank.slow_intervals >= window]
    return sorted(slow, key=lambda rank: -rank.slowness)
