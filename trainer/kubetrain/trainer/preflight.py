"""Preflight: a short health check of every rank before the first step of each attempt.

Owns the check only; the loop (loop.py) runs it around joining the group, records a
failure and ends the attempt. Two stages under one deadline
(`runPolicy.preflight.timeoutSeconds`, from the check's start), and the join between them:
a group that does not form (a rank stalled after its device check) fails the check too
(`failed_to_join`), naming the ranks that never began to join:

1. Device, before the process group exists: each rank multiplies two 256 x 256
   matrices in float32 on its device and compares the product with float64 on the
   CPU (relative Frobenius error at most `MATMUL_TOLERANCE`: float32 is ~1e-6 off,
   TF32 ~1e-3, a broken device O(1)). It checks in through the attempt's key-value
   store (`distributed.attempt_store`: torchrun's agent hosts it, so it exists before
   any rank joins a group). Rank 0 waits for every rank's report until the deadline
   and posts its verdict; the others wait for it. A rank stopped anywhere before this
   point, even inside `import torch`, holds nobody past the deadline, and nobody
   enters init_process_group with a peer that cannot answer.
2. Group, once the process group is formed: an all-reduce over it, started with
   async_op and polled until the deadline (so a peer that stalls now cannot hang it),
   checks the sum and measures the group's bus bandwidth (printed, not judged: a ring
   all-reduce takes every rank as long as its slowest link, so a slow node slows every
   rank's measurement alike, and only who arrived late would tell them apart). Then each
   rank exchanges a tensor with each of its two neighbours in the ring of ranks, one pair
   at a time in rounds of disjoint pairs (`link_pairings`), and reports its best link's
   bandwidth: a slow node's links are all slow, a healthy neighbour's other link is not.
   A rank whose best link is under `minBandwidthFraction` times the median rank's is
   measured again, with every rank, before it is judged: it fails only when its link is
   under that bar in both rounds. A process descheduled through one round on a busy host
   is not a slow node, and a failure here marks its node to avoid.
   Reports and verdict go through the store again. A group of one has nobody to exchange
   with and skips this stage; in a group of two both ranks share their one link, so a
   slow one cannot be told from its partner.
3. Mesh, under a mesh of two or more dimensions (HSDP, tensor parallelism; `mesh`, from
   `mesh.preflight_dimensions`): the flat all-reduce may pass while a dimension's own
   groups (the pairs across pods, the ranks of one pod) cannot form or all-reduce. Every
   rank forms every dimension's groups as init_device_mesh does (`dist.new_group`, on a
   thread bounded by the deadline) and all-reduces over its own as in stage 2, checking
   the sum; a failure names the
   dimension and its group's ranks, and a rank that never reports is named with the
   groups that waited on it. Each dimension's median bandwidth is printed; only the flat
   all-reduce's is judged (groups measured at once on a shared host differ by more than
   the fraction allows without any fault).

A rank fails when its product is wrong, it raises, it has not reported by the deadline
(a stalled or stopped process), or its best link is too slow. When some ranks never
reported, they are the ones blamed: the others' all-reduces timing out follows from
them. Each report carries the rank's pod and node (the downward API's
KUBETRAIN_POD_NAME and KUBETRAIN_NODE_NAME, else the host name) and its torchrun agent
(GROUP_RANK); a rank that never reported is named by the node of another rank of its
agent when one reported, and as "node unknown" otherwise: with one rank per pod, a
process stopped before it ran a line of Python tells nobody where it runs. The verdict
then also lists the nodes of the ranks that did report (`reported_nodes`), so whoever
knows every pod's node (the operator) can tell the failing ones by elimination.

This module must not touch the model, the data or the loop.
"""

from __future__ import annotations

import errno
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from kubetrain.api.trainingjob import PreflightPolicy
from kubetrain.trainer.bounded import run_bounded
from kubetrain.trainer.lifeline import where_am_i

