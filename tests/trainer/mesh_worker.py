"""A torchrun worker for the mesh tests: one forward/backward of small models over a job's mesh.

    mesh_worker.py STRATEGY TENSOR_PARALLEL TIED OUT [FAMILY,...]

Four ranks play two pods of two processes (workers.replicas 2, procsPerWorker 2). For each
model family named (llama alone by default; gemma3, the family that differs most, rides in
the same launch), every rank builds the same small Transformer (fp32), `build_mesh` lays
out the job's mesh and `parallelize` applies it, as the trainer does; each data-parallel
rank then takes its own slice of one fixed batch (the ranks of a tensor-parallel group the
same slice), runs forward and backward with its mean token loss (data parallelism
averages the gradients, as in the trainer), and rank 0 writes, per family, the mean loss
over data-parallel ranks and the full gradients, and the batch, the mesh's shape and
every rank's data-parallel rank to OUT.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from kubetrain.api.presets import RopeScaling
from kubetrain.api.trainingjob import ModelDims, TrainingJobSpec
from kubetrain.trainer.distributed import init_world
from kubetrain.trainer.mesh import build_mesh
from kubetrain.trainer.model import Transformer
from kubetrain.trainer.parallelize import parallelize

SEQ, SEQUENCES = 16, 8


def dims(tied: bool, family: str = "llama") -> ModelDims:
    """The model of `family`: Gemma 3's with heads wider than dim / heads, a local layer
    whose window (8) is shorter than the sequence, then a global one with its own stretched
    rotary base, and a scale of the scores of its own."""
    if family == "gemma3":
        return ModelDims(family="gemma3", dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                         head_dim=12, vocab_size=96, ffn_dim=64, tie_embeddings=tied,
                         rope_theta=10000.0, sliding_window=8, global_every=2,
                         local_rope_theta=1000.0, query_scale_dim=10,
                         rope_scaling=RopeScaling(kind="linear", factor=2.0))
    return ModelDims(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, ffn_dim=64,
                     tie_embeddings=tied, rope_theta=10000.0)


def batch() -> torch.Tensor:
    return torch.randint(0, 96, (SEQUENCES, SEQ + 1), generator=torch.Generator().manual_seed(7))


def main(strategy: str, tensor_parallel: str, tied: str, out: str,
         families: str = "llama") -> None:
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
    mesh = build_mesh(spec, dims(tied == "tied"), world)
    tokens = batch()
    mine = tokens.chunk(mesh.dp_size)[mesh.dp_rank]
    results = {}
    for family in families.split(","):
        torch.manual_seed(0)
        model = Transformer(dims(tied == "tied", family), max_seq_len=SEQ)
        parallel = parallelize(model, spec.parallelism, mesh, world.device)
        loss = parallel.module(mine[:, :-1], mine[:, 1:]) / mine[:, 1:].numel()
        loss.backward()
        grads = {}
        for name, parameter in parallel.module.named_parameters():
            assert parameter.grad is not None, name
            grad = parameter.grad
            grads[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).cpu()
        total = loss.detach().clone()
        dist.all_reduce(total)  # every process of a tensor-parallel group holds the same loss
        results[family] = {"loss": total / world.world_size, "grads": grads}
    ranks = [None] * world.world_size
    dist.all_gather_object(ranks, mesh.dp_rank)
    if world.rank == 0:
        torch.save({"families": results, "tokens": tokens, "shape": mesh.shape.describe(),
                    "dp_ranks": ranks, "dp_size": parallel.dp_size}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as fsdp_loss_worker.py: skip torch's exit-time teardown
