"""Observation: the status a reconcile pass reads off the job's children before it decides.

status.observedGeneration and workers; status.effective, the batch split the workers
use (the spec's, or a smaller micro-batch after out-of-memory restarts); rank 0's metrics,
or an own-code job's status reports, as status.progress, goodput and checkpoints (own
code's goodput from when its step advanced: `step_goodput`); each rank's slowness as
status.ranks and the Straggler condition (the rule is `kubetrain.operator.stragglers`).

It records what is; it decides nothing about pods (that is `reconcile` and its policies).
Pure as reconcile is: no Kubernetes, no clock but the pass's `now`.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from kubetrain import pod_conventions
from kubetrain import restart_rules as rules
from kubetrain.api.trainingjob import (
    BadputSeconds,
    BestCheckpointStatus,
    CheckpointLoadSeconds,
    CheckpointStatus,
    EffectiveBatch,
    GoodputStatus,
    Progress,
    ReplicaGroupsStatus,
    TrainingJob,
    TrainingJobSpec,
    TrainingJobStatus,
    step_folder,
)
from kubetrain.operator import stragglers
from kubetrain.operator.actions import CountQuorumChange
from kubetrain.operator.facts import MetricsSample
from kubetrain.operator.reconcile_pass import ReconcilePass


def observe(decision: ReconcilePass) -> None:
    """The status as observed: generation, workers, effective batch, progress, ranks."""
    status = decision.status
    status.observed_generation = decision.job.metadata.generation
    status.workers.selector = pod_conventions.worker_selector(decision.name)
    status.workers.ready = sum(
        1 for pod in decision.live_pods() if pod.ready and pod.index < decision.replicas)
    _effective(decision)
    sample = decision.observed.metrics
    if sample is not None:
        advanced_from, from_step = status.progress.updated_at, status.progress.step
        record_metrics(status, sample, decision.job.spec.checkpoint.uri, decision.now)
        advanced_to = status.progress.updated_at
        if sample.reported and advanced_to is not None and advanced_to != advanced_from:
            status.goodput = step_goodput(status.goodput, status.start_time,
                                          status.last_restart_time, advanced_from, advanced_to,
                                          from_step=from_step, to_step=status.progress.step,
                                          redone_until=sample.redone_until,
                                          resumed_step=sample.resumed_step,
                                          first_step=sample.first_step)
    _replica_groups(decision)
    _ranks(decision)


# The event of a change in the quorum of replica groups (spec.faultTolerance).
QUORUM_CHANGED = "QuorumChanged"


def _replica_groups(decision: ReconcilePass) -> None:
    """spec.faultTolerance: status.replicaGroups, from the pods (ready groups) and worker 0's
    trainer (the quorum, what was passed over), and an event when the quorum changed: a
    warning when it shrank, for the steps trained without a group skip its share."""
    tolerance = decision.job.spec.fault_tolerance
    if tolerance is None:
        return
    status, sample = decision.status, decision.observed.metrics
    groups = tolerance.replica_groups
    pods_per_group = tolerance.pods_per_group(decision.replicas)
    ready = [pod.index // pods_per_group for pod in decision.live_pods()
             if pod.ready and pod.index < decision.replicas]
    previous = status.replica_groups
    in_quorum = sample.replica_groups if sample is not None else None
    current = ReplicaGroupsStatus(
        groups=groups,
        ready=sum(1 for group in range(groups) if ready.count(group) == pods_per_group),
        in_quorum=in_quorum if in_quorum is not None else (previous and previous.in_quorum),
        skipped_samples=(sample.skipped_samples if sample is not None
                         and sample.skipped_samples is not None
                         else previous and previous.skipped_samples),
        restarts=((previous.restarts if previous is not None else []) + [0] * groups)[:groups])
    status.replica_groups = current
    before = previous.in_quorum if previous is not None else None
    if in_quorum is not None and before is not None and in_quorum != before:
        step = status.progress.step
        decision.event(QUORUM_CHANGED, (
            f"{in_quorum} of {groups} replica groups in the quorum at step {step} (was "
            f"{before}); " + ("the others train on without the absent groups' share of each "
                              "batch" if in_quorum < before else "the returning groups "
                              "took a live group's state")), warning=in_quorum < before)
        decision.actions.append(CountQuorumChange(shrank=in_quorum < before))


def world_size(job: TrainingJob) -> int:
    """Training processes at the job's replicas: workers times processes per worker."""
    return job.spec.workers.replicas * job.spec.workers.procs_per_worker