MATMUL_SIZE = 256
MATMUL_TOLERANCE = 1e-2  # relative Frobenius error of the float32 product
# What each rank sends in an all-reduce or an exchange with a neighbour: a few ms on either.
MEASURED_BYTES = {"cpu": 4 << 20, "cuda": 64 << 20}
TIMED_ROUNDS = 5  # of each measurement, after one untimed that sets the connections up
VERDICT_GRACE_SECONDS = 5.0  # past the deadline, for rank 0's verdict to arrive
POLL_SECONDS = 0.005
T = TypeVar("T")


@dataclass(frozen=True)
class RankReport:
    """What one rank says about itself at one stage: empty `problem` means it passed."""

    rank: int
    pod: str
    node: str
    agent: int  # torchrun's GROUP_RANK: the ranks of one agent share a pod and node
    problem: str = ""
    bandwidth: float = 0.0  # GB/s of the all-reduce's bus bandwidth (group stage)
    link: float = 0.0  # GB/s of its best link to a neighbouring rank (group stage)
    dimensions: dict[str, float] = field(default_factory=dict)  # GB/s by dimension (mesh)

    def named(self) -> str:
        return f"rank {self.rank} (pod {self.pod}, node {self.node})"


@dataclass(frozen=True)
class Failure:
    """One failing rank and why; `report` is None for a rank that never reported."""

    rank: int
    why: str
    report: RankReport | None = None
    slow_link: bool = False  # its link alone was under the bar: measured again first


@dataclass
class Verdict:
    """Rank 0's judgement of one stage, as every rank reads it from the store."""

    problems: list[str] = field(default_factory=list)  # one sentence per failing rank
    nodes: list[str] = field(default_factory=list)  # their nodes, where known
    # When a failing rank's node is unknown: the nodes of every rank that reported.
    reported_nodes: list[str] = field(default_factory=list)
    # The lowest reporting rank of each torchrun agent: it writes its pod's termination
    # message and stops its agent (one writer per pod).
    writers: list[int] = field(default_factory=list)
    # When every failing rank failed on its link alone: those ranks, measured again
    # (with every rank) before the stage is judged.
    slow_links: list[int] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems


class PreflightFailed(Exception):
    """The check failed: `nodes` are the failing ranks' nodes (those known), and
    `reported_nodes`, when some are unknown, the nodes of the ranks that reported."""

    def __init__(self, message: str, nodes: list[str],
                 reported_nodes: list[str] | None = None) -> None:
        super().__init__(message)
        self.nodes = nodes
        self.reported_nodes = reported_nodes or []


class StorePortTaken(RuntimeError):
    """Rank 0 could not host the attempt's store: its port (MASTER_PORT, which torchrun's
    agent found free) was taken before rank 0 listened. No fault of the node, so no preflight
    verdict: the error propagates, torchrun restarts the attempt in place, and its new
    rendezvous round picks a new port."""


