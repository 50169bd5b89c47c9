"""The goodput ledger against a fake clock: causes sum to wall time, restarts carry over."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from kubetrain.trainer.goodput import (
    CAUSES,
    CHECKPOINT_LOAD,
    CHECKPOINT_SAVE,
    DATA_WAIT,
    DEGRADED,
    DOWNTIME,
    EVALUATION,
    HEARTBEAT_NAME,
    LOST_PROGRESS,
    MEMORY_TIER,
    OUT_OF_MEMORY,
    PARTNER_TIER,
    PRODUCTIVE,
    S3_TIER,
    STARTUP,
    STRAGGLER,
    GoodputLedger,
    Heartbeat,
    StragglerBooking,
    process_started_at,
)
from kubetrain.trainer.storage import open_storage


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def train(ledger: GoodputLedger, clock: FakeClock, steps: range, *, step_seconds: float = 2.0,
          data_seconds: float = 0.5) -> None:
    for step in steps:
        clock.advance(data_seconds)
        ledger.charge(DATA_WAIT)
        clock.advance(step_seconds)
        ledger.charge(PRODUCTIVE)
        ledger.stepped(step)


def test_every_second_goes_to_one_cause_and_they_sum_to_wall_time() -> None:
    clock = FakeClock(1000.0)
    ledger = GoodputLedger(attempt_started=990.0, clock=clock)  # the process began 10 s ago
    ledger.charge(STARTUP)
    train(ledger, clock, range(1, 11))
    clock.advance(3.0)
    ledger.charge(EVALUATION)
    clock.advance(1.5)
    ledger.charge(CHECKPOINT_SAVE)

    seconds = ledger.seconds
    assert seconds[STARTUP] == 10.0
    assert seconds[PRODUCTIVE] == 20.0
    assert seconds[DATA_WAIT] == 5.0
    assert seconds[EVALUATION] == 3.0
    assert seconds[CHECKPOINT_SAVE] == 1.5
    assert ledger.wall_seconds == pytest.approx(clock.now - 990.0)
    assert ledger.ratio == pytest.approx(20.0 / 39.5)


def test_a_clock_going_backwards_books_nothing_negative() -> None:
    clock = FakeClock(100.0)
    ledger = GoodputLedger(attempt_started=100.0, clock=clock)
    clock.advance(-5.0)
    assert ledger.charge(PRODUCTIVE) == 0.0
    assert min(ledger.seconds.values()) == 0.0


def first_attempt(clock: FakeClock) -> tuple[dict[str, object], dict[str, object]]:
    """An attempt that checkpoints at step 10, heartbeats at step 15 and is killed."""
    ledger = GoodputLedger(attempt_started=clock.now, clock=clock)
    clock.advance(4.0)
    ledger.charge(STARTUP)
    train(ledger, clock, range(1, 11))
    checkpoint = ledger.state_dict()  # as DCP stages it at the save call
    clock.advance(1.0)
    ledger.charge(CHECKPOINT_SAVE)
    train(ledger, clock, range(11, 16))
    heartbeat = json.loads(json.dumps(ledger.snapshot()))
    return checkpoint, heartbeat


def test_a_restart_turns_redone_steps_into_lost_progress_and_the_gap_into_downtime() -> None:
    clock = FakeClock(0.0)
    checkpoint, heartbeat = first_attempt(clock)
    killed_at = clock.now  # 4 + 10 * 2.5 + 1 + 5 * 2.5 = 42.5
    clock.advance(7.5)  # the node is replaced, the group starts again
    ledger = GoodputLedger(attempt_started=clock.now, clock=clock)
    clock.advance(3.0)
    ledger.charge(STARTUP)
    ledger.load_state_dict(checkpoint)
    clock.advance(0.5)
    ledger.charge(CHECKPOINT_LOAD)
    assert ledger.resume(heartbeat) == 15  # steps 11..15 are booked as redone
    train(ledger, clock, range(11, 21))

    seconds = ledger.seconds
    assert seconds[LOST_PROGRESS] == pytest.approx(5 * 2.0)  # steps 11..15, once
    assert seconds[DOWNTIME] == pytest.approx(7.5)
    assert seconds[PRODUCTIVE] == pytest.approx(20 * 2.0)  # steps 1..20, each counted once
    assert seconds[DATA_WAIT] == pytest.approx(25 * 0.5)  # waits are spent, redone or not
    assert seconds[STARTUP] == pytest.approx(4.0 + 3.0)
    assert seconds[CHECKPOINT_SAVE] == pytest.approx(1.0)
    assert seconds[CHECKPOINT_LOAD] == pytest.approx(0.5)
    assert ledger.wall_seconds == pytest.approx(clock.now)
    assert killed_at == pytest.approx(42.5)


def test_an_out_of_memory_restart_books_its_redone_steps_and_gap_as_oom() -> None:
    clock = FakeClock(0.0)
    checkpoint, heartbeat = first_attempt(clock)  # both booked no OOM restart yet
    clock.advance(4.0)  # OOM-killed; the group restarts with half the micro-batch
    ledger = GoodputLedger(attempt_started=clock.now, clock=clock)
    ledger.load_state_dict(checkpoint)
    ledger.resume(heartbeat, out_of_memory_restarts=1)
    train(ledger, clock, range(11, 13))
    assert ledger.seconds[OUT_OF_MEMORY] == pytest.approx(5 * 2.0 + 4.0)
    assert ledger.seconds[LOST_PROGRESS] == ledger.seconds[DOWNTIME] == 0.0
    assert ledger.wall_seconds == pytest.approx(clock.now)
    # The next restart, not for memory, books as any other: the count was booked.
    later = ledger.snapshot()
    clock.advance(3.0)
    again = GoodputLedger(attempt_started=clock.now, clock=clock)
    again.load_state_dict(later)
    again.resume(later, out_of_memory_restarts=1)
    assert again.seconds[DOWNTIME] == pytest.approx(3.0)
    assert again.seconds[OUT_OF_MEMORY] == pytest.approx(5 * 2.0 + 4.0)


def test_without_a_heartbeat_everything_after_the_checkpoint_is_downtime() -> None:
    clock = FakeClock(0.0)
    checkpoint, _ = first_attempt(clock)
    clock.advance(2.0)
    ledger = GoodputLedger(attempt_started=clock.now, clock=clock)
    ledger.load_state_dict(checkpoint)
    assert ledger.resume(None) is None
    clock.advance(1.0)
    ledger.charge(STARTUP)
    assert ledger.seconds[LOST_PROGRESS] == 0.0
    assert ledger.seconds[DOWNTIME] == pytest.approx(1.0 + 5 * 2.5 + 2.0)
    assert ledger.wall_seconds == pytest.approx(clock.now)


def test_a_kill_before_the_first_checkpoint_loses_all_its_steps() -> None:
    clock = FakeClock(0.0)
    ledger = GoodputLedger(attempt_started=0.0, clock=clock)
    train(ledger, clock, range(1, 5))
    heartbeat = ledger.snapshot()
    clock.advance(10.0)
    again = GoodputLedger(attempt_started=clock.now, clock=clock)
    assert again.resume(heartbeat) == 4
    assert again.seconds[LOST_PROGRESS] == pytest.approx(8.0)
    assert again.seconds[DATA_WAIT] == pytest.approx(2.0)
    assert again.seconds[DOWNTIME] == pytest.approx(10.0)
    assert again.origin == 0.0


def test_two_restarts_in_a_row_keep_the_first_ones_losses() -> None:
    clock = FakeClock(0.0)
    checkpoint, heartbeat = first_attempt(clock)
    clock.advance(5.0)
    second = GoodputLedger(attempt_started=clock.now, clock=clock)
    second.load_state_dict(checkpoint)
    second.resume(heartbeat)
    train(second, clock, range(11, 14))  # killed again before the next checkpoint
    heartbeat = second.snapshot()
    clock.advance(5.0)
    third = GoodputLedger(attempt_started=clock.now, clock=clock)
    third.load_state_dict(checkpoint)
    third.resume(heartbeat)
    assert third.seconds[LOST_PROGRESS] == pytest.approx(5 * 2.0 + 3 * 2.0)
    assert third.seconds[DOWNTIME] == pytest.approx(10.0)
    assert third.seconds[PRODUCTIVE] == pytest.approx(10 * 2.0)
    assert third.wall_seconds == pytest.approx(clock.now)


def test_a_checkpoint_of_another_job_starts_the_accounting_afresh() -> None:
    clock = FakeClock(0.0)
    checkpoint, heartbeat = first_attempt(clock)
    clock.advance(100.0)
    ledger = GoodputLedger(attempt_started=clock.now, clock=clock)
    ledger.load_state_dict(checkpoint)
    assert ledger.resume(heartbeat, from_this_job=False) is None
    assert ledger.wall_seconds == 0.0
    assert ledger.origin == clock.now


def test_a_heartbeat_of_another_origin_is_ignored() -> None:
    clock = FakeClock(0.0)
    checkpoint, heartbeat = first_attempt(clock)
    clock.advance(3.0)
    ledger = GoodputLedger(attempt_started=clock.now, clock=clock)
    ledger.load_state_dict(checkpoint)
    assert ledger.resume({**heartbeat, "origin": 12345.0}) is None
    assert ledger.seconds[LOST_PROGRESS] == 0.0
    assert ledger.wall_seconds == pytest.approx(clock.now)


def test_a_healed_replica_group_takes_the_live_groups_totals_and_books_on_from_there() -> None:
    """spec.faultTolerance: a group started again at t=100 heals at t=112 from a peer whose
    ledger has run since t=0; the job's wall time is the peer's, not the 12 s since."""
    clock = FakeClock(0.0)
    peer = GoodputLedger(attempt_started=0.0, clock=clock)
    clock.advance(5.0)
    peer.charge(STARTUP)
    clock.advance(107.0)
    peer.charge(PRODUCTIVE)
    peer.move(PRODUCTIVE, DEGRADED, 20.0)
    peer.charge_load(S3_TIER)  # nothing elapsed: the tier's split travels all the same
    healed = GoodputLedger(attempt_started=100.0, clock=clock)
    healed.charge(STARTUP)  # its own start-up, which the peer's wall time covers
    healed.adopt(peer.snapshot())
    assert healed.origin == 0.0 and healed.wall_seconds == pytest.approx(112.0)
    assert healed.seconds[DEGRADED] == 20.0 and healed.seconds[STARTUP] == 5.0
    clock.advance(3.0)
    healed.charge(PRODUCTIVE)
    assert healed.seconds[PRODUCTIVE] == pytest.approx(87.0 + 3.0)
    assert healed.wall_seconds == pytest.approx(clock.now)
    assert set(healed.load_seconds) == set(peer.load_seconds)


def test_the_heartbeat_round_trips_through_storage(tmp_path: Path) -> None:
    store = open_storage(str(tmp_path))
    heartbeat = Heartbeat(store)
    assert heartbeat.read() is None
    clock = FakeClock(50.0)
    ledger = GoodputLedger(attempt_started=40.0, clock=clock)
    ledger.charge(STARTUP)
    heartbeat.write(ledger.snapshot())
    heartbeat.flush()
    read = heartbeat.read()
    assert read is not None and read["seconds"][STARTUP] == 10.0
    assert set(read["seconds"]) == set(CAUSES)
    (tmp_path / HEARTBEAT_NAME).write_text("{not json")
    assert heartbeat.read() is None
    heartbeat.close()


def test_the_process_start_time_is_in_the_past() -> None:
    import time

    started = process_started_at()
    assert time.time() - 3600 * 24 < started <= time.time()


def test_straggler_time_moves_out_of_productive_and_the_wall_time_stays() -> None:
    clock = FakeClock(1000.0)
    ledger = GoodputLedger(clock(), clock=clock)
    clock.advance(10)
    ledger.charge(PRODUCTIVE)
    wall = ledger.wall_seconds
    assert ledger.move(PRODUCTIVE, STRAGGLER, 4.0) == 4.0
    assert ledger.seconds[PRODUCTIVE] == 6.0 and ledger.seconds[STRAGGLER] == 4.0
    assert ledger.move(PRODUCTIVE, STRAGGLER, 100.0) == 6.0  # never more than was booked
    assert ledger.seconds[PRODUCTIVE] == 0 and ledger.wall_seconds == wall


# Two ranks' compute and wait per step over an interval of 10 steps: healthy ones take
# 0.10 s per step (0.08 compute, 0.02 in collectives); jitter up to 1.25x is no straggler.
HEALTHY = ([0.08, 0.08], [0.02, 0.02])
JITTER = ([0.08, 0.11], [0.05, 0.02])
# Rank 1 at a third of its speed: 0.24 s of compute, and rank 0 waits 0.16 s more for it.
SLOW = ([0.08, 0.24], [0.18, 0.02])  # the group's step: 0.26 s, 0.16 over the healthy 0.10


Interval = tuple[list[float], list[float]]


def _wall(interval: Interval, outside: float = 0.0) -> float:
    """The interval's productive seconds on a rank: the median rank's compute plus wait per
    step, and `outside` per step between the steps (the log's gathers)."""
    computes, waits = interval
    return 10 * (statistics.median(c + w for c, w in zip(computes, waits, strict=True))
                 + outside)


def _book(intervals: list[Interval], window: int = 3) -> list[float]:
    booking = StragglerBooking(threshold=1.3, window=window)
    return [booking.lost(*interval, 10, _wall(interval)).get(PRODUCTIVE, 0.0)
            for interval in intervals]


def test_jitter_between_healthy_ranks_is_never_straggler_time() -> None:
    assert _book([HEALTHY, JITTER, JITTER, JITTER, JITTER, HEALTHY]) == [0.0] * 6


def test_a_slow_streak_shorter_than_the_window_is_productive() -> None:
    assert _book([HEALTHY, SLOW, SLOW, HEALTHY, SLOW, HEALTHY]) == [0.0] * 6


def test_a_straggler_books_the_groups_loss_from_the_first_slow_interval_of_its_episode() -> None:
    booked = _book([HEALTHY, HEALTHY, SLOW, SLOW, SLOW, SLOW])
    # Nothing until the window is full, then the whole streak: the group's 0.16 s per step
    # over the healthy step, not just the slow rank's compute over the median rank's.
    assert booked[:4] == [0.0, 0.0, 0.0, 0.0]
    assert booked[4] == pytest.approx(3 * 10 * 0.16)
    assert booked[5] == pytest.approx(10 * 0.16)


def test_a_straggler_stays_one_until_normal_for_a_window_then_healthy_time_is_free() -> None:
    slower_healthy = ([0.09, 0.09], [0.03, 0.03])  # the group's step: 0.12 s
    booked = _book([HEALTHY, SLOW, SLOW, slower_healthy, slower_healthy, slower_healthy,
                    slower_healthy, SLOW], window=2)
    assert booked[1] == 0.0 and booked[2] == pytest.approx(2 * 10 * 0.16)
    # Back to normal: still its episode (booked against the healthy 0.10 s) until a
    # window of normal intervals has passed, then nothing.
    assert booked[3] == pytest.approx(10 * 0.02)
    assert booked[4:7] == [0.0, 0.0, 0.0]
    assert booked[7] == 0.0  # a new streak starts again from 0


def test_a_new_pace_after_a_quorum_change_is_no_straggler_time() -> None:
    """spec.faultTolerance: alone, a replica group steps at 0.10 s; with a group back, the
    all-reduce across them makes every rank's step 0.20 s. Judged against the old pace,
    that stretch would be booked to the first rank found slow after it (5.6 s here, not
    1.6); judging starts again from the new pace instead."""
    across_groups = ([0.08, 0.08], [0.12, 0.12])  # the group's step: 0.20 s, all waiting
    slow_across = ([0.08, 0.24], [0.28, 0.12])  # rank 1 slow: the group's step 0.36 s
    booking = StragglerBooking(threshold=1.3, window=1)
    assert booking.lost(*HEALTHY, 10, _wall(HEALTHY)) == {}
    booking.pace_changed()
    assert [booking.lost(*across_groups, 10, _wall(across_groups)) for _ in range(3)] \
        == [{}] * 3
    # A slow rank is still found, and priced against the new pace: 0.16 s a step over it.
    assert booking.lost(*slow_across, 10, _wall(slow_across)) == {
        PRODUCTIVE: pytest.approx(10 * 0.16)}


def test_a_rank_slow_from_the_start_is_priced_against_the_healthy_ranks() -> None:
    # No healthy interval yet: the healthy step is the other rank's compute plus the slow
    # rank's wait (it waits for nobody): 0.10 s.
    assert _book([SLOW, SLOW, SLOW]) == pytest.approx([0.0, 0.0, 3 * 10 * 0.16])


def test_a_straggler_books_the_time_the_log_between_steps_waited_for_it_too() -> None:
    # Healthy: 0.01 s per step between the steps (the log's gathers). While rank 1 is slow
    # it also reports late, and the others wait 0.05 s per step more for it there.
    booking = StragglerBooking(threshold=1.3, window=1)
    assert booking.lost(*HEALTHY, 10, _wall(HEALTHY, outside=0.01)) == {}
    booked = booking.lost(*SLOW, 10, _wall(SLOW, outside=0.06))
    assert booked == {PRODUCTIVE: pytest.approx(10 * (0.16 + 0.05))}


# Rank 1 held up inside a collective: the pause counts as its wait, so its compute looks
# healthy, while the group still takes 0.26 s per step.
HIDDEN = ([0.08, 0.09], [0.18, 0.17])


def test_an_episode_whose_streak_broke_while_the_group_stayed_slow_is_booked_whole() -> None:
    booked = _book([HEALTHY, SLOW, SLOW, HIDDEN, SLOW, SLOW, SLOW])
    assert booked[:6] == [0.0] * 6
    assert booked[6] == pytest.approx(6 * 10 * 0.16)  # from the first slow interval


def test_a_slow_group_without_a_judged_straggler_books_nothing() -> None:
    assert _book([HEALTHY, HIDDEN, SLOW, SLOW, HIDDEN, HIDDEN, HEALTHY, SLOW]) == [0.0] * 8


def test_a_judgement_that_ends_while_the_group_is_slow_keeps_the_episode_going() -> None:
    booked = _book([HEALTHY, SLOW, SLOW, HIDDEN, HIDDEN, HIDDEN, SLOW, SLOW], window=2)
    assert booked[2] == pytest.approx(2 * 10 * 0.16)
    assert booked[3] == pytest.approx(10 * 0.16)  # still judged: one normal interval
    assert booked[4:7] == [0.0, 0.0, 0.0]  # judged over, the group still slow: kept
    assert booked[7] == pytest.approx(4 * 10 * 0.16)  # judged again: 4 to 7


def test_a_save_while_a_rank_straggles_books_its_time_over_a_healthy_save() -> None:
    booking = StragglerBooking(threshold=1.3, window=2)
    booking.lost(*HEALTHY, 10, _wall(HEALTHY))
    assert booking.saved("s3", 0.5) == 0.0  # the reference
    booking.lost(*SLOW, 10, _wall(SLOW))
    assert booking.saved("s3", 2.5) == 0.0  # in the episode, not judged yet: kept
    assert booking.saved("memory", 0.2) == 0.0  # no healthy save of its kind to price it
    assert booking.lost(*SLOW, 10, _wall(SLOW)) == {
        PRODUCTIVE: pytest.approx(2 * 10 * 0.16), CHECKPOINT_SAVE: pytest.approx(2.0)}
    assert booking.saved("s3", 1.5) == pytest.approx(1.0)
    # An episode that ends unjudged drops what its saves were kept for.
    other = StragglerBooking(threshold=1.3, window=3)
    other.lost(*HEALTHY, 10, _wall(HEALTHY))
    other.saved("s3", 0.5)
    other.lost(*SLOW, 10, _wall(SLOW))
    other.saved("s3", 2.5)
    assert other.lost(*HEALTHY, 10, _wall(HEALTHY)) == {}
    assert [other.lost(*SLOW, 10, _wall(SLOW)) for _ in range(3)][-1] == {
        PRODUCTIVE: pytest.approx(3 * 10 * 0.16)}


def test_a_group_of_one_has_no_straggler() -> None:
    assert StragglerBooking(1.3, 1).lost([0.5], [0.0], 10, 5.0) == {}


def test_an_attempt_killed_for_memory_before_its_first_step_books_its_time_to_oom() -> None:
    # The heartbeat written before the first step is all the killed attempt leaves.
    clock = FakeClock(0.0)
    ledger = GoodputLedger(attempt_started=0.0, clock=clock)
    clock.advance(5.0)
    ledger.charge(STARTUP)
    heartbeat = ledger.snapshot()
    clock.advance(3.0)  # building its first batch, then OOM-killed
    clock.advance(4.0)  # the pod replaced, with half the micro-batch
    again = GoodputLedger(attempt_started=clock.now, clock=clock)
    again.resume(heartbeat, out_of_memory_restarts=1)
    assert again.origin == 0.0
    assert again.seconds[STARTUP] == pytest.approx(5.0)
    assert again.seconds[OUT_OF_MEMORY] == pytest.approx(3.0 + 4.0)
    assert again.wall_seconds == pytest.approx(clock.now)


def test_a_worker_killed_before_its_first_step_leaves_its_time_to_the_next_attempt(
        tiny_job, launcher) -> None:
    import signal
    import subprocess
    import time

    import yaml

    job = tiny_job("killed", optimization={"maxSteps": 400}, metrics={"logEverySteps": 400})
    heartbeat = job.parent / "checkpoints" / HEARTBEAT_NAME
    worker = subprocess.Popen(launcher.command(job, 1), env=launcher.env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not heartbeat.exists() and time.monotonic() < deadline and worker.poll() is None:
            time.sleep(0.01)
        worker.send_signal(signal.SIGKILL)  # as the kernel's OOM killer does
    finally:
        worker.wait()
    written = json.loads(heartbeat.read_text())
    assert written["step"] == 0, written  # the heartbeat before the first step
    # The next attempt follows an out-of-memory kill: status.effective says so.
    manifest = yaml.safe_load(job.read_text())
    manifest["spec"]["optimization"]["maxSteps"] = 8
    manifest["status"] = {"effective": {"microBatchSize": 4, "gradientAccumulationSteps": 2,
                                        "outOfMemoryRestarts": 1}}
    job.write_text(yaml.safe_dump(manifest))
    launcher.train(job, 1)
    accounted = launcher.events(job, "goodput")[-1]["seconds"]
    print(f"killed at step {written['step']}: {accounted}")
    assert accounted[OUT_OF_MEMORY] > 0, accounted
    assert accounted[STARTUP] >= written["seconds"][STARTUP], accounted


def test_ranks_that_agree_on_the_start_book_rank_0s_heartbeat_on_rank_1s_checkpoint() -> None:
    # Two ranks' processes start 0.3 s apart; the checkpoint keeps one rank's ledger (rank
    # 1's here), the heartbeat is rank 0's: once they agree on rank 0's start, the steps
    # after the checkpoint are lost progress, not downtime.
    clock = FakeClock(100.0)
    rank0, rank1 = GoodputLedger(100.0, clock=clock), GoodputLedger(100.3, clock=clock)
    for ledger in (rank0, rank1):
        ledger.agree(rank0.attempt_started)
    clock.advance(5.0)
    for ledger in (rank0, rank1):
        ledger.charge(STARTUP)
    clock.advance(2.0)
    for ledger in (rank0, rank1):
        ledger.charge(PRODUCTIVE)
    checkpoint = rank1.state_dict()
    clock.advance(1.5)  # steps after the checkpoint, then killed
    rank0.charge(PRODUCTIVE)
    heartbeat = rank0.snapshot()
    clock.advance(4.0)  # torchrun restarts the group in place
    again = GoodputLedger(clock.now, clock=clock)
    again.load_state_dict(checkpoint)
    again.resume(heartbeat)
    assert again.seconds[LOST_PROGRESS] == pytest.approx(1.5)
    assert again.seconds[DOWNTIME] == pytest.approx(4.0)
    # Without agreeing, rank 1's checkpoint names another origin and the heartbeat is dropped.
    alone = GoodputLedger(100.3, clock=FakeClock(100.3))
    stray = GoodputLedger(clock.now, clock=clock)
    stray.load_state_dict(alone.state_dict())
    stray.resume(heartbeat)
    assert stray.seconds[LOST_PROGRESS] == 0


def test_checkpoint_load_is_split_by_tier_and_the_split_survives_restarts() -> None:
    clock = FakeClock(0.0)
    first = GoodputLedger(attempt_started=0.0, clock=clock)
    clock.advance(1.0)
    first.charge_load(None)  # a fresh start: looked for a checkpoint, found none
    train(first, clock, range(1, 5))
    clock.advance(0.5)
    first.charge(CHECKPOINT_SAVE)
    checkpoint, tiers = first.state_dict(), first.tier_state.state_dict()
    assert "checkpoint_load_tiers" not in checkpoint, "the ledger's checkpoint keeps its shape"
    train(first, clock, range(5, 7))
    heartbeat = json.loads(json.dumps(first.snapshot()))

    def resumed(down: float, load: float, tier: str) -> GoodputLedger:
        """The next attempt, `down` seconds after the last beat, from the step-4 checkpoint
        (its ledger and tiers) and the beat before, its load of `load` s from `tier`."""
        clock.advance(down)
        ledger = GoodputLedger(attempt_started=clock.now, clock=clock)
        ledger.load_state_dict(checkpoint)
        ledger.tier_state.load_state_dict(tiers)
        clock.advance(load)
        ledger.charge_load(tier)
        ledger.resume(heartbeat)
        return ledger

    # Resumed from S3 (the step-4 checkpoint), killed again before its next checkpoint.
    second = resumed(3.0, 0.75, S3_TIER)
    train(second, clock, range(5, 9))
    heartbeat = json.loads(json.dumps(second.snapshot()))

    # Resumed from memory: the S3 load lives only in the heartbeat of the attempt before.
    third = resumed(2.0, 0.25, MEMORY_TIER)
    assert third.load_seconds == pytest.approx({MEMORY_TIER: 0.25, PARTNER_TIER: 0.0,
                                                S3_TIER: 0.75})
    assert third.seconds[CHECKPOINT_LOAD] == pytest.approx(1.0 + 0.75 + 0.25)
    assert third.snapshot()["checkpoint_load_tiers"] == third.load_seconds
    assert third.wall_seconds == pytest.approx(clock.now)


def test_a_checkpoint_and_heartbeat_from_before_the_split_resume_with_no_tier_booked() -> None:
    clock = FakeClock(0.0)
    first = GoodputLedger(attempt_started=0.0, clock=clock)
    train(first, clock, range(1, 4))
    checkpoint = first.state_dict()
    train(first, clock, range(4, 6))
    heartbeat = {key: value for key, value in first.snapshot().items()
                 if key != "checkpoint_load_tiers"}
    clock.advance(1.0)
    second = GoodputLedger(attempt_started=clock.now, clock=clock)
    second.load_state_dict(checkpoint)  # no checkpoint_load_tiers entry: left as it is
    clock.advance(0.5)
    second.charge_load(PARTNER_TIER)
    second.resume(heartbeat)
    assert second.load_seconds == {MEMORY_TIER: 0.0, PARTNER_TIER: 0.5, S3_TIER: 0.0}


def test_under_tensor_parallelism_a_group_is_judged_by_its_smallest_rank_as_the_operator_does(
        ) -> None:
    # Two tensor-parallel groups of two. A group's compute is its smallest rank's (each
    # counts its untimed waits for its peer as compute): rank 0's 0.30 is not its group's
    # pace while rank 1 keeps 0.12, so as groups nothing is slow; rank by rank it would be.
    one_rank = ([0.30, 0.12, 0.12, 0.12], [0.02, 0.20, 0.20, 0.20])
    # Rank 1 slow, rank 0 waiting for it inside the layers: the whole group is slow.
    slow_group = ([0.40, 0.36, 0.12, 0.12], [0.02, 0.06, 0.30, 0.30])

    def booked(intervals: list[tuple[list[float], list[float]]], tensor_parallel: int,
               ) -> list[float]:
        booking = StragglerBooking(1.3, 2, tensor_parallel=tensor_parallel)
        return [booking.lost(*interval, 10, _wall(interval)).get(PRODUCTIVE, 0.0)
                for interval in intervals]

    assert booked([one_rank] * 3, tensor_parallel=2) == [0.0] * 3
    assert booked([one_rank] * 3, tensor_parallel=1)[1] > 0
    as_groups = booked([slow_group] * 3, tensor_parallel=2)
    assert as_groups[0] == 0.0 and as_groups[1] > 0 and as_groups == booked(
        [slow_group] * 3, tensor_parallel=1)  # the group's loss, whoever is named
