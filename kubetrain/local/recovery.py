"""Recovery in a local run: what a failed node is, and what follows a failed attempt.

`kubetrain.restart_rules` decides, as it does for the operator: each failed node's class
(`node_failure_class`: the runner lost the node itself, the run's memory cgroup counted
an OOM kill, the trainer's class in the node's termination log, a permanent exit code),
and what follows the attempt (`after_attempt`: the one ordered decision,
`restart_rules.judge`, over every node that failed together). So a job restarts and fails
locally as it does on Kubernetes: a failed, lost or hung group is restarted as a whole
after an exponentially growing delay (none after a lost node), until `maxRestarts` is
spent; a permanent exit code, or the same exit code repeating with the training step not
past where it first failed, fails the job at once. A worker out of memory (OOMKilled,
CUDAOutOfMemory) restarts the group at once with half the micro-batch and twice the
accumulation (`after_out_of_memory`, spec.runPolicy.outOfMemory), outside maxRestarts,
however many restarts were spent; own code gets the count of such restarts
(KUBETRAIN_OUT_OF_MEMORY_RESTARTS) and halves by it. torchrun runs here with no budget of
restarts in place (`--max-restarts 0`), so every failure is the group's own: the operator
judges the same one at a pod's end once that pod's torchrun has spent its budget
(`restart_rules.restarts_in_place`), and counts the restarts in place before it as these.
A step that has not advanced for longer than progressDeadlineSeconds is a hang
(`ProgressClock`, `restart_rules.is_hung`).

`kubetrain.local.runner` acts on these decisions; nothing here touches a process or a clock.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from kubetrain import restart_rules as rules
from kubetrain.api.trainingjob import EffectiveBatch, FailureStreak, RunPolicy, TrainingJobSpec
from kubetrain.restart_rules import Ending, RetryKind


@dataclass(frozen=True)
class GroupFailure:
    """Why one attempt of the worker group ended without finishing the job: one node's end."""

    reason: str
    """What the user reads: "worker 1 was lost (killed by signal 9)", "no progress for 30s"."""
    exit_code: int | None
    """Exit status of the worker that failed; None for a hang."""
    step: int
    """The training step when it failed (the newest the run logged; 0 before any)."""
    failure_class: str = "Unknown"
    """The class the operator would give the pod (`node_failure_class`)."""
    node_lost: bool = False
    """The runner lost the node itself (--kill-worker-at-step), as a machine is lost."""


def node_failure_class(exit_code: int, said: str | None, oom_killed: bool,
                       permanent_exit_codes: Collection[int], *, lost: bool = False) -> str:
    """The class the operator would give a failed node's pod (`restart_rules.failure_class`):
    NodeLost when the runner `lost` the node itself, OOMKilled when the run's memory cgroup
    counted an OOM kill during the attempt, the trainer's class from its termination message
    (`said`), UserError for a permanent exit code, else Unknown (a signal from outside, as a
    container killed from outside is on Kubernetes)."""
    return rules.failure_class(exit_code=exit_code, permanent_exit_codes=permanent_exit_codes,
                               node_lost=lost, oom_killed=oom_killed, trainer_class=said)


@dataclass(frozen=True)
class Decision:
    """What to do after a group failure: restart after `delay` seconds, or fail with `reason`."""

    restart: bool
    delay: float
    reason: str
    micro_batch_size: int | None = None
    """An out-of-memory restart's smaller micro-batch."""
    effective: EffectiveBatch | None = None
    """An out-of-memory restart's batch split, as the operator writes it to status.effective."""
    ending: Ending | None = None
    """Why the job fails, as the operator's Failed condition says it."""
    counted: GroupFailure | None = None
    """The failure this decision counted against maxRestarts (None: none was)."""


def kind_of(policy: RunPolicy, failure: GroupFailure) -> RetryKind:
    """The failure's retry kind under the operator's rule (kubetrain.restart_rules)."""
    return rules.retry_kind(failure.exit_code, policy.permanent_exit_codes,
                            failure_class=failure.failure_class, disrupted=failure.node_lost)


def is_out_of_memory(policy: RunPolicy, failure: GroupFailure) -> bool:
    """Whether the out-of-memory rule answers this failure (a permanent exit code does not)."""
    return rules.heals_out_of_memory(failure.failure_class, kind_of(policy, failure))


def _streak(policy: RunPolicy, counted: Sequence[GroupFailure]) -> FailureStreak | None:
    """The streak of exit codes the counted failures left, oldest first."""
    streak: FailureStreak | None = None
    for failure in counted:
        if kind_of(policy, failure) == "code" and failure.exit_code is not None:
            streak = rules.next_streak(streak, failure.exit_code, failure.step)
    return streak


