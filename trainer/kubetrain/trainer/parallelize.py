"""How a plain model becomes a distributed, mixed-precision training model.

`parallelize` is the one place parallelism is applied, in torchtitan's order:
activation checkpointing → torch.compile → FSDP2 (`fully_shard` per block, then
the root) or DDP. It returns a `ParallelModel` that tells the loop the three
things that differ between strategies: how to compute in the job's precision,
how to skip gradient synchronisation on non-final micro-steps, and which
gradient scaler (fp16 only) to use.

Precision: with FSDP2 the `MixedPrecisionPolicy` casts parameters to bf16/fp16
for compute and reduces gradients in fp32, keeping fp32 master weights; with DDP
(and a single process, which is left unwrapped) `torch.autocast` does the same
job. fp32 runs unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn
from torch.amp import GradScaler
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.nn.parallel import DistributedDataParallel

from kubetrain.api.trainingjob import ParallelismSpec
from kubetrain.trainer.model import Transformer

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class ParallelModel:
    """The model as trained, with the precision and synchronisation controls the loop needs."""

    module: nn.Module
    autocast: Callable[[], AbstractContextManager[object]]
    scaler: GradScaler | None
    _skip_sync: Callable[[], AbstractContextManager[object]]

    @contextlib.contextmanager
    def gradient_sync(self, enabled: bool) -> Iterator[None]:
        """Backward passes inside do (or, when not enabled, do not) synchronise gradients."""
        if enabled:
            yield
        else:
            with self._skip_sync():
                yield


def parallelize(
    model: Transformer, spec: ParallelismSpec, mesh: DeviceMesh, device: torch.device
) -> ParallelModel:
    """Apply activation checkpointing, compile and FSDP2/DDP to `model`, placing it on `device`."""
    model.to(device)
    for index, block in enumerate(model.layers):
        # selective: every other block, halving activation memory for ~half the recompute.
        if spec.activation_checkpointing == "full" or (
            spec.activation_checkpointing == "selective" and index % 2 == 0
        ):
            block = checkpoint_wrapper(block, preserve_rng_state=False)
        if spec.compile:
            block.compile()
        model.layers[index] = block

    dtype = COMPUTE_DTYPES[spec.precision]
    world_size = mesh.size()
    if spec.strategy == "fsdp" and world_size > 1:
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        fsdp_model: FSDPModule = model  # type: ignore[assignment]
        return ParallelModel(
            module=model,
            autocast=contextlib.nullcontext,
            # FSDP2 shards gradients, so inf/nan checks must be agreed across ranks.
            scaler=ShardedGradScaler(device.type) if spec.precision == "fp16" else None,
            _skip_sync=lambda: _fsdp_sync_disabled(fsdp_model),
        )

    module: nn.Module = model
    skip_sync: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext
    if world_size > 1:
        ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
        module, skip_sync = ddp, ddp.no_sync
    return ParallelModel(
        module=module,
        autocast=_autocast(device, dtype),
        scaler=GradScaler(device.type) if spec.precision == "fp16" else None,
        _skip_sync=skip_sync,
    )


def _autocast(
    device: torch.device, dtype: torch.dtype
) -> Callable[[], AbstractContextManager[object]]:
    if dtype == torch.float32:
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=dtype)


@contextlib.contextmanager
def _fsdp_sync_disabled(model: FSDPModule) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
