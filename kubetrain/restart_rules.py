"""The restart rules: what follows a failed worker, the same for the operator and `kubetrain run`.

"The same manifest runs locally" means the same decisions: both runners ask these
pure functions, over `spec.runPolicy` and what happened so far, and only word and
apply the answer their own way (status, events and pods for the operator; processes
and the terminal for the local runner).

What happened, first: each failed worker's class (`failure_class`), in the order it is
decided: its node lost, preempted, evicted, killed by the kernel's OOM killer, then what
the trainer wrote (CUDAOutOfMemory, CollectiveTimeout, GPUError, PreflightFailed,
QuorumLost), a permanent exit code (UserError), else Unknown. The OOM kill outranks the
trainer's words: a rank that timed out on a peer the kernel killed is the kill's
consequence.

What follows, in the order `judge` checks it over every worker that failed together:
- a failure's retry kind (`retry_kind`): an exit code in runPolicy.permanentExitCodes
  is `permanent` and fails the job; a signal exit (128 + N, or Popen's -N), the
  trainer's restart-me code 75, no exit code at all (a hang, an eviction), a lost node
  or a class with its own rule (out of memory, a failed preflight) is `retryable`;
  any other exit code is `code`, retried until it repeats;
- out of memory halves the micro-batch and doubles the accumulation
  (`after_out_of_memory`, runPolicy.outOfMemory), outside maxRestarts and without a
  backoff (the cause is fixed, not waited out); with nothing smaller left the job fails
  with `kubetrain estimate`'s advice;
- the same `code` exit repeated with the training step not past where the streak began
  fails the job at runPolicy.repeatedFailureLimit (`next_streak`, `repeated`);
- a failed preflight restarts the group (the operator also avoids the nodes it names);
- every other restart counts against runPolicy.maxRestarts (`restarts_spent`) and waits
  a backoff that doubles per restart up to runPolicy.maxBackoffSeconds
  (`restart_delay`), except after a lost node: its workers go to another node, so there
  is nothing to wait out;
- a group whose step has not advanced for longer than runPolicy.progressDeadlineSeconds
  is hung (`is_hung`), and restarts as a whole; before an attempt's first step,
  runPolicy.startupDeadlineSeconds is the deadline where set (`hang_deadline`);
- on Kubernetes torchrun restarts a pod's trainers in place while that pod's own budget
  (PET_MAX_RESTARTS = runPolicy.maxRestarts) lasts (`restarts_in_place`): such a restart
  is counted and shown but ends no job for maxRestarts; past the budget the pod ends, and
  its end is judged as above (out of memory halves, whatever restarts were spent).
  `kubetrain run` runs torchrun with no budget, so every failure is the group's own.

Torch-free and free of I/O and clocks. The exit codes and class names are
`kubetrain.protocol`'s; the halving itself is `TrainingJobSpec.after_out_of_memory`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Final, Literal

from kubetrain.api.trainingjob import EffectiveBatch, FailureStreak, RunPolicy, TrainingJobSpec
from kubetrain.protocol import EXIT_RESTART, OUT_OF_MEMORY_CLASSES, TRAINER_CLASSES, is_signal_exit

# What a failure is to the restart rules (not its failure class, which says what happened).
RetryKind = Literal["permanent", "retryable", "code"]
# How a job the rules end fails: the Failed condition's reason on Kubernetes.
Ending = Literal["PermanentError", "OutOfMemory", "RepeatedFailure", "MaxRestartsExceeded"]
# Failure classes a rule of their own answers (halving the micro-batch, avoiding the
# nodes a preflight named): never part of a streak of exit codes.
OWN_RULE_CLASSES: Final = OUT_OF_MEMORY_CLASSES | {"PreflightFailed"}

ESTIMATE_ADVICE: Final = (
    "run `kubetrain estimate` on the job for a configuration that fits: activation "
    "checkpointing (parallelism.activationCheckpointing), more workers with strategy fsdp, "
    "or more memory per worker (spec.workers.resources.limits.memory)")


def failure_class(*, exit_code: int | None, permanent_exit_codes: Collection[int],
                  node_lost: bool = False, preempted: bool = False, evicted: bool = False,
                  oom_killed: bool = False, trainer_class: str | None = None) -> str:
    """A failed worker's class from what its runner saw, in the order of the module
    docstring: `node_lost` (the node is gone, unreachable, or the runner lost it), then
    `preempted`, `evicted`, `oom_killed` (the kernel's OOM killer, in the container's or
    the run's memory cgroup), the class the trainer wrote (`trainer_class`, one of the
    protocol's TRAINER_CLASSES), a permanent exit code, else Unknown."""
    if node_lost:
        return "NodeLost"
    if preempted:
        return "Preempted"
    if evicted:
        return "Evicted"
    if oom_killed:
        return "OOMKilled"
    if trainer_class is not None and trainer_class in TRAINER_CLASSES:
        return trainer_class
    if exit_code is not None and exit_code in permanent_exit_codes:
        return "UserError"
    return "Unknown"


def retry_kind(exit_code: int | None, permanent_exit_codes: Collection[int], *,
               failure_class: str = "Unknown", disrupted: bool = False) -> RetryKind:
    """`permanent`, `retryable` or `code` (a plain non-zero exit: retried until it repeats).

    `disrupted`: the worker's node was lost, or Kubernetes ended it (eviction,
    preemption, an OOM kill, a deadline), whatever its exit code says.
    """
    if exit_code is not None and exit_code in permanent_exit_codes:
        return "permanent"
    if (exit_code is None or disrupted or is_signal_exit(exit_code) or exit_code == EXIT_RESTART
            or failure_class in OWN_RULE_CLASSES):
        return "retryable"
    return "code"


def heals_out_of_memory(failure_class: str, kind: RetryKind) -> bool:
    """Whether a failure goes to the out-of-memory rule (a permanent exit code still fails)."""
    return failure_class in OUT_OF_MEMORY_CLASSES and kind != "permanent"


# The rule that answers the workers that failed together, in the order `judge` checks them.
Rule = Literal["permanent", "out_of_memory", "preflight", "repeated", "restart"]


@dataclass(frozen=True)
class Ended:
    """One failed worker as the rules read it, whichever runner saw it."""

    exit_code: int | None
    failure_class: str
    kind: RetryKind
    node_lost: bool = False  # its node was lost (or the runner lost it)


@dataclass(frozen=True)
class Judgement:
    """What answers the workers that failed together: `rule`, for `ended` (the first of
    them it answers, in the order given), with the streak of exit codes after them."""

    rule: Rule
    ended: Ended
    streak: FailureStreak | None
    node_lost: bool  # every one of them lost its node: a restart waits no backoff


def judge(ends: Sequence[Ended], streak: FailureStreak | None, step: int,
          policy: RunPolicy) -> Judgement:
    """The one ordered decision both runners take over the workers that failed together
    (`ends`, non-empty, in the runner's order), at training step `step`, after `streak`:
    a permanent exit code on any of them fails the job; out of memory on any answers by its
    own rule (`after_out_of_memory`); a failed preflight restarts the group; the same exit
    code repeated with no progress (`next_streak`, `repeated`) fails the job; anything else
    is a restart (`restarts_spent`, `restart_delay`). Only a `code` failure moves the streak."""
    if not ends:
        raise ValueError("judge needs at least one failed worker")
    node_lost = all(end.node_lost for end in ends)
    permanent = next((end for end in ends if end.kind == "permanent"), None)
    if permanent is not None:
        return Judgement("permanent", permanent, streak, node_lost)
    out_of_memory = next((end for end in ends
                          if heals_out_of_memory(end.failure_class, end.kind)), None)
    if out_of_memory is not None:
        return Judgement("out_of_memory", out_of_memory, streak, node_lost)
    preflight = next((end for end in ends if end.failure_class == "PreflightFailed"), None)
    if preflight is not None:
        return Judgement("preflight", preflight, streak, node_lost)
    coded = next((end for end in ends if end.kind == "code"), None)
    if coded is not None and coded.exit_code is not None:
        streak = next_streak(streak, coded.exit_code, step)
        if repeated(streak, policy):
            return Judgement("repeated", coded, streak, node_lost)
    return Judgement("restart", ends[0], streak, node_lost)


def is_hung(stalled_seconds: float, deadline_seconds: int | None) -> bool:
    """Whether a group whose step has not advanced for `stalled_seconds` is hung: for longer
    than its deadline (`hang_deadline`; None: never)."""
    return deadline_seconds is not None and stalled_seconds > deadline_seconds


def hang_deadline(policy: RunPolicy, stepped: bool) -> tuple[int | None, str]:
    """The deadline a group's silence is judged by, and the field that sets it: until the
    attempt's first step (`stepped` False) runPolicy.startupDeadlineSeconds, where set;
    otherwise runPolicy.progressDeadlineSeconds."""
    if not stepped and policy.startup_deadline_seconds is not None:
        return policy.startup_deadline_seconds, "startupDeadlineSeconds"
    return policy.progress_deadline_seconds, "progressDeadlineSeconds"


def next_streak(streak: FailureStreak | None, exit_code: int, step: int) -> FailureStreak:
    """The streak after a `code` failure with `exit_code` at training step `step`.

    One longer when the same code ended the streak's attempts and the step is still the
    one the streak began at; otherwise a new streak of one. Failures of another retry
    kind in between leave the streak as it is.
    """
    if streak is not None and streak.exit_code == exit_code and streak.step == step:
        return streak.model_copy(update={"count": streak.count + 1})
    return FailureStreak(exit_code=exit_code, count=1, step=step)


def repeated(streak: FailureStreak, policy: RunPolicy) -> bool:
    """Whether the streak reached runPolicy.repeatedFailureLimit: the job fails."""
    return streak.count >= policy.repeated_failure_limit


def restarts_spent(policy: RunPolicy, restarts: int) -> bool:
    """Whether `restarts` counted restarts leave none for another (runPolicy.maxRestarts)."""
    return restarts >= policy.max_restarts


def restarts_in_place(policy: RunPolicy, done_in_pod: int) -> bool:
    """Whether torchrun restarts a pod's trainers in place after one failed, having done
    `done_in_pod` restarts in place in that pod: its agent's budget is PET_MAX_RESTARTS =
    runPolicy.maxRestarts, per pod (a new pod's agent starts with the whole budget).

    True: the restart happens whatever `restarts_spent` says, so it is counted and shown
    but does not end the job (a permanent or repeated exit code still does). False: the
    pod's agent gives up and the pod ends; its end, a pod failure, is what the rules judge
    (an out-of-memory kill then halves the micro-batch, which no restart in place can).
    """
    return done_in_pod < policy.max_restarts


def restart_delay(policy: RunPolicy, restart: int, *, counted: bool, node_lost: bool) -> float:
    """Seconds the `restart`-th counted restart waits before its workers start again: its
    backoff (`backoff_seconds`); none for an uncounted restart (out of memory: the cause is
    fixed, not waited out) or one after a lost node (its workers go to another node, so
    there is nothing to wait out)."""
    if not counted or node_lost:
        return 0.0
    return backoff_seconds(policy, restart)


def backoff_seconds(policy: RunPolicy, restart: int) -> float:
    """Delay before the `restart`-th counted restart (1 for the first): doubles each time,
    capped at runPolicy.maxBackoffSeconds; none before the first."""
    if restart <= 0:
        return 0.0
    return float(min(policy.backoff_seconds * 2 ** (restart - 1), policy.max_backoff_seconds))


@dataclass(frozen=True)
class OutOfMemoryVerdict:
    """What running out of memory leads to: a smaller micro-batch, or the job fails."""

    effective: EffectiveBatch | None
    """The batch split to restart with (status.effective); None: the job fails."""
    why_not: str
    """With no smaller micro-batch: why none is tried, naming the field."""
    limit: int
    """Out-of-memory restarts the job allows (log2 of the spec's micro-batch)."""


def after_out_of_memory(spec: TrainingJobSpec, micro_batch_size: int, out_of_memory_restarts: int,
                        world_size: int, reason: str,
                        now: datetime | None = None) -> OutOfMemoryVerdict:
    """Restart with half the micro-batch and the accumulation that keeps the global batch,
    or fail (runPolicy.outOfMemory). `reason` and `now` go into the new status.effective."""
    smaller, why = spec.after_out_of_memory(micro_batch_size, out_of_memory_restarts)
    limit = spec.out_of_memory_restart_limit()
    if smaller is None:
        return OutOfMemoryVerdict(None, why, limit)
    effective = EffectiveBatch(
        micro_batch_size=smaller,
        gradient_accumulation_steps=spec.gradient_accumulation(
            data_parallel_processes(spec, world_size), smaller),
        out_of_memory_restarts=out_of_memory_restarts + 1,
        spec_micro_batch_size=spec.optimization.micro_batch_size, reason=reason, time=now)
    return OutOfMemoryVerdict(effective, "", limit)


def data_parallel_processes(spec: TrainingJobSpec, world_size: int) -> int:
    """Of `world_size` training processes, those that read different micro-batches: the
    parallelism.tensorParallel processes of a tensor-parallel group read the same ones, so
    the accumulation that keeps the global batch counts groups, as the trainer does (a
    degree strategy auto picks is the trainer's alone to count)."""
    return max(1, world_size // spec.parallelism.tensor_parallel)


def estimate_advice(trainer_message: str = "") -> str:
    """What to do when nothing smaller fits: `kubetrain estimate`'s advice, or a pointer to
    the advice the trainer already wrote into its message."""
    if "kubetrain estimate" in trainer_message:
        return "see kubetrain estimate's advice above"
    return ESTIMATE_ADVICE


@dataclass(frozen=True)
class Advance:
    """Own code's reported step advancing within one attempt: from `from_step` to `to_step`
    in `seconds`. `redone_until` is the furthest step an earlier attempt had reported (None:
    none had); `resumed_step` the step of the checkpoint this attempt resumed from and
    `first_step` the first step it reported, when the runner knows them (None: unknown)."""

    from_step: int
    to_step: int
    seconds: float
    redone_until: int | None = None
    resumed_step: int | None = None
    first_step: int | None = None

    def booked(self) -> tuple[float, float]:
        """(productive, lost progress) seconds of the advance: both runners book own code's
        reported steps by it (the operator's `observation.step_goodput`, `kubetrain run`'s
        `local.own_code.ReportedGoodput`).

        The steps the advance covers that an earlier attempt had reported are lost
        progress. So are, counted exactly at the attempt's first advance (the one from its
        first reported step), the steps it trained between its checkpoint and that first
        report, up to the furthest reported before: they took place before the advance,
        at the pace it measures, and were booked as downtime until this pace was known.
        A report every few seconds would otherwise hide a restart's few redone steps."""
        steps = self.to_step - self.from_step
        if steps <= 0:
            return 0.0, 0.0
        per_step = self.seconds / steps
        until = self.redone_until
        inside = 0 if until is None else min(max(0, until - self.from_step), steps)
        before = 0
        if (until is not None and self.resumed_step is not None
                and self.from_step == self.first_step):
            before = max(0, min(self.from_step, until) - self.resumed_step)
        return (steps - inside) * per_step, (inside + before) * per_step
