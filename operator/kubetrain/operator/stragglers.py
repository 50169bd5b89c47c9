"""The straggler rule: which rank the others wait for, judged from each rank's compute time.

A synchronous job runs at the pace of its slowest rank, so one slow GPU, link or node
slows every rank. Each rank reports its compute time per step over each logged interval
(the trainer's kubetrain_rank_compute_seconds, gathered to rank 0, which the operator
scrapes). A rank's slowness is its compute time over the median rank's: the median, not
the mean or the fastest, so that one slow rank does not move the bar it is measured
against, and ordinary jitter between healthy ranks stays near 1. A rank above the
threshold for `window` consecutive judged intervals is a straggler: one slow interval
(a checkpoint, a burst of data loading, a noisy neighbour) is not. It stays one until it
has been at or under the threshold for as many consecutive intervals: a throttled or
failing machine is not steadily slow (a CPU quota, thermal throttling and retried links
all come in bursts), and a report that came and went with each burst would say less.

The interval judged is the span since the previous judgement, every step of it: each
rank also reports its compute seconds since its process started (a counter), and the
difference between two scrapes is what each rank computed in between. Only where a
counter is missing or went back (a new process) does the rule fall back on the last
logged interval alone, which with short steps is a small, noisy sample of the span.

Under tensor parallelism the unit judged is the tensor-parallel group, not the rank: the
ranks of one group wait on each other inside every layer (DTensor's collectives, which
rank timing does not time), so a slow rank's group peers count that wait as compute and
the group runs, and looks, as slow as its slowest rank; which rank of it is slow cannot
be told from the figures (the peer often shows the larger compute). So the group is
judged as one, and every rank of a slow group is named. A group's compute is its
smallest rank's: each rank of a group counts its waits for the others as compute, so the
smallest figure is the group's own pace with the least of other groups' lateness in it (a
rank that waited for a slow rank elsewhere in a timed collective makes its group peer
wait for it in an untimed one). The median is the median group's. The ranks of one
group are consecutive and inside one pod (the mesh keeps tensor parallelism within a
pod), so what is named is one pod on one node, which is what Replace moves. The operator
knows the spec's tensorParallel; a degree that `strategy: auto` chose is the trainer's
alone, and such a mesh is judged rank by rank, where the peers' like figures mostly name
the group anyway.

Pure: no Kubernetes, no clock. `kubetrain.operator.observation` keeps the result in
status.ranks, which carries each rank's streak from one scrape to the next and across
operator restarts; `kubetrain.operator.nodes` replaces a straggler.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from kubetrain.api.trainingjob import RankSlowness, RanksStatus
from kubetrain.operator.facts import RankSample
from kubetrain.straggler_groups import by_group


def judge(previous: RanksStatus | None, step: int, ranks: Sequence[RankSample],
          threshold: float, window: int, tensor_parallel: int = 1) -> RanksStatus:
    """Every rank's slowness in the interval ending at `step`, how long it has been slow
    (or, a straggler, back to normal), and whether it is a straggler.

    The same `step` as `previous` is the same interval, scraped again: nothing changes.
    A rank's streaks go on only while the same pod holds that rank; after a membership
    change the ranks are new processes and start again from 0. With `tensor_parallel`
    above 1, each rank is judged by its tensor-parallel group's compute against the median
    group's (`kubetrain.straggler_groups`).
    """
    if previous is not None and previous.step == step:
        return previous
    before = {(rank.rank, rank.pod): rank
              for rank in (previous.ranks if previous is not None else [])}
    computes = _since(before, ranks) or [rank.compute_seconds for rank in ranks]
    computes, judged_ones = by_group([rank.rank for rank in ranks], computes,
                                     tensor_parallel)
    median = statistics.median(judged_ones) if judged_ones else 0.0
    judged = []
    for rank, compute in zip(ranks, computes, strict=True):
        slowness = compute / median if median > 0 else 1.0
        last = before.get((rank.rank, rank.pod))
        slow = slowness > threshold
        slow_intervals = (last.slow_intervals if last else 0) + 1 if slow else 0
        normal_intervals = 0 if slow else (last.normal_intervals if last else 0) + 1
        was = last is not None and last.straggler
        straggler = slow_intervals >= window or (was and normal_intervals < window)
        judged.append(RankSlowness(rank=rank.rank, pod=rank.pod, node=rank.node,
                                   slowness=round(slowness, 3), slow_intervals=slow_intervals,
                                   straggler=straggler, normal_intervals=normal_intervals,
                                   compute_seconds_total=rank.compute_seconds_total))
    return RanksStatus(step=step, ranks=judged)


def _since(before: dict[tuple[int, str], RankSlowness],
           ranks: Sequence[RankSample]) -> list[float] | None:
    """Each rank's compute seconds since the previous judgement, from its counter; None
    unless every rank has one that grew (a rank new, restarted or without the counter)."""
    spans = []
    for rank in ranks:
        last = before.get((rank.rank, rank.pod))
        if (last is None or last.compute_seconds_total is None
                or rank.compute_seconds_total is None
                or rank.compute_seconds_total <= last.compute_seconds_total):
            return None
        spans.append(rank.compute_seconds_total - last.compute_seconds_total)
    return spans


def stragglers(status: RanksStatus) -> list[RankSlowness]:
    """The ranks that are stragglers now, slowest first."""
    return sorted((rank for rank in status.ranks if rank.straggler),
                  key=lambda rank: -rank.slowness)


def newly(previous: RanksStatus | None, status: RanksStatus) -> list[RankSlowness]:
    """The ranks that became stragglers in `status`'s interval (one report per episode)."""
    before = {(rank.rank, rank.pod) for rank in (previous.ranks if previous else [])
              if rank.straggler}
    return [rank for rank in stragglers(status) if (rank.rank, rank.pod) not in before]


def describe(rank: RankSlowness, window: int, tensor_parallel: int = 1) -> str:
    """A straggler in words: where it runs, how slow, for how long (or, slow no more, how
    far it is through the `window` of normal intervals that ends its report). Under tensor
    parallelism it is the rank's group that is slow, and the words say so."""
    if tensor_parallel > 1:
        first = rank.rank - rank.rank % tensor_parallel
        where = (f"rank {rank.rank} in pod {rank.pod} on node {rank.node}, of the "
                 f"tensor-parallel group of ranks {first}-{first + tensor_parallel - 1} "
                 "(they run at one pace: which of them is slow cannot be told), computes "
                 f"{rank.slowness:.2f}x the median group's time per step")
    else:
        where = (f"rank {rank.rank} in pod {rank.pod} on node {rank.node} computes "
                 f"{rank.slowness:.2f}x the median rank's time per step")
    if rank.slow_intervals:
        return f"{where}, for {rank.slow_intervals} intervals"
    return (f"{where}, at or under the threshold for {rank.normal_intervals} of the "
            f"{window} intervals that end its report")
