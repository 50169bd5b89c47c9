"""The protocol between the trainer and what runs it: exit codes and failure classes, once.

A trainer process (`python -m kubetrain.trainer`) ends with one of these exit codes
and, when it failed in a way only it can see, writes one of the trainer's failure
classes into its termination message (`kubetrain.trainer.metrics.record_failure`).
The operator (a pod's container status) and `kubetrain run` (a process's exit status)
read both, and give every failed worker one of `FAILURE_CLASSES`: the names a user
reads in status.lastFailure.class, the events and `kubetrain_worker_failures_total`.

Torch-free and free of kubetrain imports, so the trainer, the API models, the
operator and the local runner all take their names from here. What to do about a
failure (retry, halve the micro-batch, give up) is not protocol: that is
`kubetrain.restart_rules`.
"""

from __future__ import annotations

from typing import Final, Literal, get_args

# torchrun's rendezvous backend in every launch kubetrain makes (a worker pod's
# PET_RDZV_BACKEND, `kubetrain run`'s --rdzv-backend): c10d, polled every 0.1 s
# (kubetrain.trainer.rendezvous).
RENDEZVOUS_BACKEND: Final = "kubetrain"

# Set by kubetrain.trainer.launch for the training processes it starts: the pid of their
# torchrun agent, which is not their parent (a fork server is). A trainer that must end its
# pod signals it (kubetrain.trainer.distributed.stop_torchrun_agent).
AGENT_PID_ENV: Final = "KUBETRAIN_AGENT_PID"

# Each training process names itself PREFIX + its rank (/proc/PID/comm, what ps and top
# show): under the launcher they all have the fork server's command line.
RANK_PROCESS_PREFIX: Final = "kt-rank-"

# --- exit codes of a trainer process ----------------------------------------------------

EXIT_COMPLETE: Final = 0  # training finished (maxSteps or early stopping), exported
EXIT_INVALID_MANIFEST: Final = 2  # the job cannot run as written: permanent by default
EXIT_RESTART: Final = 75  # EX_TEMPFAIL: another rank was signalled; rejoin the new membership
EXIT_OUT_OF_MEMORY: Final = 87  # the device ran out of memory at this micro-batch
EXIT_COLLECTIVE_TIMEOUT: Final = 88  # a collective timed out (a peer hung or vanished)
EXIT_PREFLIGHT_FAILED: Final = 89  # the preflight check failed (kubetrain.trainer.preflight)
EXIT_GPU_ERROR: Final = 90  # the GPU itself failed (kubetrain.trainer.loop.is_gpu_error)
# 128 + N is "killed by signal N" as shells and container runtimes report it (Python's
# Popen reports -N); 128 itself is no signal.
SIGNAL_EXIT_BASE: Final = 128
EXIT_SIGNALLED: Final = 143  # 128 + SIGTERM: stopped after saving a checkpoint
EXIT_OOM_KILLED: Final = 137  # 128 + SIGKILL, what the kernel's OOM killer leaves
# Exit codes that mean the configuration or code is wrong (runPolicy.permanentExitCodes'
# default): the trainer's invalid manifest, and a shell's "cannot execute" and "not found".
DEFAULT_PERMANENT_EXIT_CODES: Final = (EXIT_INVALID_MANIFEST, 126, 127)


def is_signal_exit(exit_code: int) -> bool:
    """Whether an exit status says the process was killed by a signal rather than exiting."""
    return exit_code < 0 or exit_code > SIGNAL_EXIT_BASE


# --- failure classes --------------------------------------------------------------------

# Every class a failed worker can get, in the order kubetrain.operator.failures decides it.
FailureClass = Literal["OOMKilled", "CUDAOutOfMemory", "Evicted", "Preempted", "NodeLost",
                       "CollectiveTimeout", "GPUError", "PreflightFailed", "UserError",
                       "Unknown"]
FAILURE_CLASSES: Final[tuple[str, ...]] = get_args(FailureClass)
# The classes only the trainer can see, written into its termination message: under
# torchrun the worker's exit code is torchrun's, whatever the trainer died of.
TrainerFailureClass = Literal["CUDAOutOfMemory", "CollectiveTimeout", "GPUError",
                              "PreflightFailed"]
TRAINER_CLASSES: Final = frozenset(get_args(TrainerFailureClass))
# The trainer's own exit code for each: what a trainer run without torchrun exits with.
TRAINER_EXIT_CODES: Final[dict[str, int]] = {
    "CUDAOutOfMemory": EXIT_OUT_OF_MEMORY,
    "CollectiveTimeout": EXIT_COLLECTIVE_TIMEOUT,
    "PreflightFailed": EXIT_PREFLIGHT_FAILED,
    "GPUError": EXIT_GPU_ERROR,
}
# Out of memory, in the container (the kernel's OOM killer) or on the device.
OUT_OF_MEMORY_CLASSES: Final = frozenset({"OOMKilled", "CUDAOutOfMemory"})
# Trainer failures a restart in place cannot cure (the same micro-batch, the same GPU, the
# same stalled peer): the worker asks its torchrun agent to stop, and the pod ends.
ENDS_THE_POD: Final = frozenset({"CUDAOutOfMemory", "GPUError", "PreflightFailed"})


# --- the lifeline: each pod's trainer beats, and says why it ends ------------------------

# Each trainer process of a worker pod listens on the metrics port + 1 + its local rank
# (`lifeline_port`). To whoever connects (the operator) it writes `beat` every
# LIFELINE_BEAT_SECONDS and, when it ends in order, one last line `end <exit code> <class>
# <words>`, then closes. A connection closed without an `end` line means the process died
# (kill -9, a crash, the kernel's OOM killer); one that stays open without a beat means the
# process or its node stopped (kubetrain.trainer.lifeline, kubetrain.operator.lifelines).
LIFELINE_BEAT_SECONDS: Final = 0.5
# The `end` class of a rank that failed only because a peer vanished under a collective: a
# consequence of another rank's failure, which the operator does not count again.
PEER_LOST: Final = "PeerLost"


def lifeline_port(metrics_port: int, local_rank: int = 0) -> int:
    """The port of the lifeline of a worker pod's trainer process of `local_rank`: the ones
    after spec.metrics.port."""
    return metrics_port + 1 + local_rank


def end_line(exit_code: int, failure_class: str, words: str = "") -> bytes:
    """A lifeline's last line: how the trainer process ends."""
    text = " ".join(words.split())  # one line
    return f"end {exit_code} {failure_class} {text}".rstrip().encode() + b"\n"


def parse_end_line(line: bytes) -> tuple[int, str, str] | None:
    """(exit code, class, words) of an `end` line; None for any other line."""
    parts = line.decode(errors="replace").strip().split(" ", 3)
    if len(parts) < 3 or parts[0] != "end":
        return None
    try:
        code = int(parts[1])
    except ValueError:
        return None
    return code, parts[2], parts[3] if len(parts) > 3 else ""
