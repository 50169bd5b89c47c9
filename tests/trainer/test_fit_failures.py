"""How `fit` ends on a failure: `failure_classes.FAILURES`, one table from the error to its failure
class, `FitResult.reason` and exit code, in agreement with kubetrain.protocol.

The errors are the texts PyTorch, Triton, gloo and NCCL raise (see test_gpu_error.py and
test_collective_timeout.py for where they come from); the whole path through `fit` runs in
test_out_of_memory.py, test_ending_the_pod.py and test_preflight.py.
"""

from __future__ import annotations

from typing import get_args

import pytest
import torch

from kubetrain.protocol import (
    EXIT_COLLECTIVE_TIMEOUT,
    EXIT_GPU_ERROR,
    EXIT_OUT_OF_MEMORY,
    EXIT_PREFLIGHT_FAILED,
    TRAINER_CLASSES,
    TRAINER_EXIT_CODES,
)
from kubetrain.trainer.failure_classes import FAILURES, failure_of
from kubetrain.trainer.loop import FitReason
from kubetrain.trainer.preflight import PreflightFailed

OUT_OF_MEMORY = ("CUDAOutOfMemory", "out_of_memory", EXIT_OUT_OF_MEMORY)
GPU_ERROR = ("GPUError", "gpu_error", EXIT_GPU_ERROR)
TIMEOUT = ("CollectiveTimeout", "collective_timeout", EXIT_COLLECTIVE_TIMEOUT)
PREFLIGHT = ("PreflightFailed", "preflight_failed", EXIT_PREFLIGHT_FAILED)

CASES: list[tuple[BaseException, tuple[str, str, int] | None]] = [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
                            "total capacity of 79.11 GiB of which 1.06 GiB is free."),
     OUT_OF_MEMORY),
    (RuntimeError("Triton Error [CUDA]: out of memory"), OUT_OF_MEMORY),
    (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
     OUT_OF_MEMORY),
    # First match first: NCCL wraps a failed allocation as an unhandled CUDA error, which
    # alone would be a GPU error; the micro-batch, not the GPU, is what a restart changes.
    (RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error (run with "
                  "NCCL_DEBUG=INFO for details)\nLast error:\nCuda failure 'out of memory'"),
     OUT_OF_MEMORY),
    (RuntimeError("CUDA error: uncorrectable ECC error encountered"), GPU_ERROR),
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
                  "waiting 2000ms for recv operation to complete"), TIMEOUT),
    (RuntimeError("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, "
                  "OpType=ALLREDUCE) ran for 600000 milliseconds before timing out."), TIMEOUT),
    (PreflightFailed("preflight failed: rank 1 (pod job-worker-1, node node-b) did not "
                     "report within 6s", nodes=["node-b"]), PREFLIGHT),
    # Anything else propagates: a bug, or a failure a restart may cure.
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied (8x64 and 128x64)"), None),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), None),
    (ValueError("spec.data.seqLen (64) is longer than the model's maxSeqLen"), None),
]


@pytest.mark.parametrize(("error", "ends"), CASES,
                         ids=[f"{type(error).__name__}-{index}"
                              for index, (error, _) in enumerate(CASES)])
def test_each_failure_ends_fit_with_its_class_reason_and_exit_code(
        error: BaseException, ends: tuple[str, str, int] | None) -> None:
    failure = failure_of(error)
    found = None if failure is None else (failure.failure_class, failure.reason,
                                          failure.exit_code)
    assert found == ends


def test_the_table_covers_the_protocols_trainer_classes_with_their_exit_codes() -> None:
    assert {failure.failure_class for failure in FAILURES} == TRAINER_CLASSES
    for failure in FAILURES:
        assert failure.exit_code == TRAINER_EXIT_CODES[failure.failure_class], failure
    # The reasons fit returns: the loop's own endings, and one per failure.
    assert {"max_steps", "early_stopping", "signalled"} | {
        failure.reason for failure in FAILURES} == set(get_args(FitReason))
