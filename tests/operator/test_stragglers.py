"""The straggler rule (kubetrain.operator.stragglers) as tables, then as reconcile applies it:
the Straggler condition, its event and the kubetrain_rank_slowness gauge."""

from __future__ import annotations

import sys
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kubetrain.api.trainingjob import RankSlowness, RanksStatus
from kubetrain.operator.facts import RankSample, metrics_sample
from kubetrain.operator.metrics import OperatorMetrics
from kubetrain.operator.stragglers import describe, judge, stragglers

sys.path.insert(0, str(Path(__file__).parent))
from test_reconcile import NOW, make_job, pod, run, running_status


def ranks(*computes: float) -> list[RankSample]:
    return [RankSample(rank, f"demo-worker-{rank}", f"node-{rank}", compute)
            for rank, compute in enumerate(computes)]


def streaks(*counts: int, pods: tuple[str, ...] | None = None) -> RanksStatus:
    return RanksStatus(step=10, ranks=[
        RankSlowness(rank=rank, pod=(pods or ())[rank] if pods else f"demo-worker-{rank}",
                     node=f"node-{rank}", slowness=1.0, slow_intervals=count)
        for rank, count in enumerate(counts)])


@pytest.mark.parametrize(("case", "previous", "computes", "slowness", "slow_intervals"), [
    ("equal ranks are all 1", None, (0.2, 0.2, 0.2, 0.2), [1, 1, 1, 1], [0, 0, 0, 0]),
    ("one slow rank of four is measured against the median, not pulled into it", None,
     (0.2, 0.2, 0.2, 0.4), [1, 1, 1, 2], [0, 0, 0, 1]),
    ("a slow rank's streak grows", streaks(0, 2), (0.1, 0.1, 0.3), [1, 1, 3], [0, 0, 1]),
    ("and grows on", streaks(0, 0, 2), (0.1, 0.1, 0.3), [1, 1, 3], [0, 0, 3]),
    ("just under the threshold is not slow", streaks(0, 0, 2), (1.0, 1.0, 1.29),
     [1, 1, 1.29], [0, 0, 0]),
    ("a fast interval ends a streak", streaks(0, 0, 2), (0.1, 0.1, 0.1), [1, 1, 1], [0, 0, 0]),
    ("with two ranks the median is their mean", None, (0.1, 0.3), [0.5, 1.5], [0, 1]),
    ("a rank now held by another pod starts again",
     streaks(0, 5, pods=("demo-worker-0", "demo-worker-9")), (0.1, 0.3, 0.1), [1, 3, 1],
     [0, 1, 0]),
    ("a group of one is never slow", None, (0.5,), [1], [0]),
    ("no compute at all (nothing measured) is not slow", None, (0.0, 0.0), [1, 1], [0, 0]),
])
def test_slowness_is_compute_over_the_median_and_a_streak_counts_slow_intervals(
        case: str, previous: RanksStatus | None, computes: tuple[float, ...],
        slowness: list[float], slow_intervals: list[int]) -> None:
    judged = judge(previous, 11, ranks(*computes), threshold=1.3, window=3)
    assert judged.step == 11
    assert [rank.slowness for rank in judged.ranks] == pytest.approx(slowness, abs=1e-3), case
    assert [rank.slow_intervals for rank in judged.ranks] == slow_intervals, case


def test_the_span_between_judgements_is_judged_from_each_ranks_compute_counter() -> None:
    def sampled(computes: tuple[float, ...], totals: tuple[float, ...]) -> list[RankSample]:
        return [replace(sample, compute_seconds_total=total)
                for sample, total in zip(ranks(*computes), totals, strict=True)]

    first = judge(None, 10, sampled((0.1, 0.1, 0.1), (5.0, 5.0, 5.0)), 1.3, window=1)
    # The last logged interval happened to be even, but since the previous judgement
    # rank 2 computed 3 s where the others computed 1 s: the span decides.
    second = judge(first, 20, sampled((0.1, 0.1, 0.1), (6.0, 6.0, 8.0)), 1.3, window=1)
    assert [rank.slowness for rank in second.ranks] == [1, 1, 3]
    assert [rank.rank for rank in stragglers(second)] == [2]
    assert [rank.compute_seconds_total for rank in second.ranks] == [6.0, 6.0, 8.0]
    # A counter that went back (rank 2's process restarted): the last interval alone.
    third = judge(second, 30, sampled((0.1, 0.1, 0.25), (7.0, 7.0, 0.5)), 1.3, window=1)
    assert [rank.slowness for rank in third.ranks] == [1, 1, 2.5]