def matmul_error(device: torch.device) -> float:
    """Relative error of a float32 product on `device` against float64 on the CPU."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, dtype=torch.float64, generator=generator)
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE, dtype=torch.float64, generator=generator)
    product = (a.float().to(device) @ b.float().to(device)).double().cpu()
    reference = a @ b
    error = float(torch.linalg.norm(product - reference) / torch.linalg.norm(reference))
    return float("inf") if math.isnan(error) else error  # garbage out fails the check


def all_reduce_bandwidth(device: torch.device, deadline: float,
                         group: dist.ProcessGroup | None = None) -> float:
    """Bus bandwidth in GB/s of the fastest of a few all-reduces over `group` (default: the
    world), each polled to `deadline`; raises when one does not sum what it should.

    The fastest, not the mean: a rank that arrives late at a round, or is descheduled
    for a moment on a busy host, makes its peers wait inside that round's timing and
    would mark them slow; a slow device or link slows every round.
    """
    world_size = dist.get_world_size(group)
    tensor = torch.ones(MEASURED_BYTES[device.type] // 4, dtype=torch.float32, device=device)
    _finish(dist.all_reduce(tensor, group=group, async_op=True), deadline)
    if float(tensor[0]) != world_size:  # ones summed over the group
        raise ValueError(f"it summed {float(tensor[0]):g}, not {world_size}")
    fastest = math.inf
    for _ in range(TIMED_ROUNDS):
        started = time.perf_counter()
        _finish(dist.all_reduce(tensor, group=group, async_op=True), deadline)
        fastest = min(fastest, time.perf_counter() - started)
    # The bytes each rank sends and receives in a ring all-reduce (NCCL's "bus bandwidth").
    moved = 2 * (world_size - 1) / world_size * tensor.numel() * 4
    return moved / fastest / 1e9


def link_pairings(world_size: int) -> list[dict[int, int]]:
    """Rounds of disjoint pairs (rank: its partner) in which each rank meets both its
    neighbours in the ring of ranks, each once: two rounds for an even world, three for an
    odd one (the last rank and the first meet alone), one for a world of two."""
    # The ring's edges, each once: a world of two has one (0-1 and 1-0 are the same).
    links = list(dict.fromkeys(tuple(sorted((rank, (rank + 1) % world_size)))
                               for rank in range(world_size) if world_size > 1))
    rounds: list[dict[int, int]] = []
    for a, b in links:
        pairs = next((pairs for pairs in rounds if a not in pairs and b not in pairs), None)
        if pairs is None:
            pairs = {}
            rounds.append(pairs)
        pairs[a], pairs[b] = b, a
    return rounds


def link_bandwidth(device: torch.device, deadline: float) -> float:
    """GB/s of this rank's best link: the fastest of a few exchanges (a tensor sent to the
    partner while one is received from it) with each of its partners in `link_pairings`,
    the better partner's; raises when a received tensor is not what was sent.

    Every rank goes through the rounds in order, exchanging only with its partner of each:
    a pair's exchange starts once both are done with their earlier rounds, so no rank waits
    on one that waits on it. Each timed exchange follows an untimed one of a single number,
    which both ranks leave once the other has come: a partner that arrives late (descheduled
    for a moment on a busy host) costs the punctual one nothing, and a pair's exchange takes
    both as long. The rounds of a pair with a slow node are slow for both, but a healthy
    rank's other partner is not slow; a slow node's every partner is."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    sent = torch.full((MEASURED_BYTES[device.type] // 4,), float(rank + 1), device=device)
    received = torch.empty_like(sent)
    here = sent[:1].clone()  # the handshake's single number, and its partner's
    there = torch.empty_like(here)
    best = 0.0
    for pairs in link_pairings(world_size):
        partner = pairs.get(rank)
        if partner is None:
            continue
        fastest = math.inf
        for timed in [False] + [True] * TIMED_ROUNDS:  # the first sets the pair up
            _exchange(here, there, partner, device, deadline)
            started = time.perf_counter()
            _exchange(sent, received, partner, device, deadline)
            if timed:
                fastest = min(fastest, time.perf_counter() - started)
        if float(received[0]) != partner + 1 or float(received[-1]) != partner + 1:
            raise ValueError(f"it received {float(received[0]):g} from rank {partner}, "
                             f"not {partner + 1}")
        best = max(best, sent.numel() * 4 / fastest / 1e9)
    return best


def _exchange(sent: torch.Tensor, received: torch.Tensor, partner: int,
              device: torch.device, deadline: float) -> None:
    """Send `sent` to `partner` while receiving `received` from it, by `deadline`."""
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, sent, partner),
                                        dist.P2POp(dist.irecv, received, partner)]):
        if device.type == "cuda":  # NCCL's: polled, as a wait would hang on a stall
            _finish(work, deadline)
        else:  # gloo's sends and receives say they are complete only once waited for
            work.wait(timeout=timedelta(seconds=max(0.001, deadline - time.monotonic())))


def mesh_groups(sizes: dict[str, int]) -> dict[str, list[list[int]]]:
    """The process groups of each dimension of a row-major mesh of `sizes` (name: size,
    outermost first), as init_device_mesh lays it out: the ranks that differ only in that
    dimension's coordinate. {"dp_replicate": 2, "dp_shard": 2} gives dp_replicate
    [[0, 2], [1, 3]] and dp_shard [[0, 1], [2, 3]]."""
    grid = torch.arange(math.prod(sizes.values())).reshape(tuple(sizes.values()))
    return {name: grid.movedim(axis, -1).reshape(-1, size).tolist()
            for axis, (name, size) in enumerate(sizes.items())}


