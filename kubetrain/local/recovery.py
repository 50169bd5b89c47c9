"""The run policy of a local run: when to restart the worker group, after how long, when to give up.

The operator's rules, `kubetrain.restart_rules`, over `spec.runPolicy` and the
failures of this run so far, so that a job restarts and fails locally as it does on
Kubernetes: a failed, lost or hung group is restarted as a whole after an
exponentially growing delay, until `maxRestarts` is spent; a permanent exit code,
or the same exit code repeating with the training step not past where it first
failed, fails the job at once. A worker out of memory (OOMKilled, CUDAOutOfMemory)
restarts the group at once with half the micro-batch and twice the accumulation
(`after_out_of_memory`, spec.runPolicy.outOfMemory), outside maxRestarts, however
many restarts were spent. torchrun runs here with no budget of restarts in place
(`--max-restarts 0`), so every failure is the group's own: the operator judges the same
one at a pod's end once that pod's torchrun has spent its budget
(`restart_rules.restarts_in_place`), and counts the restarts in place before it as these.
`kubetrain.local.runner` acts on these decisions; nothing here touches a process or
a clock.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

from kubetrain import restart_rules as rules
from kubetrain.api.trainingjob import EffectiveBatch, FailureStreak, RunPolicy, TrainingJobSpec
from kubetrain.protocol import TRAINER_CLASSES
from kubetrain.restart_rules import Ending, RetryKind


@dataclass(frozen=True)
class GroupFailure:
    """Why one attempt of the worker group ended without finishing the job."""

    reason: str
    """What the user reads: "worker 1 was lost (killed by signal 9)", "no progress for 30s"."""
    exit_code: int | None
    """Exit status of the first worker that failed; None for a hang."""
    step: int
    """The training step when it failed (the newest the run logged; 0 before any)."""
    failure_class: str = "Unknown"
    """The class the operator would give the pod (kubetrain.operator.failures)."""
    node_lost: bool = False
    """The runner lost the node itself (--kill-worker-at-step), as a machine is lost."""


def node_failure_class(exit_code: int, said: str | None, oom_killed: bool,
                       permanent_exit_codes: Collection[int]) -> str:
    """The class the operator would give a failed node's pod: the trainer's class from its
    termination message (`said`), OOMKilled when the run's cgroup counted an OOM kill during
    the attempt, UserError for a permanent exit code, NodeLost for a signal's death."""
    if said is not None and said in TRAINER_CLASSES:
        return said
    if oom_killed:
        return "OOMKilled"
    if exit_code in permanent_exit_codes:
        return "UserError"
    return "NodeLost" if exit_code < 0 else "Unknown"


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
                      failure_class=failure.failure_class)


def is_out_of_memory(policy: RunPolicy, failure: GroupFailure) -> bool:
    """Whether `after_out_of_memory` answers this failure rather than `after_failure`."""
    return rules.heals_out_of_memory(failure.failure_class, kind_of(policy, failure))


def after_failure(policy: RunPolicy, failures: Sequence[GroupFailure]) -> Decision:
    """Decide what follows the last of `failures` (every failure of this run that counts
    against maxRestarts, oldest first; out-of-memory ones are not among them)."""
    if not failures:
        raise ValueError("after_failure needs at least one failure")
    last = failures[-1]
    kinds = [kind_of(policy, failure) for failure in failures]
    if kinds[-1] == "permanent":
        return Decision(False, 0.0, f"{last.reason}; exit code {last.exit_code} is permanent "
                        "(spec.runPolicy.permanentExitCodes), so the job is not retried",
                        ending="PermanentError")
    if kinds[-1] == "code":
        streak: FailureStreak | None = None
        for failure, kind in zip(failures, kinds, strict=True):
            if kind == "code" and failure.exit_code is not None:
                streak = rules.next_streak(streak, failure.exit_code, failure.step)
        assert streak is not None  # the last failure is a "code" one
        if rules.repeated(streak, policy):
            return Decision(False, 0.0, f"{last.reason}; the same exit code {last.exit_code} "
                            f"ended {streak.count} attempts in a row with no training progress "
                            f"past step {streak.step} (spec.runPolicy.repeatedFailureLimit: "
                            f"{policy.repeated_failure_limit})", ending="RepeatedFailure")
    restarts_done = len(failures) - 1
    if rules.restarts_spent(policy, restarts_done):
        return Decision(False, 0.0, f"{last.reason}; all {policy.max_restarts} restarts "
                        "allowed by spec.runPolicy.maxRestarts are spent",
                        ending="MaxRestartsExceeded")
    return Decision(True, rules.backoff_seconds(policy, restarts_done + 1), last.reason)


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


def after_attempt(spec: TrainingJobSpec, counted: Sequence[GroupFailure],
                  ended: Sequence[GroupFailure], *, micro_batch_size: int,
                  out_of_memory_restarts: int, world_size: int) -> Decision:
    """What follows an attempt of the group that ended with `ended` (its failed nodes, by
    index), after `counted` failures counted against maxRestarts (oldest first), at
    `micro_batch_size` with `out_of_memory_restarts` behind: the runner's one question."""
    policy = spec.run_policy
    failure = ended[0]
    if is_out_of_memory(policy, failure) and not spec.own_code:
        return after_out_of_memory(spec, failure, micro_batch_size, out_of_memory_restarts,
                                   world_size)
    decision = after_failure(policy, [*counted, failure])
    return replace(decision, counted=failure)


@dataclass
class ProgressClock:
    """Hang detection: how long the training step has gone without advancing.

    The clock restarts whenever the group (re)starts, so startup and checkpoint
    loading count against `progressDeadlineSeconds` just as they do on Kubernetes.
    """

    step: int
    since: float

    def observe(self, step: int, now: float) -> None:
        """Record the newest step seen at time `now`; only an advance resets the clock."""
        if step > self.step:
            self.step, self.since = step, now

    def stalled_for(self, now: float) -> float:
        """Seconds since the step last advanced (or since the clock started)."""
        return now - self.since

    def is_hung(self, policy: RunPolicy, now: float) -> bool:
        """Whether the step has not advanced for longer than progressDeadlineSeconds."""
        deadline = policy.progress_deadline_seconds
        return deadline is not None and self.stalled_for(now) > deadline