def test_the_same_interval_scraped_again_changes_nothing() -> None:
    previous = streaks(0, 2)
    assert judge(previous, previous.step, ranks(0.1, 0.5), threshold=1.3,
                 window=3) == previous


@pytest.mark.parametrize(("counts", "computes", "window", "named"), [
    ((0, 1, 0), (0.1, 0.3, 0.1), 3, []),
    ((0, 2, 0), (0.1, 0.3, 0.1), 3, [1]),
    ((3, 0, 2, 0, 0), (0.3, 0.1, 0.3, 0.1, 0.1), 3, [0, 2]),
    ((0, 0, 0), (0.1, 0.3, 0.1), 1, [1]),
])
def test_a_straggler_is_slow_for_the_whole_window(
        counts: tuple[int, ...], computes: tuple[float, ...], window: int,
        named: list[int]) -> None:
    # `counts` slow intervals so far, then this interval's `computes`.
    judged = judge(streaks(*counts), 11, ranks(*computes), threshold=1.3, window=window)
    assert sorted(rank.rank for rank in stragglers(judged)) == named


def test_a_straggler_stays_one_until_it_is_normal_for_the_whole_window() -> None:
    slow, normal = ranks(0.1, 0.1, 0.3), ranks(0.1, 0.1, 0.1)
    status = None
    history = []
    for step, computes in enumerate([slow, slow, slow, normal, slow, normal, normal, normal,
                                     slow]):
        status = judge(status, step, computes, threshold=1.3, window=3)
        history.append([rank.rank for rank in stragglers(status)])
    # A straggler from its third slow interval; one normal interval, even two, do not end
    # it (a burst of a throttled machine); three do; then it must be slow for three again.
    assert history == [[], [], [2], [2], [2], [2], [2], [], []]


# --- as reconcile applies it ----------------------------------------------------------


def exposition(step: int, *computes: float) -> str:
    """Rank 0's /metrics as the trainer writes them (kubetrain.trainer.metrics)."""
    lines = [f"kubetrain_step {step}", f"kubetrain_rank_timing_step {step}"]
    lines += [f'kubetrain_rank_compute_seconds{{node="node-{rank}",pod_name="demo-worker-'
              f'{rank}",rank="{rank}"}} {compute}' for rank, compute in enumerate(computes)]
    lines += [f'kubetrain_rank_wait_seconds{{node="node-{rank}",pod_name="demo-worker-'
              f'{rank}",rank="{rank}"}} 0.01' for rank, compute in enumerate(computes)]
    return "\n".join(lines) + "\n"


def scrapes(minimal_manifest: dict[str, Any], intervals: list[tuple[int, tuple[float, ...]]],
            **stragglers_policy: Any) -> list[Any]:
    """Reconcile once per scrape, each on the status the one before wrote."""
    status = running_status()
    outcomes = []
    for step, computes in intervals:
        job = make_job(minimal_manifest, replicas=len(computes), status=status,
                       stragglers=stragglers_policy)
        sample = metrics_sample(exposition(step, *computes))
        out = run(job, *(pod(index) for index in range(len(computes))), metrics=sample,
                  now=NOW + timedelta(seconds=step))
        status = out.status or status
        outcomes.append(out)
    return outcomes