def _named_group(name: str, ranks: list[int]) -> str:
    return f"{name} (ranks {', '.join(map(str, ranks))})"


def _finish(work: dist.Work | None, deadline: float) -> None:
    assert work is not None
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError("the collective did not complete by the deadline")
        time.sleep(POLL_SECONDS / 5)
    work.wait()  # raises the collective's own error, if it failed


class Preflight:
    """The check of one attempt, on one rank: `check_device()`, join the group, `check_group()`.

    `store` is the attempt's store (None for a group of one); `rank` and `world_size`
    come from torchrun's environment; `mesh` the job's mesh dimensions (name: size,
    outermost first; none for a 1-D mesh), whose groups `check_mesh()` all-reduces over.
    """

    def __init__(self, policy: PreflightPolicy, *, rank: int, world_size: int,
                 device: torch.device, store: dist.Store | None,
                 mesh: dict[str, int] | None = None) -> None:
        self.policy = policy
        self.rank, self.world_size, self.device = rank, world_size, device
        self.store = dist.PrefixStore("preflight", store) if store is not None else None
        self.started = time.perf_counter()
        self.deadline = time.monotonic() + policy.timeout_seconds
        pod, node = where_am_i()
        self.me = RankReport(rank, pod, node, int(os.environ.get("GROUP_RANK", "0")))
        self.verdict: Verdict | None = None
        self.bandwidths: list[float] = []  # the all-reduce's, by rank
        self.links: list[float] = []  # each rank's best link's
        # On rank 0: the ranks whose link the first round found slow, with its GB/s.
        self.slow_first: dict[int, float] = {}
        # The groups of each dimension of several ranks, when two or more such dimensions
        # lay out this world (one alone is the world, which the group stage checks).
        sizes = mesh or {}
        several = [name for name, size in sizes.items() if size > 1]
        self.groups: dict[str, list[list[int]]] = (
            {name: groups for name, groups in mesh_groups(sizes).items() if name in several}
            if len(several) > 1 and math.prod(sizes.values()) == world_size else {})
        self.mesh_bandwidths: dict[str, float] = {}  # median GB/s by dimension
        # A thread still blocked joining the group (`join`) or forming the mesh's groups.
        self.abandoned_join = False

    # --- the two stages -----------------------------------------------------------

    def check_device(self) -> None:
        """The matrix multiply, then every rank's check-in (raises PreflightFailed)."""
        try:
            error = matmul_error(self.device)
            problem = ("" if error <= MATMUL_TOLERANCE else
                       f"its float32 matmul on {self.device} is off by {error:.1e} "
                       f"(relative; at most {MATMUL_TOLERANCE:.0e})")
        except Exception as raised:  # a device that raises fails the check, it does not crash
            problem = f"its matmul on {self.device} raised {type(raised).__name__}: {raised}"
        mine = replace(self.me, problem=problem)
        if self.store is None:
            if problem:
                raise PreflightFailed(f"preflight failed: {mine.named()}: {problem}",
                                      [mine.node])
            return
        self._stage("device", mine, self._judge_device)

    def check_group(self) -> None:
        """The all-reduce over the formed group, then the links to each rank's neighbours,
        whose bandwidth is judged (raises PreflightFailed)."""
        if self.store is None or self.world_size == 1:
            return
        # Each rank gives up on its exchanges a little before the deadline, so its
        # report still reaches rank 0 in time.
        give_up = self.deadline - min(1.0, self.policy.timeout_seconds / 10)
        try:
            mine = replace(self.me, bandwidth=all_reduce_bandwidth(self.device, give_up))
        except Exception as raised:
            mine = replace(self.me, problem=f"its all-reduce failed: {raised}")
        else:
            mine = self._measure_links(mine, give_up)
        try:
            self._stage("group", mine, self._judge_group)
        except PreflightFailed:
            assert self.verdict is not None
            if not self.verdict.slow_links:
                raise
            self._stage("group-again", self._measure_links(mine, give_up),
                        self._judge_links_again)

    def _measure_links(self, mine: RankReport, give_up: float) -> RankReport:
        try:
            return replace(mine, link=link_bandwidth(self.device, give_up))
        except Exception as raised:
            return replace(mine, problem=f"its exchange with a neighbouring rank failed: "
                                         f"{raised}")

    def check_mesh(self) -> None:
        """The all-reduce over this rank's group of each mesh dimension (raises
        PreflightFailed, naming the dimension and its ranks)."""
        if self.store is None or not self.groups:
            return
        give_up = self.deadline - min(1.0, self.policy.timeout_seconds / 10)
        formed, problem = self._form_groups(give_up)
        measured: dict[str, float] = {}
        for name, (ranks, group) in formed.items():
            try:
                measured[name] = all_reduce_bandwidth(self.device, give_up, group)
            except Exception as raised:
                problem = f"its all-reduce over {_named_group(name, ranks)} failed: {raised}"
                break
        if not problem:  # a group with an all-reduce left unfinished is left as it is
            for _, group in formed.values():
                dist.destroy_process_group(group)
        self._stage("mesh", replace(self.me, problem=problem, dimensions=measured),
                    self._judge_mesh)

    def _form_groups(self, give_up: float) -> tuple[
            dict[str, tuple[list[int], dist.ProcessGroup]], str]:
        """This rank's group of each dimension, and what went wrong forming them ('').

        Every rank forms every group, in the same order, as init_device_mesh does: NCCL
        splits a subgroup's communicator from the whole group's, with every rank taking
        part. On a thread given up at `give_up` (NCCL's split would wait on a stalled
        rank with no deadline); a thread left behind sets `abandoned_join`."""
        mine: dict[str, tuple[list[int], dist.ProcessGroup]] = {}
        forming: list[str] = []  # the group being formed: the one a failure names

        def form() -> None:
            for name, groups in self.groups.items():
                for ranks in groups:
                    forming[:] = [_named_group(name, ranks)]
                    group = dist.new_group(ranks, timeout=timedelta(
                        seconds=max(0.1, give_up - time.monotonic())))
                    if self.rank in ranks:
                        assert group is not None
                        mine[name] = (ranks, group)

        outcome = run_bounded(form, give_up - time.monotonic(), name="preflight-mesh")
        if outcome.finished and outcome.error is None:
            return mine, ""
        self.abandoned_join = not outcome.finished
        why = outcome.error or "not formed by the deadline"
        return {}, f"forming the group {forming[0]} failed: {why}"

    def joining(self) -> None:
        """Say, through the store, that this rank passed the device stage and now joins the
        group (init_process_group): a rank that never says so stalled before it."""
        if self.store is not None:
            self.store.set(f"joining/{self.rank}", json.dumps(asdict(self.me)))

    def join(self, init: Callable[[], T], reconnect: Callable[[], dist.Store]) -> T:
        """`init()` (joining the group) by the check's deadline and grace: on a thread, left
        behind when it does not return in time (`abandoned_join`), since gloo's and NCCL's
        rendezvous wait for their own timeout (30 minutes and more) on a peer that stalled.
        Raises PreflightFailed then, or when joining fails; `reconnect()` opens another
        connection to the attempt's store, as the one the join uses is not free."""
        if self.store is None:
            return init()
        outcome = run_bounded(init, max(0.0, self.deadline - time.monotonic())
                              + VERDICT_GRACE_SECONDS, name="preflight-join")
        try:
            return outcome.value("init_process_group did not return")
        except Exception as error:
            self.abandoned_join = not outcome.finished
            try:
                store: dist.Store | None = dist.PrefixStore("preflight", reconnect())
            except Exception:  # the store's host may be the one that stalled
                store = None
            raise self.failed_to_join(error, store) from error

    def failed_to_join(self, error: Exception, store: dist.Store | None) -> PreflightFailed:
        """The failure of a group that did not form between the two stages (a rank stalled
        after its device check): the check's, not an unknown one. The ranks that never
        began to join are named; when every rank began, one stalled inside
        init_process_group, and the nodes of all that began are listed for elimination."""
        reports = [_read(store, f"joining/{rank}") if store is not None else None
                   for rank in range(self.world_size)]
        reports[self.rank] = self.me
        why = f"did not join the group within {self.policy.timeout_seconds}s"
        failures = [Failure(rank, f"{why} (stalled after its device check)")
                    for rank, report in enumerate(reports) if report is None]
        if failures:
            verdict = self._verdict(failures, reports)
            problems, nodes, reported = verdict.problems, verdict.nodes, verdict.reported_nodes
        else:
            problems = [f"the group did not form within {self.policy.timeout_seconds}s: a "
                        "rank stalled inside init_process_group"]
            nodes, reported = [], sorted({report.node for report in reports if report})
        return PreflightFailed(f"preflight failed: {'; '.join(problems)} ({error})".strip(),
                               nodes, reported)

    def summary(self) -> str:
        """The line rank 0 prints once the check passed."""
        seconds = time.perf_counter() - self.started
        ranks = f"{self.world_size} rank{'s' if self.world_size > 1 else ''}"
        if not self.bandwidths:
            return (f"preflight: {ranks} passed in {seconds:.2f}s (matmul ok, no all-reduce "
                    "in a group of one)")
        mesh = "".join(f", {name} {bandwidth:.2f}"
                       for name, bandwidth in self.mesh_bandwidths.items())
        again = (f"; measured again, as rank{'s' if len(self.slow_first) > 1 else ''} "
                 f"{', '.join(map(str, sorted(self.slow_first)))} moved under "
                 f"{self.policy.min_bandwidth_fraction:g} x the median in the first round"
                 if self.slow_first else "")
        return (f"preflight: {ranks} passed in {seconds:.2f}s (matmul ok, all-reduce "
                f"{statistics.median(self.bandwidths):.2f} GB/s median, links "
                f"{statistics.median(self.links):.2f} GB/s median, {min(self.links):.2f} min"
                + again + (f"; by mesh dimension, GB/s median{mesh}" if mesh else "") + ")")

    # --- judging ------------------------------------------------------------------

    def _judge_device(self, reports: list[RankReport | None]) -> list[Failure]:
        return self._missing(reports) + [
            Failure(report.rank, report.problem, report)
            for report in reports if report is not None and report.problem]

    def _judge_group(self, reports: list[RankReport | None]) -> list[Failure]:
        present, failed = self._reported(reports)
        if failed:
            return failed
        self.bandwidths = [report.bandwidth for report in present]
        failed = self._slow_links(present)
        slow = {failure.rank for failure in failed}
        self.slow_first = {report.rank: report.link for report in present if report.rank in slow}
        return failed

    def _judge_links_again(self, reports: list[RankReport | None]) -> list[Failure]:
        """The second round of links: a rank under the bar in both rounds fails; one under
        it only once passes."""
        present, failed = self._reported(reports)
        if failed:
            return failed
        return [replace(failure, why=f"{failure.why}, in both of two rounds (the first: "
                                     f"{self.slow_first[failure.rank]:.2f} GB/s)",
                        slow_link=False)
                for failure in self._slow_links(present) if failure.rank in self.slow_first]

    def _reported(self, reports: list[RankReport | None],
                  ) -> tuple[list[RankReport], list[Failure]]:
        """The reports of a group stage, or its failures before any link is judged."""
        missing = self._missing(reports)
        if missing:
            return [], missing  # the others' all-reduces could not finish without them
        present = [report for report in reports if report is not None]
        return present, [Failure(report.rank, report.problem, report)
                         for report in present if report.problem]

    def _slow_links(self, present: list[RankReport]) -> list[Failure]:
        self.links = [report.link for report in present]
        median = statistics.median(self.links)
        floor = self.policy.min_bandwidth_fraction * median
        return [Failure(report.rank, f"its best link to a neighbouring rank moved "
                        f"{report.link:.2f} GB/s, under {self.policy.min_bandwidth_fraction:g}"
                        f" x the median rank's {median:.2f} GB/s", report, slow_link=True)
                for report in present if report.link < floor]

    def _judge_mesh(self, reports: list[RankReport | None]) -> list[Failure]:
        missing = self._missing(reports)
        if missing:  # named with the groups that could not all-reduce without them
            return [Failure(failure.rank, f"{failure.why}: the all-reduces over " + ", ".join(
                _named_group(name, ranks) for name, groups in self.groups.items()
                for ranks in groups if failure.rank in ranks) + " waited on it")
                for failure in missing]
        present = [report for report in reports if report is not None]
        failed = [Failure(report.rank, report.problem, report)
                  for report in present if report.problem]
        if not failed:
            self.mesh_bandwidths = {
                name: statistics.median(report.dimensions[name] for report in present)
                for name in self.groups}
        return failed

    def _missing(self, reports: list[RankReport | None]) -> list[Failure]:
        return [Failure(rank, f"did not report within {self.policy.timeout_seconds}s "
                        "(stalled, stopped or gone)")
                for rank, report in enumerate(reports) if report is None]

    # --- through the store --------------------------------------------------------

    def _stage(self, stage: str, mine: RankReport,
               judge: Callable[[list[RankReport | None]], list[Failure]]) -> None:
        """Report `mine`; rank 0 collects and judges, the others read its verdict."""
        assert self.store is not None
        self.store.set(f"{stage}/{self.rank}", json.dumps(asdict(mine)))
        if self.rank == 0:
            reports = self._collect(stage)
            verdict = self._verdict(judge(reports), reports)
            self.store.set(f"{stage}/verdict", json.dumps(asdict(verdict)))
        else:
            verdict = self._await_verdict(stage)
        self.verdict = verdict
        if not verdict.passed:
            raise PreflightFailed("preflight failed: " + "; ".join(verdict.problems),
                                  verdict.nodes, verdict.reported_nodes)

    def _collect(self, stage: str) -> list[RankReport | None]:
        """Every rank's report of `stage`, None for those that have none by the deadline."""
        assert self.store is not None
        keys = [f"{stage}/{rank}" for rank in range(self.world_size)]
        waiting = set(keys)
        while waiting and time.monotonic() < self.deadline:
            waiting = {key for key in waiting if not self.store.check([key])}
            if waiting:
                time.sleep(POLL_SECONDS)
        reports: list[RankReport | None] = []
        for key in keys:
            reports.append(None if key in waiting
                           else RankReport(**json.loads(self.store.get(key))))
        return reports

    def _verdict(self, failures: list[Failure], reports: list[RankReport | None]) -> Verdict:
        """The failures in words, each rank named with its pod and node where known."""
        verdict = Verdict()
        agents: set[int] = set()
        for report in reports:  # by rank: the first of each agent is its lowest
            if report is not None and report.agent not in agents:
                agents.add(report.agent)
                verdict.writers.append(report.rank)
        for failure in failures:
            report = failure.report or _sibling(failure.rank, reports)
            if report is None:
                verdict.problems.append(f"rank {failure.rank} (node unknown) {failure.why}")
                verdict.reported_nodes = sorted({report.node for report in reports
                                                 if report is not None})
                continue
            named = (report.named() if report.rank == failure.rank else
                     f"rank {failure.rank} (pod {report.pod}, node {report.node})")
            verdict.problems.append(f"{named} {failure.why}" if failure.report is None
                                    else f"{named}: {failure.why}")
            if report.node not in verdict.nodes:
                verdict.nodes.append(report.node)
        if failures and all(failure.slow_link for failure in failures):
            verdict.slow_links = [failure.rank for failure in failures]
        return verdict

    def _await_verdict(self, stage: str) -> Verdict:
        """Rank 0's verdict; without one by the deadline (and a grace), rank 0 failed."""
        assert self.store is not None
        key = f"{stage}/verdict"
        until = self.deadline + VERDICT_GRACE_SECONDS
        try:
            while not self.store.check([key]):
                if time.monotonic() > until:
                    raise TimeoutError(f"no verdict within {self.policy.timeout_seconds}s")
                time.sleep(POLL_SECONDS)
            return Verdict(**json.loads(self.store.get(key)))
        except Exception as error:  # a store hosted by a stopped rank 0 times out too
            return _rank_0_silent(f"gave no verdict ({error})", self.me,
                                  self._read_report(f"{stage}/0"))

    def _read_report(self, key: str) -> RankReport | None:
        assert self.store is not None
        return _read(self.store, key)

    def writes_the_failure(self) -> bool:
        """Whether this rank writes its pod's termination message and stops its agent: the
        lowest reporting rank of its agent, or any rank that got no verdict at all."""
        return self.verdict is None or not self.verdict.writers or (
            self.rank in self.verdict.writers)