def effective_batch(spec: TrainingJobSpec, previous: EffectiveBatch | None,
                    world_size: int) -> tuple[EffectiveBatch, bool]:
    """status.effective: the micro-batch in use (the spec's until an out-of-memory restart)
    and the accumulation that keeps the global batch at `world_size` processes; and
    whether the user's change of the spec's micro-batch replaced a healed one."""
    asked = spec.optimization.micro_batch_size
    reset = previous is not None and previous.spec_micro_batch_size not in (None, asked)
    kept = None if reset else previous
    micro = kept.micro_batch_size if kept else asked
    if micro > asked or asked % micro:
        kept, micro = None, asked  # not a divisor of the spec's: the spec's
    accumulation = spec.gradient_accumulation(rules.data_parallel_processes(spec, world_size),
                                              micro)
    if kept is None:
        return EffectiveBatch(micro_batch_size=micro, gradient_accumulation_steps=accumulation,
                              spec_micro_batch_size=asked), reset
    effective = kept.model_copy()
    effective.gradient_accumulation_steps = accumulation
    effective.spec_micro_batch_size = asked
    return effective, reset


def _effective(decision: ReconcilePass) -> None:
    previous = decision.status.effective
    effective, reset = effective_batch(decision.job.spec, previous, world_size(decision.job))
    if reset:
        assert previous is not None  # a reset replaces a previous value
        # The user changed the spec's micro-batch (after healing, say): theirs now.
        decision.event("MicroBatchReset", f"optimization.microBatchSize is "
                       f"{effective.spec_micro_batch_size} now: the workers use it from their "
                       f"next start (they used {previous.micro_batch_size})")
    decision.status.effective = effective


def record_metrics(status: TrainingJobStatus, sample: MetricsSample, checkpoint_uri: str,
                   now: datetime) -> None:
    """Write rank 0's metrics into status: progress, goodput and the checkpoints."""
    _progress(status.progress, sample, now)
    if sample.wall_seconds:
        status.goodput = goodput_status(sample.wall_seconds, sample.checkpoint_load_seconds)
    latest = status.latest_checkpoint
    # The trainer's gauges read step 0 and time 0 until it commits a checkpoint: only a
    # commit time shows that one exists.
    if sample.checkpoint_step is not None and sample.checkpoint_time is not None and (
            latest is None or latest.step != sample.checkpoint_step):
        status.latest_checkpoint = CheckpointStatus(
            step=sample.checkpoint_step, uri=checkpoint_uri, time=sample.checkpoint_time)
    # Step 0 is never a best checkpoint (the baseline evaluation saves none): none yet.
    if sample.best_checkpoint_step and sample.best_checkpoint_val_loss is not None:
        uri = checkpoint_uri.rstrip("/")
        status.best_checkpoint = BestCheckpointStatus(
            step=sample.best_checkpoint_step,
            validation_loss=round(sample.best_checkpoint_val_loss, 6),
            uri=f"{uri}/{step_folder(sample.best_checkpoint_step)}")


def _progress(progress: Progress, sample: MetricsSample, now: datetime) -> None:
    if sample.step is not None:
        newer = sample.last_step_time is not None and (
            progress.updated_at is None or sample.last_step_time > progress.updated_at)
        if sample.step != progress.step or newer or progress.updated_at is None:
            progress.step = sample.step
            progress.updated_at = min(sample.last_step_time or now, now)
    if sample.max_steps is not None:
        progress.max_steps = sample.max_steps
    if sample.finished and progress.max_steps is not None and progress.step != progress.max_steps:
        progress.step = progress.max_steps
        progress.updated_at = now
    if sample.epoch is not None:
        progress.epoch = round(sample.epoch, 4)
    if sample.loss is not None:
        progress.loss = round(sample.loss, 6)
    if sample.ce_loss is not None:  # only a distillation job exports the two terms
        progress.ce_loss = round(sample.ce_loss, 6)
    if sample.kd_loss is not None:
        progress.kd_loss = round(sample.kd_loss, 6)
    if sample.tokens_per_second is not None:
        progress.tokens_per_second = round(sample.tokens_per_second, 3)
    if sample.step_time is not None and progress.max_steps is not None:
        progress.eta_seconds = round(max(0, progress.max_steps - progress.step) * sample.step_time)
    if sample.eta_seconds is not None:  # the job's own code estimated it
        progress.eta_seconds = sample.eta_seconds


def goodput_status(wall_seconds: Mapping[str, float],
                   load_seconds: Mapping[str, float] | None = None) -> GoodputStatus:
    """status.goodput from the trainer's seconds by cause (kubetrain_wall_time_seconds_total),
    with checkpointLoad split by tier where the trainer exports the split
    (`load_seconds`, kubetrain_checkpoint_load_seconds_total{tier}).

    The seconds as the trainer booked them, to the millisecond, so that short causes (a
    few redone steps' lostProgress) show and the causes add up to the wall time; the wall
    time and the ratio are computed from the unrounded figures (the ratio shown to 4
    digits). Causes this operator does not know are left out of the breakdown but stay
    in the wall time.
    """
    wall = sum(wall_seconds.values())
    productive = wall_seconds.get("productive", 0.0)
    badput: dict[str, Any] = {cause: round(seconds, 3)
                              for cause, seconds in wall_seconds.items()
                              if cause in BadputSeconds.model_fields}
    if load_seconds:
        badput["checkpoint_load_by_tier"] = CheckpointLoadSeconds(**{
            tier: round(seconds, 3) for tier, seconds in load_seconds.items()
            if tier in CheckpointLoadSeconds.model_fields})
    return GoodputStatus(ratio=round(productive / wall, 4) if wall > 0 else 1.0,
                         productive_seconds=round(productive, 3), wall_seconds=round(wall, 3),
                         badput_seconds=BadputSeconds(**badput))


