"""What the straggler rule compares under tensor parallelism, for both of its users: the
operator's rule (`kubetrain.operator.stragglers`) and goodput's straggler cause in the
trainer (`kubetrain.trainer.goodput.StragglerBooking`).

The ranks of one tensor-parallel group wait on each other inside every layer, in
collectives that rank timing does not time, so the group runs, and looks, as slow as its
slowest rank: it is judged as one. A group's compute is its smallest rank's (each rank
counts its waits for the others as compute, so the smallest figure has the least of other
groups' lateness in it), and the median is the median group's. The operator's module
docstring says why at length.
"""

from __future__ import annotations

from collections.abc import Sequence


def by_group(ranks: Sequence[int], computes: Sequence[float],
             tensor_parallel: int) -> tuple[list[float], list[float]]:
    """Each rank's compute as judged, and the figures the median is taken over: the ranks'
    own without tensor parallelism; under it, the smallest of each rank's tensor-parallel
    group (the group of rank r is r // tensor_parallel), with one figure per group. Ranks
    that do not fill whole groups (a group mid-rescale) are judged one by one."""
    if tensor_parallel <= 1 or len(ranks) % tensor_parallel:
        return list(computes), list(computes)
    groups: dict[int, float] = {}
    for rank, compute in zip(ranks, computes, strict=True):
        group = rank // tensor_parallel
        groups[group] = min(groups.get(group, compute), compute)
    if len(groups) * tensor_parallel != len(ranks):
        return list(computes), list(computes)
    return [groups[rank // tensor_parallel] for rank in ranks], list(groups.values())