def _read(store: dist.Store, key: str) -> RankReport | None:
    """A rank's report under `key`, None when there is none (or the store failed)."""
    try:
        return RankReport(**json.loads(store.get(key))) if store.check([key]) else None
    except Exception:  # the store itself may be what failed
        return None


def _sibling(rank: int, reports: list[RankReport | None]) -> RankReport | None:
    """A report from the same torchrun agent as `rank` (same pod and node), if any."""
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    agent = rank // local_world_size  # torchrun gives each agent a contiguous range
    return next((report for report in reports
                 if report is not None and report.agent == agent), None)


def _rank_0_silent(why: str, me: RankReport, rank0: RankReport | None) -> Verdict:
    """The verdict a rank gives itself when rank 0 cannot judge: rank 0 is named with its
    own report, or the pod and node it shares with this rank, or as "node unknown"."""
    rank0 = rank0 or _sibling(0, [me])
    if rank0 is None:
        return Verdict([f"rank 0 (node unknown) {why}"], reported_nodes=[me.node])
    return Verdict([f"rank 0 (pod {rank0.pod}, node {rank0.node}) {why}"], [rank0.node])


def open_store(policy: PreflightPolicy, rank: int,
               connect: Callable[[timedelta], dist.Store]) -> dist.Store:
    """`connect(timeout)` to the attempt's store, given up at the check's deadline (and
    grace) whatever the client's own retries take (it tries each address of the host in
    turn): on a thread, left behind when it does not return in time. Raises
    PreflightFailed then, or when connecting fails."""
    timeout = store_timeout(policy)
    outcome = run_bounded(lambda: connect(timeout), timeout.total_seconds(),
                          name="preflight-store")
    try:
        return outcome.value(f"not connected within {timeout.total_seconds():g}s")
    except Exception as error:
        if rank == 0 and _address_in_use(error):
            raise StorePortTaken(
                f"rank 0 could not listen on the attempt's store port ({error}): another "
                "socket on this host took it after torchrun's agent chose it; the attempt "
                "restarts and the next rendezvous round chooses another") from error
        raise unreachable_store(rank, error) from error


def _address_in_use(error: BaseException) -> bool:
    """Whether `error` is a failure to listen because the address is in use."""
    return getattr(error, "errno", None) == errno.EADDRINUSE or "EADDRINUSE" in str(error)


def unreachable_store(rank: int, error: Exception) -> PreflightFailed:
    """The failure of a rank that cannot reach the attempt's store within the deadline:
    rank 0 hosts it when torchrun's agent does not (TORCH_DISABLE_SHARE_RDZV_TCP_STORE)."""
    pod, node = where_am_i()
    me = RankReport(rank, pod, node, int(os.environ.get("GROUP_RANK", "0")))
    verdict = _rank_0_silent(f"did not serve the attempt's store to rank {rank} ({error})",
                             me, None)
    return PreflightFailed("preflight failed: " + "; ".join(verdict.problems), verdict.nodes,
                           verdict.reported_nodes)


def store_timeout(policy: PreflightPolicy) -> timedelta:
    """How long a store operation may block while the check runs."""
    return timedelta(seconds=policy.timeout_seconds + VERDICT_GRACE_SECONDS)


