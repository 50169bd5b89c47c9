"""A torchrun worker for the mesh tests: one forward/backward of a small model over a job's mesh.

    mesh_worker.py STRATEGY TENSOR_PARALLEL TIED OUT

Four ranks play two pods of two processes (workers.replicas 2, procsPerWorker 2). Every
rank builds the same small Transformer (fp32), `build_mesh` lays out the job's mesh and
`parallelize` applies it, as the trainer does; each data-parallel rank then takes its own
slice of one fixed batch (the ranks of a tensor-parallel group the same slice), runs
forward and backward with its mean token loss (data parallelism averages the gradients,
as in the trainer), and rank 0 writes the mean loss over data-parallel ranks, the full
gradients, the batch, the mesh's shape and every rank's data-parallel rank to OUT.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from kubetrain.api.trainingjob import ModelDims, TrainingJobSpec
from kubetrain.trainer.distributed import init_world
from kubetrain.trainer.mesh import build_mesh
from kubetrain.trainer.model import Transformer
from kubetrain.trainer.parallelize import parallelize

SEQ, SEQUENCES = 16, 8


def dims(tied: bool) -> ModelDims:
    return ModelDims(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, ffn_dim=64,
                     tie_embeddings=tied, rope_theta=10000.0)


def batch() -> torch.Tensor:
    return torch.randint(0, 96, (SEQUENCES, SEQ + 1), generator=torch.Generator().manual_seed(7))


def main(strategy: str, tensor_parallel: str, tied: str, out: str) -> None:
    torch.set_num_threads(1)
    world = init_world()
    spec = TrainingJobSpec.model_validate({
        "image": "kubetrain/trainer:test", "model": {"preset": "custom", "dim": 32,
                                                     "nHeads": 4, "nLayers": 2},
        "data": {"train": "s3://data/train", "seqLen": SEQ},
        "workers": {"replicas": 2, "procsPerWorker": 2},
        "parallelism": {"strategy": strategy, "tensorParallel": int(tensor_parallel),
                        "precision": "fp32"},
        "checkpoint": {"uri": "s3://data/checkpoints"},
    })
    model_dims = dims(tied == "tied")
    mesh = build_mesh(spec, model_dims, world)
    torch.manual_seed(0)
    model = Transformer(model_dims, max_seq_len=SEQ)
    parallel = parallelize(model, spec.parallelism, mesh, world.device)
    tokens = batch()
    mine = tokens.chunk(mesh.dp_size)[mesh.dp_rank]
    loss = parallel.module(mine[:, :-1], mine[:, 1:]) / mine[:, 1:].numel()
    loss.backward()
    grads = {}
    for name, parameter in parallel.module.named_parameters():
        assert parameter.grad is not None, name
        grad = parameter.grad
        grads[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).cpu()
    total = loss.detach().clone()
    dist.all_reduce(total)  # every process of a tensor-parallel group holds the same loss
    ranks = [None] * world.world_size
    dist.all_gather_object(ranks, mesh.dp_rank)
    if world.rank == 0:
        torch.save({"loss": total / world.world_size, "grads": grads,
                    "tokens": tokens, "shape": mesh.shape.describe(), "dp_ranks": ranks,
                    "dp_size": parallel.dp_size}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as fsdp_loss_worker.py: skip torch's exit-time teardown
