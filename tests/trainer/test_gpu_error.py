"""A GPU that failed is told apart from code bugs and out of memory: class GPUError.

The messages are the texts PyTorch, the CUDA runtime and NCCL print (as reported in
PyTorch's and NCCL's issue trackers); without a GPU here, the classifier is what can be
shown. A GPUError ends the pod (loop.ENDS_THE_POD) and counts toward avoiding its node."""

from __future__ import annotations

import pytest
import torch

from kubetrain.trainer.failure_classes import is_collective_timeout, is_gpu_error, is_out_of_memory

ASYNC = ("\nCUDA kernel errors might be asynchronously reported at some other API call, so "
         "the stacktrace below might be incorrect.\nFor debugging consider passing "
         "CUDA_LAUNCH_BLOCKING=1\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side "
         "assertions.\n")

GPU_FAILED = [
    "CUDA error: uncorrectable ECC error encountered" + ASYNC,
    "CUDA error: unspecified launch failure" + ASYNC,
    "CUDA error: unknown error" + ASYNC,
    "CUDA error: uncorrectable NVLink error was detected during the execution" + ASYNC,
    "CUDA error: CUDA-capable device(s) is/are busy or unavailable" + ASYNC,
    "NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, unhandled cuda "
    "error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\nncclUnhandledCudaError: "
    "Call to CUDA function failed.\nLast error:\nCuda failure 'uncorrectable ECC error "
    "encountered'",
]
NOT_THE_GPU = [
    "CUDA error: an illegal memory access was encountered" + ASYNC,  # a kernel's bug
    "CUDA error: device-side assert triggered" + ASYNC,  # an index out of range
    "CUDA error: no kernel image is available for execution on the device" + ASYNC,
    "CUDA error: invalid device ordinal" + ASYNC,
    "mat1 and mat2 shapes cannot be multiplied (8x64 and 128x64)",
]


@pytest.mark.parametrize("message", GPU_FAILED)
def test_a_failed_gpu_is_a_gpu_error_and_not_out_of_memory_or_a_timeout(message: str) -> None:
    error = RuntimeError(message)
    assert is_gpu_error(error)
    assert not is_out_of_memory(error) and not is_collective_timeout(error)


@pytest.mark.parametrize("message", NOT_THE_GPU)
def test_code_bugs_and_setup_errors_are_not_gpu_errors(message: str) -> None:
    assert not is_gpu_error(RuntimeError(message))


def test_out_of_memory_is_not_a_gpu_error() -> None:
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has "
                                   "a total capacity of 79.11 GiB of which 1.06 GiB is free.")
    assert is_out_of_memory(error) and not is_gpu_error(error)