def test_a_rank_slow_for_the_window_gets_a_condition_and_one_event_naming_pod_and_node(
        minimal_manifest: dict[str, Any]) -> None:
    slow = (0.1, 0.1, 0.25)  # rank 2 computes 2.5x the median
    outs = scrapes(minimal_manifest, [(10, slow), (20, slow), (20, slow), (30, slow),
                                      (40, slow), (50, (0.1, 0.1, 0.1))], window=3)
    first, second, again, third, fourth, recovered = outs
    for before in (first, second, again):
        assert before.status is None or before.condition("Straggler") is None
        assert ("Warning", "Straggler") not in before.events
    assert third.condition("Straggler")["status"] == "True"
    message = third.condition("Straggler")["message"]
    assert "demo-worker-2" in message and "node-2" in message and "2.50x" in message, message
    assert third.events == [("Warning", "Straggler")]
    event = next(action for action in third.actions if getattr(action, "reason", "") ==
                 "Straggler")
    assert "pod demo-worker-2 on node node-2" in event.message and "2.50x" in event.message
    assert fourth.condition("Straggler")["status"] == "True"
    assert ("Warning", "Straggler") not in fourth.events  # reported once per episode
    # One normal interval is not a recovery: the report holds for a whole window of them.
    assert recovered.condition("Straggler")["status"] == "True"
    assert "under the threshold for 1 of the 3 intervals" in recovered.condition(
        "Straggler")["message"]
    normal = (0.1, 0.1, 0.1)
    *_, back = scrapes(minimal_manifest, [(10, slow), (20, slow), (30, slow), (40, normal),
                                         (50, normal), (60, normal)], window=3)
    assert back.condition("Straggler")["status"] == "False"
    assert ("Warning", "Straggler") not in back.events
    assert [rank["slowness"] for rank in third.status["ranks"]["ranks"]] == [1, 1, 2.5]


def test_no_fault_raises_no_straggler_condition_over_a_whole_run(
        minimal_manifest: dict[str, Any]) -> None:
    jitter = [(step, (0.1 + 0.01 * (step % 3), 0.1, 0.11 - 0.01 * (step % 2)))
              for step in range(10, 310, 10)]
    for out in scrapes(minimal_manifest, jitter):
        assert out.status is None or out.condition("Straggler") is None
        assert ("Warning", "Straggler") not in out.events


def test_a_threshold_of_the_spec_decides(minimal_manifest: dict[str, Any]) -> None:
    slow = (0.1, 0.1, 0.25)
    outs = scrapes(minimal_manifest, [(10, slow), (20, slow)], threshold=3, window=1)
    assert all(out.condition("Straggler") is None for out in outs)
    outs = scrapes(minimal_manifest, [(10, slow)], threshold=2, window=1)
    assert outs[0].condition("Straggler")["status"] == "True"


def test_the_slowness_gauge_follows_status_and_goes_when_the_job_finishes() -> None:
    metrics = OperatorMetrics()
    status = {"phase": "Running", "ranks": {"step": 30, "ranks": [
        {"rank": 0, "pod": "demo-worker-0", "node": "a", "slowness": 0.9, "slowIntervals": 0},
        {"rank": 1, "pod": "demo-worker-1", "node": "b", "slowness": 2.5, "slowIntervals": 3}]}}

    def gauge() -> dict[tuple[str, str, str], float]:
        text = generate_latest(metrics.registry).decode()
        return {(s.labels["namespace"], s.labels["job"], s.labels["rank"]): s.value
                for family in text_string_to_metric_families(text)
                if family.name == "kubetrain_rank_slowness" for s in family.samples}

    metrics.show_job_status("ml", "demo", status)
    assert gauge() == {("ml", "demo", "0"): 0.9, ("ml", "demo", "1"): 2.5}
    metrics.show_job_status("ml", "demo", {**status, "phase": "Succeeded"})
    assert gauge() == {}


@pytest.mark.parametrize(("case", "slow_intervals", "normal_intervals", "ends_with"), [
    ("slow now: for how many intervals", 4, 0, ", for 4 intervals"),
    ("normal again: how far through the window that ends its report", 0, 2,
     ", at or under the threshold for 2 of the 3 intervals that end its report"),
])
def test_a_straggler_in_words_names_rank_pod_node_and_slowness(
        case: str, slow_intervals: int, normal_intervals: int, ends_with: str) -> None:
    rank = RankSlowness(rank=1, pod="demo-worker-1", node="node-b", slowness=2.345,
                        slow_intervals=slow_intervals, normal_intervals=normal_intervals,
                        straggler=True)
    text = describe(rank, window=3)
    assert text == ("rank 1 in pod demo-worker-1 on node node-b computes 2.35x the median "
                    "rank's time per step" + ends_with), case