def after_attempt(spec: TrainingJobSpec, counted: Sequence[GroupFailure],
                  ended: Sequence[GroupFailure], *, micro_batch_size: int,
                  out_of_memory_restarts: int, world_size: int) -> Decision:
    """What follows an attempt of the group that ended with `ended` (its failed nodes, by
    index), after `counted` failures counted against maxRestarts (oldest first), at
    `micro_batch_size` with `out_of_memory_restarts` behind: `restart_rules.judge`, as the
    operator asks it over the pods that failed in one pass."""
    policy = spec.run_policy
    ends = [rules.Ended(failure.exit_code, failure.failure_class, kind_of(policy, failure),
                        failure.node_lost) for failure in ended]
    judgement = rules.judge(ends, _streak(policy, counted), ended[0].step, policy)
    failure = next(failure for failure, end in zip(ended, ends, strict=True)
                   if end is judgement.ended)
    if judgement.rule == "out_of_memory":
        return after_out_of_memory(spec, failure, micro_batch_size, out_of_memory_restarts,
                                   world_size)
    return _counted(policy, len(counted), failure, judgement)


def after_failure(policy: RunPolicy, failures: Sequence[GroupFailure]) -> Decision:
    """Decide what follows the last of `failures` (every failure of this run that counts
    against maxRestarts, oldest first; out-of-memory ones are not among them)."""
    if not failures:
        raise ValueError("after_failure needs at least one failure")
    *before, last = failures
    end = rules.Ended(last.exit_code, last.failure_class, kind_of(policy, last), last.node_lost)
    judgement = rules.judge([end], _streak(policy, before), last.step, policy)
    return _counted(policy, len(before), last, judgement)


def _counted(policy: RunPolicy, restarts_done: int, failure: GroupFailure,
             judgement: rules.Judgement) -> Decision:
    """A decision that counts `failure` against maxRestarts, as `judgement` says it."""
    if judgement.rule == "permanent":
        return Decision(False, 0.0, f"{failure.reason}; exit code {failure.exit_code} is "
                        "permanent (spec.runPolicy.permanentExitCodes), so the job is not "
                        "retried", ending="PermanentError", counted=failure)
    if judgement.rule == "repeated":
        streak = judgement.streak
        assert streak is not None
        return Decision(False, 0.0, f"{failure.reason}; the same exit code {failure.exit_code} "
                        f"ended {streak.count} attempts in a row with no training progress "
                        f"past step {streak.step} (spec.runPolicy.repeatedFailureLimit: "
                        f"{policy.repeated_failure_limit})", ending="RepeatedFailure",
                        counted=failure)
    if rules.restarts_spent(policy, restarts_done):
        return Decision(False, 0.0, f"{failure.reason}; all {policy.max_restarts} restarts "
                        "allowed by spec.runPolicy.maxRestarts are spent",
                        ending="MaxRestartsExceeded", counted=failure)
    delay = rules.restart_delay(policy, restarts_done + 1, counted=True,
                                node_lost=judgement.node_lost)
    return Decision(True, delay, failure.reason, counted=failure)


def after_out_of_memory(spec: TrainingJobSpec, failure: GroupFailure, micro_batch_size: int,
                        out_of_memory_restarts: int, world_size: int) -> Decision:
    """Restart at once with half the micro-batch (runPolicy.outOfMemory: Halve), or fail.

    The operator's rule (`kubetrain.restart_rules.after_out_of_memory`): the largest
    divisor of the spec's micro-batch at most half the current one and at least
    minMicroBatch, at most log2(microBatchSize) times; no backoff (the cause is fixed,
    not waited out).
    """
    what = f"{failure.reason}: out of memory ({failure.failure_class}) at micro-batch " \
           f"{micro_batch_size}"
    verdict = rules.after_out_of_memory(spec, micro_batch_size, out_of_memory_restarts,
                                        world_size, reason=what)
    effective = verdict.effective
    if effective is not None:
        return Decision(True, 0.0, f"{what}: micro-batch {effective.micro_batch_size}, "
                        f"gradient accumulation {effective.gradient_accumulation_steps} "
                        "(global batch unchanged)", micro_batch_size=effective.micro_batch_size,
                        effective=effective)
    return Decision(False, 0.0, f"{what}, and {verdict.why_not}: {rules.estimate_advice()}",
                    ending="OutOfMemory")


@dataclass
class ProgressClock:
    """Hang detection: how long the training step has gone without advancing.

    The clock restarts whenever the group (re)starts, so startup and checkpoint loading
    count against the deadline just as they do on Kubernetes: `startupDeadlineSeconds`
    until the attempt's first step where it is set, `progressDeadlineSeconds` otherwise
    (`restart_rules.hang_deadline`).
    """

    step: int
    since: float
    stepped: bool = False  # whether this attempt has taken a training step

    def observe(self, step: int, now: float, *, is_step: bool = False) -> None:
        """Record the newest step seen at time `now` (`is_step`: from a training step, not
        the trainer's start or resume); only an advance resets the clock."""
        self.stepped = self.stepped or is_step
        if step > self.step:
            self.step, self.since = step, now

    def stalled_for(self, now: float) -> float:
        """Seconds since the step last advanced (or since the clock started)."""
        return now - self.since

    def deadline(self, policy: RunPolicy) -> tuple[int | None, str]:
        """The deadline that applies now, and its field."""
        return rules.hang_deadline(policy, self.stepped)

    def is_hung(self, policy: RunPolicy, now: float) -> bool:
        """Whether the step has not advanced for longer than the deadline that applies."""
        return rules.is_hung(self.stalled_for(now), self.deadline(policy)[0])
