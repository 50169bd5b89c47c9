"""A torchrun worker for the mesh tests: one forward/backward of small models over job meshes.

    mesh_worker.py OUT STRATEGY:TENSOR_PARALLEL:TIED[,...] [FAMILY,...]

Four ranks play two pods of two processes (workers.replicas 2, procsPerWorker 2). Each mesh
named (`hsdp:1:untied`, ...) is laid out in turn over the same process group, one launch
for all of them: a launch costs several seconds of start-up, a mesh a fraction of one. For
each mesh and each model family named (llama alone by default; gemma3, the family that
differs most, rides in the same launch), every rank builds the same small Transformer
(fp32), `build_mesh` lays out the job's mesh and `parallelize` applies it, as the trainer
does; each data-parallel rank then takes its own slice of one fixed batch (the ranks of a
tensor-parallel group the same slice), runs forward and backward with its mean token loss
(data parallelism averages the gradients, as in the trainer), and rank 0 writes to OUT,
per mesh, its shape, every rank's data-parallel rank and, per family, the mean loss over
data-parallel ranks and the full gradients; and the batch.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from kubetrain.api.presets import RopeScaling
from kubetrain.api.trainingjob import ModelDims, TrainingJobSpec
from kubetrain.trainer.distributed import World, init_world
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


def spec_of(strategy: str, tensor_parallel: int) -> TrainingJobSpec:
    return TrainingJobSpec.model_validate({
        "image": "kubetrain/trainer:test", "model": {"preset": "custom", "dim": 32,
                                                     "nHeads": 4, "nLayers": 2},
        "data": {"train": "s3://data/train", "seqLen": SEQ},
        "workers": {"replicas": 2, "procsPerWorker": 2},
        "parallelism": {"strategy": strategy, "tensorParallel": tensor_parallel,
                        "precision": "fp32"},
        "checkpoint": {"uri": "s3://data/checkpoints"},
    })


def one_mesh(world: World, tokens: torch.Tensor, strategy: str, tensor_parallel: int,
             tied: bool, families: list[str]) -> dict[str, Any]:
    """This rank's part of one mesh's forward and backward; what rank 0 writes of it."""
    spec = spec_of(strategy, tensor_parallel)
    mesh = build_mesh(spec, dims(tied), world)
    mine = tokens.chunk(mesh.dp_size)[mesh.dp_rank]
    results = {}
    for family in families:
        torch.manual_seed(0)
        model = Transformer(dims(tied, family), max_seq_len=SEQ)
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
    return {"families": results, "shape": mesh.shape.describe(), "dp_ranks": ranks,
            "dp_size": parallel.dp_size}


def main(out: str, meshes: str, families: str = "llama") -> None:
    torch.set_num_threads(1)
    world = init_world()
    tokens = batch()
    found = {}
    for mesh in meshes.split(","):
        strategy, tensor_parallel, tied = mesh.split(":")
        found[mesh] = one_mesh(world, tokens, strategy, int(tensor_parallel), tied == "tied",
                               families.split(","))
    if world.rank == 0:
        torch.save({"meshes": found, "tokens": tokens}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    # Launched by tests/forked_torchrun.py: this rank is a fork, which ends without the
    # interpreter's teardown once main returns (torch's C++ teardown, which under load now
    # and then aborted with "terminate called without an active exception" after the work
    # was done).
    main(*sys.argv[1:])
