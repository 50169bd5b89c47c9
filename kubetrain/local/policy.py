"""The run policy of a local run: when to restart the worker group, after how long, when to give up.

Pure decisions over `spec.runPolicy` and what happened so far, mirroring what the
operator does on Kubernetes: a failed, lost or hung group is restarted as a whole
after an exponentially growing delay, until `maxRestarts` is spent; a permanent
exit code, or the same crash repeating with no training progress in between,
fails the job at once. A worker out of memory (OOMKilled, CUDAOutOfMemory) restarts
the group at once with half the micro-batch and twice the accumulation
(`after_out_of_memory`, spec.runPolicy.outOfMemory), outside maxRestarts, as the
operator does. `kubetrain.local.runner` acts on these decisions; nothing here
touches a process or a clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kubetrain.api.trainingjob import RunPolicy, TrainingJobSpec

# Exit statuses that mean "killed by a signal" (a lost node, an OOM kill): Popen
# reports them negative, shells and containers as 128 + the signal number.
SIGNAL_EXIT_BASE = 128


@dataclass(frozen=True)
class GroupFailure:
    """Why one attempt of the worker group ended without finishing the job."""

    reason: str
    """What the user reads: "worker 1 was lost (killed by signal 9)", "no progress for 30s"."""
    exit_code: int | None
    """Exit status of the first worker that failed; None for a hang."""
    progressed: bool
    """Whether the training step advanced during the attempt."""
    failure_class: str = "Unknown"
    """The class the operator would give the pod (kubetrain.operator.failures)."""


@dataclass(frozen=True)
class Decision:
    """What to do after a group failure: restart after `delay` seconds, or fail with `reason`."""

    restart: bool
    delay: float
    reason: str
    micro_batch_size: int | None = None
    """An out-of-memory restart's smaller micro-batch."""


def restart_delay(policy: RunPolicy, restarts_done: int) -> float:
    """Seconds to wait before the next restart: backoffSeconds doubled per restart already done."""
    return float(min(policy.backoff_seconds * 2**restarts_done, policy.max_backoff_seconds))


def is_signal_exit(exit_code: int) -> bool:
    """Whether an exit status says the process was killed by a signal rather than exiting."""
    return exit_code < 0 or exit_code > SIGNAL_EXIT_BASE


def after_failure(policy: RunPolicy, failures: Sequence[GroupFailure]) -> Decision:
    """Decide what follows the last of `failures` (every failure of this run, oldest first)."""
    if not failures:
        raise ValueError("after_failure needs at least one failure")
    last = failures[-1]
    if last.exit_code is not None and last.exit_code in policy.permanent_exit_codes:
        return Decision(False, 0.0, f"{last.reason}; exit code {last.exit_code} is permanent "
                        "(spec.runPolicy.permanentExitCodes), so the job is not retried")
    limit = policy.repeated_failure_limit
    recent = failures[-limit:]
    if (
        len(recent) == limit
        and last.exit_code is not None
        and not is_signal_exit(last.exit_code)
        and all(f.exit_code == last.exit_code and not f.progressed for f in recent)
    ):
        return Decision(False, 0.0, f"{last.reason}; the same exit code {last.exit_code} ended "
                        f"{limit} attempts in a row with no training progress "
                        "(spec.runPolicy.repeatedFailureLimit)")
    restarts_done = len(failures) - 1
    if restarts_done >= policy.max_restarts:
        return Decision(False, 0.0, f"{last.reason}; all {policy.max_restarts} restarts "
                        "allowed by spec.runPolicy.maxRestarts are spent")
    return Decision(True, restart_delay(policy, restarts_done), last.reason)


def after_out_of_memory(spec: TrainingJobSpec, failure: GroupFailure, micro_batch_size: int,
                        out_of_memory_restarts: int, world_size: int) -> Decision:
    """Restart with half the micro-batch (runPolicy.outOfMemory: Halve), or fail.

    The operator's rule, `TrainingJobSpec.after_out_of_memory`: the largest divisor of the
    spec's micro-batch at most half the current one and at least minMicroBatch, at most
    log2(microBatchSize) times; no backoff (the cause is fixed, not waited out).
    """
    what = f"{failure.reason}: out of memory ({failure.failure_class}) at micro-batch " \
           f"{micro_batch_size}"
    smaller, why = spec.after_out_of_memory(micro_batch_size, out_of_memory_restarts)
    if smaller is not None:
        accumulation = spec.gradient_accumulation(world_size, smaller)
        return Decision(True, 0.0, f"{what}: micro-batch {smaller}, gradient accumulation "
                        f"{accumulation} (global batch unchanged)", micro_batch_size=smaller)
    return Decision(False, 0.0, f"{what}, and {why}: run `kubetrain estimate` on the job for "
                    "a configuration that fits (parallelism.activationCheckpointing, more "
                    "workers with strategy fsdp, or more memory)")


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
