"""Which of the trainer's failure classes an exception is, and how `fit` ends on it.

`FAILURES` is one table from an error to its class (written into the termination message
for the operator and `kubetrain run`), `fit`'s reason and the exit code
(`kubetrain.protocol`): a failed preflight, the device out of memory however it was raised,
the GPU itself failing, spec.faultTolerance's quorum lost, a collective (or its store)
timing out; first match first. Any
other error propagates. A rank whose collective failed because a peer vanished
(`is_peer_lost`) is that peer's consequence. Out of memory on CUDA comes with `kubetrain
estimate`'s advice (`out_of_memory_advice`). The loop (loop.py) asks; nothing here acts.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from kubetrain.api.trainingjob import TrainingJobSpec
from kubetrain.protocol import (
    EXIT_COLLECTIVE_TIMEOUT,
    EXIT_GPU_ERROR,
    EXIT_OUT_OF_MEMORY,
    EXIT_PREFLIGHT_FAILED,
    EXIT_QUORUM_LOST,
    TrainerFailureClass,
)
from kubetrain.trainer.distributed import World
from kubetrain.trainer.fault_tolerance import QuorumLost
from kubetrain.trainer.preflight import PreflightFailed

# `fit`'s reasons when one of `FAILURES` ended the attempt.
FailureReason = Literal["preflight_failed", "out_of_memory", "gpu_error", "collective_timeout",
                        "quorum_lost"]


# How a device allocation failure reads when it does not arrive as torch.OutOfMemoryError:
# Triton's kernels (Liger's fused loss) raise "Triton Error [CUDA]: out of memory", and
# cuBLAS's workspace allocation fails as CUBLAS_STATUS_ALLOC_FAILED; both plain
# RuntimeErrors.
OUT_OF_MEMORY_WORDS = ("out of memory", "cublas_status_alloc_failed")


def is_out_of_memory(error: BaseException) -> bool:
    """Whether an error is the device running out of memory, however it was raised."""
    return isinstance(error, torch.OutOfMemoryError) or any(
        words in str(error).lower() for words in OUT_OF_MEMORY_WORDS)


# How the GPU itself failing reads: the CUDA runtime's and driver's messages, and NCCL's
# wrapping of them ("unhandled cuda error"). Not in the list, because a restart meets them
# again in the same code: "an illegal memory access was encountered", "device-side assert
# triggered", "an illegal instruction was encountered" (kernel bugs, not hardware). The
# driver's Xid events go to the kernel log, which node tools (DCGM, NVSentinel) read; the
# trainer sees only the CUDA error that follows them.
GPU_ERROR_PATTERN = re.compile(
    r"uncorrectable ecc error|unspecified launch failure|gpu has fallen off the bus"
    r"|uncorrectable nvlink error|unhandled cuda error|hardware stack error"
    r"|cuda-capable device\(s\) is/are busy or unavailable|cuda error: unknown error")


def is_gpu_error(error: BaseException) -> bool:
    """Whether an error says the GPU itself (or its driver, or NVLink) failed."""
    return GPU_ERROR_PATTERN.search(str(error).lower()) is not None


# How a collective reads when a peer's process or connection vanished under it (gloo's
# socket errors, NCCL's "remote process exited"): the rank failed because another did.
PEER_LOST_WORDS = ("connection closed by peer", "connection reset by peer", "broken pipe",
                   "remote process exited", "socket closed")


def is_peer_lost(error: BaseException) -> bool:
    """Whether an error says a peer of the group vanished under a collective."""
    text = str(error).lower()
    return any(words in text for words in PEER_LOST_WORDS)


def is_collective_timeout(error: BaseException) -> bool:
    """Whether a RuntimeError is a gloo or NCCL collective (or its store) timing out."""
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


@dataclass(frozen=True)
class Failure:
    """A failure that ends the attempt: what it is, and how `fit` reports it."""

    matches: Callable[[BaseException], bool]
    failure_class: TrainerFailureClass  # in the termination message, for the operator
    reason: FailureReason  # `fit`'s reason (`loop.FitReason`)
    exit_code: int


# How `fit` ends on a failure, first match first. A failed preflight comes from joining the
# group, the others from building the run or training; any other error propagates.
FAILURES = (
    Failure(lambda error: isinstance(error, PreflightFailed), "PreflightFailed",
            "preflight_failed", EXIT_PREFLIGHT_FAILED),
    Failure(is_out_of_memory, "CUDAOutOfMemory", "out_of_memory", EXIT_OUT_OF_MEMORY),
    Failure(is_gpu_error, "GPUError", "gpu_error", EXIT_GPU_ERROR),
    # Before the timeouts: a quorum that never formed reads as one too.
    Failure(lambda error: isinstance(error, QuorumLost), "QuorumLost", "quorum_lost",
            EXIT_QUORUM_LOST),
    Failure(is_collective_timeout, "CollectiveTimeout", "collective_timeout",
            EXIT_COLLECTIVE_TIMEOUT),
)


def failure_of(error: BaseException) -> Failure | None:
    """The first of `FAILURES` that `error` matches, or None (an error that propagates)."""
    return next((failure for failure in FAILURES if failure.matches(error)), None)


def out_of_memory_advice(spec: TrainingJobSpec, micro_batch_size: int, world: World) -> str:
    """`kubetrain estimate`'s recommendation for this device, as a sentence ('' if none)."""
    if world.device.type != "cuda":
        return ""
    try:
        from kubetrain.trainer.estimate import GIB, recommend

        gpu_bytes = torch.cuda.get_device_properties(world.device).total_memory
        asked = spec.optimization.model_copy(update={
            "micro_batch_size": micro_batch_size,
            # Over data-parallel processes: a tensor-parallel group reads one micro-batch.
            "gradient_accumulation_steps": spec.gradient_accumulation(
                world.world_size // spec.parallelism.tensor_parallel, micro_batch_size),
            "global_batch_tokens": None})
        plan = recommend(spec.model_copy(update={"optimization": asked}), world.world_size,
                         gpu_bytes)
    except Exception as error:  # the advice must never hide the failure itself
        return f" (kubetrain estimate gave no advice: {error})"
    if plan is None:
        return (f"; kubetrain estimate: nothing fits {gpu_bytes / GIB:.0f} GiB with "
                f"{world.world_size} processes: use more processes with strategy fsdp, or a "
                "smaller model")
    return (f"; kubetrain estimate recommends for {gpu_bytes / GIB:.0f} GiB: "
            f"optimization.microBatchSize {plan.micro_batch_size}, "
            f"gradientAccumulationSteps {plan.gradient_accumulation}, "
            f"parallelism.activationCheckpointing {plan.activation_checkpointing}")
