"""The shape of a job's mesh: how many processes replicate, shard and split each layer.

Torch-free, for `kubetrain estimate` and for the mesh that `kubetrain.trainer.mesh` builds
from it: `mesh_shape` lays out a spec whose strategy is fixed, `tensor_parallel_allowed`
says which tensor-parallel degrees the API would accept for strategy auto's candidates
(auto itself chooses by the estimate: `kubetrain.trainer.estimate.auto_shape`). The layout
table is in `kubetrain.trainer.mesh`'s docstring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kubetrain.api.trainingjob import (
    ModelDims,
    ParallelismSpec,
    TrainingJobSpec,
    tensor_parallel_problems,
)

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



def tensor_parallel_allowed(spec: TrainingJobSpec, dims: ModelDims, degree: int) -> bool:
    """Whether the API would accept `spec` with tensorParallel `degree`, for auto's
    candidates: the same rules (kubetrain/api/parallelism.py), on the model's final dimensions."""
    tp = spec.parallelism.model_copy(update={"tensor_parallel": degree, "strategy": "fsdp"})
    try:
        spec.model_validate(spec.model_copy(update={"parallelism": tp}).model_dump())
    except ValueError:
        return False
    return not tensor_parallel_problems(dims, spec.data.seq_len, degree)
