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

The shape rule (`MeshShape`, `mesh_shape`, `auto_shape`) is torch-free, for `kubetrain
estimate`; `build_mesh` needs torch. This module builds meshes and nothing else:
parallelize.py applies them to the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from kubetrain.api.trainingjob import (
    ModelDims,
    ParallelismSpec,
    TrainingJobSpec,
    tensor_parallel_problems,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from kubetrain.trainer.distributed import World

Strategy = Literal["fsdp", "ddp", "hsdp"]
TENSOR_PARALLEL_DEGREES = (2, 4, 8, 16, 32, 64)  # what `auto` tries, within a pod


class MeshError(ValueError):
    """The job's parallelism cannot be laid out on this group; the message names the field."""


@dataclass(frozen=True)
class MeshShape:
    """The sizes of a job's mesh: replicate x shard x tensor-parallel processes."""

    strategy: Strategy
    replicate: int = 1
    shard: int = 1
    tensor_parallel: int = 1

    @property
    def world_size(self) -> int:
        return self.replicate * self.shard * self.tensor_parallel

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: how many different micro-batches one micro-step reads."""
        return self.replicate * self.shard

    @property
    def parameter_shards(self) -> int:
        """How many pieces each parameter (and its gradient and optimizer state) is cut into."""
        sharded = self.strategy in ("fsdp", "hsdp") and self.world_size > 1
        return (self.shard if sharded else 1) * self.tensor_parallel

    @property
    def one_dimensional(self) -> bool:
        """Whether this is the 1-D data-parallel mesh `init_world` builds (fsdp or ddp)."""
        return self.tensor_parallel == 1 and (self.strategy != "hsdp" or self.replicate == 1)

    @property
    def dimensions(self) -> dict[str, int]:
        """The mesh's dimensions, name: size, outermost first ({} for the 1-D mesh)."""
        if self.one_dimensional:
            return {}
        sizes = {"dp_replicate": self.replicate, "dp_shard": self.shard,
                 "tp": self.tensor_parallel}
        if self.strategy != "hsdp":
            del sizes["dp_replicate"]
        if self.tensor_parallel == 1:
            del sizes["tp"]
        return sizes

    def describe(self) -> str:
        """`hsdp 2 x 2 (replicate x shard)`, `fsdp 2 x tp 2`, `fsdp 4`, `ddp 4`."""
        if self.strategy == "hsdp" and self.replicate > 1:
            text = f"hsdp {self.replicate} x {self.shard} (replicate x shard)"
        else:
            text = f"{'ddp' if self.strategy == 'ddp' else 'fsdp'} {self.dp_size}"
        return text + (f" x tp {self.tensor_parallel}" if self.tensor_parallel > 1 else "")


def mesh_shape(parallelism: ParallelismSpec, procs_per_worker: int, world_size: int,
               strategy: Strategy | None = None) -> MeshShape:
    """The mesh of `world_size` processes, `procs_per_worker` to a pod, for a spec whose
    strategy is not auto (or for `strategy`, auto's choice). Raises MeshError."""
    chosen = strategy or parallelism.strategy
    if chosen == "auto":
        raise MeshError("parallelism.strategy: auto is decided by auto_shape")
    tp = parallelism.tensor_parallel
    if world_size % tp:
        raise MeshError(f"parallelism.tensorParallel ({tp}) must divide the number of "
                        f"processes ({world_size}): start whole pods of procsPerWorker "
                        f"({procs_per_worker}) processes, or lower tensorParallel")
    if world_size == 1:
        return MeshShape("ddp" if chosen == "ddp" else "fsdp")
    if chosen == "ddp":
        if tp > 1:
            raise MeshError(f"parallelism.tensorParallel ({tp}) needs strategy fsdp, hsdp or "
                            "auto: ddp keeps a whole copy of the model on every process")
        return MeshShape("ddp", replicate=world_size)
    if chosen == "fsdp":
        return MeshShape("fsdp", shard=world_size // tp, tensor_parallel=tp)
    if world_size % procs_per_worker:
        raise MeshError(f"parallelism.strategy: hsdp shards within a pod of procsPerWorker "
                        f"({procs_per_worker}) processes, and this group of {world_size} is "
                        "not whole pods: start every pod with procsPerWorker processes")
    pods = world_size // procs_per_worker
    if pods == 1:  # one pod: nothing to replicate, hsdp is fsdp
        return MeshShape("fsdp", shard=world_size // tp, tensor_parallel=tp)
    return MeshShape("hsdp", replicate=pods, shard=procs_per_worker // tp, tensor_parallel=tp)


def auto_shape(spec: TrainingJobSpec, dims: ModelDims, world_size: int,
               gpu_bytes: int | None) -> tuple[MeshShape, str]:
    """`strategy: auto`'s mesh for `world_size` processes and a GPU of `gpu_bytes` (None: no
    bound, on CPU), and why: see the module docstring for the rule."""
    from kubetrain.trainer.estimate import estimate_memory, job_plan

    procs = spec.workers.procs_per_worker
    candidates: list[MeshShape] = []
    if world_size > procs and world_size % procs == 0:
        candidates.append(mesh_shape(spec.parallelism, procs, world_size, "hsdp"))
    candidates.append(mesh_shape(spec.parallelism, procs, world_size, "fsdp"))
    if spec.parallelism.tensor_parallel == 1:
        for degree in TENSOR_PARALLEL_DEGREES:
            if (degree <= procs and procs % degree == 0 and world_size % degree == 0
                    and tensor_parallel_allowed(spec, dims, degree)):
                tp = spec.parallelism.model_copy(update={"tensor_parallel": degree})
                candidates.append(mesh_shape(tp, procs, world_size, "fsdp"))
    if gpu_bytes is None:
        return candidates[0], "no GPU memory bounds the choice"
    for shape in candidates:
        need = estimate_memory(spec, world_size, job_plan(spec, world_size, shape), dims=dims,
                               mesh=shape).total
        if need <= gpu_bytes:
            return shape, (f"the first to fit: {need / 1024**3:.1f} of "
                           f"{gpu_bytes / 1024**3:.0f} GiB per GPU")
    return candidates[-1], (f"nothing fits {gpu_bytes / 1024**3:.0f} GiB per GPU at the job's "
                            "micro-batch; the most sharded mesh")


def tensor_parallel_allowed(spec: TrainingJobSpec, dims: ModelDims, degree: int) -> bool:
    """Whether the API would accept `spec` with tensorParallel `degree`, for auto's
    candidates: the same rules (kubetrain/api/parallelism.py), on the model's final dimensions."""
    tp = spec.parallelism.model_copy(update={"tensor_parallel": degree, "strategy": "fsdp"})
    try:
        spec.model_validate(spec.model_copy(update={"parallelism": tp}).model_dump())
    except ValueError:
        return False
    return not tensor_parallel_problems(dims, spec.data.seq_len, degree)


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