def step_goodput(previous: GoodputStatus | None, start: datetime | None,
                 last_restart: datetime | None, advanced_from: datetime | None,
                 advanced_to: datetime, *, from_step: int | None = None,
                 to_step: int | None = None, redone_until: int | None = None,
                 resumed_step: int | None = None, first_step: int | None = None
                 ) -> GoodputStatus | None:
    """status.goodput of a job whose progress comes from its status reports, at the moment
    its step advanced again (`advanced_to`, having last advanced at `advanced_from`), from
    `from_step` to `to_step`.

    Own code reports steps, not where its time went: the time between two advances of the
    step within one attempt is productive, except its share spent redoing steps that an
    earlier attempt had trained (up to `redone_until`, the furthest step an earlier attempt
    reported: the status endpoint keeps it), which is lost progress, as kubetrain's trainer
    books the steps a restart made it redo; at the attempt's first advance, also the steps
    it redid between the checkpoint it resumed from (`resumed_step`, which kubetrain's entry
    reports) and its first report (`first_step`), at the pace of that advance
    (`restart_rules.Advance`). The rest of the wall time since the job first started
    (start-up, replacement, scheduling and backoff around each restart, stalls longer than
    a report interval) is downtime. A step that went back, or the first report after a
    reported resume, began a new attempt, whether or not a restart was seen. The seconds
    add up advance by advance, so a pass that sees no new step changes nothing. None
    before the job started.
    """
    if start is None:
        return previous
    productive = previous.productive_seconds if previous is not None else 0.0
    lost = previous.badput_seconds.lost_progress if previous is not None else 0.0
    went_back = from_step is not None and to_step is not None and to_step < from_step
    # The first report after a resume the entry reported begins an attempt, as a step that
    # went back does: the time before it is the restart's, whatever the steps say.
    first_of_attempt = first_step is not None and to_step == first_step
    same_attempt = advanced_from is not None and not went_back and not first_of_attempt and (
        last_restart is None or advanced_from >= last_restart)
    if same_attempt and advanced_from is not None and advanced_from >= start:
        seconds = max(timedelta(0), advanced_to - advanced_from).total_seconds()
        if from_step is not None and to_step is not None:
            booked = rules.Advance(from_step, to_step, seconds, redone_until, resumed_step,
                                   first_step).booked()
        else:
            booked = (seconds, 0.0)
        productive += booked[0]
        lost += booked[1]
    wall = max(0.0, (advanced_to - start).total_seconds())
    productive = min(productive, wall)
    lost = min(lost, wall - productive)
    # To the millisecond, as goodput_status: a few redone steps' lost progress shows.
    return GoodputStatus(ratio=round(productive / wall, 4) if wall > 0 else 1.0,
                         productive_seconds=round(productive, 3), wall_seconds=round(wall, 3),
                         badput_seconds=BadputSeconds(lost_progress=round(lost, 3),
                                                      downtime=round(wall - productive - lost, 3)))


def _ranks(decision: ReconcilePass) -> None:
    """Judge each rank's slowness once per logged interval; name a straggler."""
    sample = decision.observed.metrics
    if sample is None or not sample.ranks or sample.ranks_step is None:
        return
    policy = decision.job.spec.run_policy.stragglers
    previous = decision.status.ranks
    if previous is not None and previous.step == sample.ranks_step:
        return  # the same interval, scraped again
    tensor_parallel = decision.job.spec.parallelism.tensor_parallel  # judged as groups
    judged = stragglers.judge(previous, sample.ranks_step, sample.ranks, policy.threshold,
                              policy.window, tensor_parallel)
    decision.status.ranks = judged
    slow = stragglers.stragglers(judged)
    if not slow:
        decision.condition("Straggler", False, "NoSlowRank", "every rank's compute time is "
                           f"within {policy.threshold:g}x the median rank's")
        return
    said = {(rank.rank, rank.pod): stragglers.describe(rank, policy.window, tensor_parallel)
            for rank in slow}
    decision.condition("Straggler", True, "SlowRank", "; ".join(said.values()) + (
        f" (runPolicy.stragglers: threshold {policy.threshold:g}, window {policy.window}, "
        f"action {policy.action})"))
    for rank in stragglers.newly(previous, judged):  # one event per episode
        decision.event("Straggler", said[(rank.rank, rank.pod)], warning=True)
        decision.new_stragglers.append(rank)
