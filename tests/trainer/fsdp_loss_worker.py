"""A torchrun worker for the loss test: the chunked loss against the full one under FSDP2.

    fsdp_loss_worker.py OUT PRECISION[,PRECISION...]

For each precision in turn, in one launch (its start-up costs more than the model's steps),
every rank builds the same small Transformer (vocabulary 1000, untied output) and
shards it with `parallelize` (FSDP2 over all ranks, as the trainer does; with one
rank, on a GPU machine with NCCL, `fully_shard` with the same policy directly,
since `parallelize` leaves a group of one unwrapped), then, on its own batch, runs
forward and backward with the full logits, with the chunked loss (chunks of 37
tokens, so several, the last one short) and, on CUDA with liger-kernel, with
Liger's. Rank 0 writes, per precision and implementation, the losses (summed over ranks)
and the full, unsharded gradients to OUT.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from kubetrain.api.trainingjob import ModelDims, ParallelismSpec
from kubetrain.trainer.distributed import World, init_world
from kubetrain.trainer.loss import (
    OutputLoss,
    OutputLossFn,
    chunked_cross_entropy,
    full_cross_entropy,
    liger_cross_entropy,
    select_output_loss,
)
from kubetrain.trainer.model import Transformer
from kubetrain.trainer.parallelize import COMPUTE_DTYPES, ParallelModel, parallelize

DIMS = ModelDims(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=1000, ffn_dim=128,
                 tie_embeddings=False, rope_theta=10000.0)


def main(out: str, precisions: str) -> None:
    torch.set_num_threads(1)
    world = init_world()
    found = {precision: one_precision(world, precision) for precision in precisions.split(",")}
    if world.rank == 0:
        torch.save(found, out)
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()


def one_precision(world: World, precision: str) -> dict[str, dict[str, Any]]:
    torch.manual_seed(0)
    model = Transformer(DIMS, max_seq_len=48)
    spec = ParallelismSpec(strategy="fsdp", precision=precision)
    if world.world_size > 1:
        parallel = parallelize(model, spec, world.mesh, world.device)
    else:
        parallel = _shard_alone(model, spec, world.mesh, world.device)
    generator = torch.Generator().manual_seed(1 + world.rank)
    tokens = torch.randint(0, DIMS.vocab_size, (3, 49), generator=generator).to(world.device)
    results: dict[str, dict[str, Any]] = {}
    implementations: dict[str, OutputLossFn] = {
        "full": full_cross_entropy,
        "chunked": functools.partial(chunked_cross_entropy, chunk=37),
    }
    if world.device.type == "cuda" and select_output_loss(world.device)[0].name == "liger":
        implementations["liger"] = liger_cross_entropy
    for name, fn in implementations.items():
        model.output_loss = OutputLoss(name, fn)
        with parallel.autocast():
            loss = parallel.module(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        grads = {}
        for key, parameter in parallel.module.named_parameters():
            grad = parameter.grad
            assert grad is not None, key
            grads[key] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).cpu()
        parallel.module.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        results[name] = {"loss": total.cpu(), "grads": grads}
    return results


def _shard_alone(model: Transformer, spec: ParallelismSpec, mesh: DeviceMesh,
                 device: torch.device) -> ParallelModel:
    """FSDP2 over a group of one: what parallelize does for several ranks, for the GPU run."""
    model.to(device)
    policy = MixedPrecisionPolicy(param_dtype=COMPUTE_DTYPES[spec.precision],
                                  reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return ParallelModel(module=model, autocast=contextlib.nullcontext, scaler=None,
                         _skip_sync=contextlib.nullcontext)


if __name__ == "__main__":
    # Launched by tests/forked_torchrun.py: this rank is a fork, which ends without the
    # interpreter's teardown once main returns (torch's C++ teardown, which under load now
    # and then aborted with "terminate called without an active exception" after the work
    # was done).
    main(*sys.argv[1:])
