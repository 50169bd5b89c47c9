"""The device mesh of a job, chosen from its spec and the pod shape: the one place meshes are built.

A job's processes form a grid. Ranks are numbered pod by pod (torchrun gives each pod a
contiguous range of `procsPerWorker` ranks), and the mesh is laid out row-major with the
tensor-parallel dimension innermost, so tensor parallelism and HSDP's shard group stay
inside a pod (NVLink) and only what must cross pods does:

    strategy  tensorParallel  mesh (outermost first)                         FSDP spans
    fsdp      1               dp_shard = world                                all ranks
    fsdp      N               dp_shard = world / N, tp = N                    dp_shard
    hsdp      1               dp_replicate = pods, dp_shard = procsPerWorker  both (HSDP)
    hsdp      N               dp_replicate = pods, dp_shard = procs / N, tp   both (HSDP)
    ddp       1               dp = world (replicated)                         -

fsdp and ddp without tensor parallelism keep the 1-D mesh `distributed.init_world` built,
exactly as before. Under hsdp, `workers.replicas` is the replicate dimension only: a
rescale changes how many copies there are, never how a copy is sharded. One pod under
hsdp is fsdp (a replicate dimension of one is dropped).

The data-parallel rank and size (`dp_rank`, `dp_size`) are the coordinates on the
dp_replicate x dp_shard plane: the ranks of one tensor-parallel group read the same
batches, so the data, the gradient accumulation and the tokens per step count data-
parallel ranks, not processes.

`strategy: auto` picks the mesh from the pod shape and `kubetrain estimate`'s figures
(`auto_shape`): the first of hsdp (when there are several pods), fsdp, and then fsdp
with tensor parallelism 2, 4, ... up to procsPerWorker (only when the model allows
it and tensorParallel is left at 1) whose estimate at the job's micro-batch and
checkpointing fits the GPU's memory; on CPU, where nothing bounds it, the first. When
none fits, the most sharded candidate, and the out-of-memory rule takes over from there.
Rank 0 decides and every rank takes its answer, so a group never builds two meshes.

The shape rule (`MeshShape`, `mesh_shape` in `kubetrain.trainer.mesh_shape`, and
`auto_shape` beside the estimate it asks, in `kubetrain.trainer.estimate`) is torch-free, for
`kubetrain estimate`; `build_mesh` needs torch. This module builds meshes and nothing else:
parallelize.py applies them to the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kubetrain.api.trainingjob import ModelDims, ParallelismSpec, TrainingJobSpec
from kubetrain.trainer.estimate import auto_shape
from kubetrain.trainer.mesh_shape import MeshError, MeshShape, Strategy, mesh_shape

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from kubetrain.trainer.distributed import World

def resolve_shape(spec: TrainingJobSpec, dims: ModelDims, world_size: int,
                  gpu_bytes: int | None) -> tuple[MeshShape, str]:
    """The job's mesh shape and why: auto's choice, or what the spec names (checked)."""
    if spec.parallelism.strategy == "auto":
        return auto_shape(spec, dims, world_size, gpu_bytes)
    shape = mesh_shape(spec.parallelism, spec.workers.procs_per_worker, world_size)
    return shape, f"parallelism.strategy: {spec.parallelism.strategy}"


def preflight_dimensions(spec: TrainingJobSpec, world_size: int) -> dict[str, int]:
    """The dimensions (name: size, outermost first) whose collectives the preflight checks
    before the mesh exists: the spec's mesh at `world_size` processes; under strategy auto,
    hsdp's (pods x the processes of a pod, the two kinds of link any mesh auto picks
    uses). {} for a 1-D mesh, or one the spec cannot lay out (build_mesh then says why)."""
    procs = spec.workers.procs_per_worker
    try:
        if spec.parallelism.strategy == "auto":
            return mesh_shape(spec.parallelism.model_copy(update={"tensor_parallel": 1}),
                              procs, world_size, "hsdp").dimensions
        return mesh_shape(spec.parallelism, procs, world_size).dimensions
    except MeshError:
        return {}


@dataclass(frozen=True)
class TrainingMesh:
    """The job's device mesh and its parts: what parallelize applies, what the data reads."""

    shape: MeshShape
    why: str  # how the shape was chosen, for the log
    device_mesh: DeviceMesh  # the whole mesh
    data_parallel: DeviceMesh  # what FSDP2 (2-D: HSDP) or DDP spans
    tensor_parallel: DeviceMesh | None  # None without tensor parallelism
    dp_rank: int

    @property
    def strategy(self) -> Strategy:
        return self.shape.strategy

    @property
    def dp_size(self) -> int:
        return self.shape.dp_size

    def parallelism(self, spec: ParallelismSpec) -> ParallelismSpec:
        """`spec` with the strategy this mesh runs (auto's choice in place of auto)."""
        return spec.model_copy(update={"strategy": self.strategy,
                                       "tensor_parallel": self.shape.tensor_parallel})


def build_mesh(spec: TrainingJobSpec, dims: ModelDims, world: World) -> TrainingMesh:
    """The job's mesh over `world`'s group (collective under strategy auto: rank 0 decides).

    Raises MeshError, naming the field, when the spec cannot be laid out on this group.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if spec.parallelism.strategy == "auto":
        gpu_bytes = (torch.cuda.get_device_properties(world.device).total_memory
                     if world.device.type == "cuda" else None)
        decided: list[tuple[MeshShape, str] | None] = [None]
        if world.rank == 0:
            decided[0] = auto_shape(spec, dims, world.world_size, gpu_bytes)
        if world.world_size > 1:
            dist.broadcast_object_list(decided, src=0)
        assert decided[0] is not None
        shape, reason = decided[0]
        why = f"parallelism.strategy: auto chose it, {reason}"
    else:
        shape, why = resolve_shape(spec, dims, world.world_size, None)
    if shape.one_dimensional:
        return TrainingMesh(shape, why, world.mesh, world.mesh, None, world.rank)
    sizes = shape.dimensions
    mesh = init_device_mesh(world.device.type, tuple(sizes.values()),
                            mesh_dim_names=tuple(sizes))
    data_names = tuple(name for name in sizes if name.startswith("dp_"))
    data_parallel = mesh[data_names] if len(data_names) > 1 else mesh[data_names[0]]
    tensor_parallel = mesh["tp"] if "tp" in sizes else None
    # Row-major with tp innermost: the data-parallel rank is the rank's tp-group index.
    return TrainingMesh(shape, why, mesh, data_parallel, tensor_parallel,
                        world.rank // shape.tensor_parallel)
