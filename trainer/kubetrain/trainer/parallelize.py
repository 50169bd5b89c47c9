"""How a plain model becomes a distributed, mixed-precision training model.

`parallelize` is the one place parallelism is applied, in torchtitan's order:
float8 conversion (fp8 only) → tensor parallelism (tensor_parallel.py) → activation
checkpointing → torch.compile → FSDP2 (`fully_shard` per block, then the root; over a
2-D replicate x shard mesh it is HSDP) or DDP. The mesh comes from mesh.py (a
`TrainingMesh`: strategy auto already decided); a plain 1-D `DeviceMesh` means the
spec's fsdp or ddp over all of it, as before meshes had more dimensions. It returns a
`ParallelModel` that tells the loop the four things that differ between strategies: how
to compute in the job's precision, how to skip gradient synchronisation on non-final
micro-steps, which gradient scaler (fp16 only) to use, and how many data-parallel ranks
read different batches (the processes of one tensor-parallel group read the same).
Under tensor parallelism FSDP2 wraps the model even over a data-parallel dimension of
one, for its mixed-precision policy: autocast does not cast DTensor parameters.
`parallelize_frozen` places a model that is never trained (a distillation teacher) the
same way, minus what only training needs.

Precision: with FSDP2 the `MixedPrecisionPolicy` casts parameters to bf16/fp16
for compute and reduces gradients in fp32, keeping fp32 master weights; with DDP
(and a single process, which is left unwrapped) `torch.autocast` does the same
job. fp32 runs unchanged. fp8 is bf16 with every transformer block's linear
layers swapped for torchao's `Float8Linear`, with dynamic tensorwise scaling (under
FSDP2 their weights are all-gathered in float8). `KUBETRAIN_FLOAT8_RECIPE=rowwise`
(or `rowwise_with_gw_hp`) picks another of torchao's recipes, for benchmarks
(bench/mfu.py) and diagnosis; rowwise weights are all-gathered in bf16. The output projection stays
bf16: its loss (loss.py) reads its weight directly, and float8 would cost the
most accuracy there; so does the INL dynamics controller (model.Dynamics). fp8
is refused, naming the field, on CPUs and on GPUs without float8 tensor cores,
and when torchao is not installed.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from torch.amp import GradScaler
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.nn.parallel import DistributedDataParallel

from kubetrain.api.trainingjob import ParallelismSpec
from kubetrain.trainer.architecture import LanguageModel
from kubetrain.trainer.mesh import TrainingMesh
from kubetrain.trainer.model import Transformer
from kubetrain.trainer.tensor_parallel import apply_tensor_parallel

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
                  "fp8": torch.bfloat16}  # fp8: float8 matmuls inside a bf16 model
FLOAT8_CAPABILITY = (8, 9)  # Ada and Hopper are the first with float8 tensor cores
INSTALL_GPU_EXTRA = "pip install 'kubetrain[gpu]' (or pip install torchao)"
FLOAT8_RECIPE_ENV = "KUBETRAIN_FLOAT8_RECIPE"
FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # torchao's recipe names
# bench/mfu.py on one H100: tensorwise 1.17x bf16's tokens/s at llama-1b widths, rowwise 1.00.
DEFAULT_FLOAT8_RECIPE = "tensorwise"


class PrecisionUnsupported(ValueError):
    """The job's precision cannot run on this device or with the installed packages."""


@dataclass
class ParallelModel:
    """The model as trained, with the precision and synchronisation controls the loop needs."""

    module: nn.Module
    autocast: Callable[[], AbstractContextManager[object]]
    scaler: GradScaler | None
    _skip_sync: Callable[[], AbstractContextManager[object]]
    dp_size: int = 1  # data-parallel ranks: the processes that read different batches

    @contextlib.contextmanager
    def gradient_sync(self, enabled: bool) -> Iterator[None]:
        """Backward passes inside do (or, when not enabled, do not) synchronise gradients."""
        if enabled:
            yield
        else:
            with self._skip_sync():
                yield


def parallelize(
    model: LanguageModel, spec: ParallelismSpec, mesh: DeviceMesh | TrainingMesh,
    device: torch.device
) -> ParallelModel:
    """Apply float8, tensor parallelism, activation checkpointing, compile and FSDP2/HSDP/DDP
    to `model` on `device`, over `mesh` (see the module docstring)."""
    spec, data_mesh, tp_mesh = _layout(spec, mesh)
    world_size = data_mesh.size()
    if spec.precision == "fp8":
        # Before anything moves to the device: a job that cannot run fails at once.
        convert_to_float8(model, device, all_gather_in_float8=_shards(spec, data_mesh))
    model.to(device)
    if tp_mesh is not None:
        if not isinstance(model, Transformer):  # the API refuses it; this names it anyway
            raise ValueError("parallelism.tensorParallel: the state-space model has no "
                             "tensor-parallel plan: use tensorParallel 1")
        apply_tensor_parallel(model, tp_mesh)
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
    if _shards(spec, data_mesh) or tp_mesh is not None:
        fsdp_model = _shard(model, data_mesh, dtype)
        return ParallelModel(
            module=model,
            autocast=contextlib.nullcontext,
            # FSDP2 shards gradients, so inf/nan checks must be agreed across ranks.
            scaler=ShardedGradScaler(device.type) if spec.precision == "fp16" else None,
            _skip_sync=lambda: _fsdp_sync_disabled(fsdp_model),
            dp_size=world_size,
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
        dp_size=world_size,
    )


def parallelize_frozen(model: LanguageModel, spec: ParallelismSpec,
                       mesh: DeviceMesh | TrainingMesh, device: torch.device) -> LanguageModel:
    """Place a frozen model (a distillation teacher) the way `parallelize` places the trained one.

    Its parameters stop requiring gradients and are stored in the job's compute dtype:
    nothing updates them, so there are no fp32 master weights to keep (fp8 jobs' teachers
    run in bf16, without float8 conversion). Under strategy fsdp (or hsdp) with several
    processes FSDP2 shards every block and then the root, as for the student; otherwise (ddp, or one
    process) each rank holds the whole model: DDP only synchronises gradients, which a
    frozen model has none of. No activation checkpointing (nothing runs backward through
    it); torch.compile per block when the job compiles. Returned in eval mode.
    """
    spec, data_mesh, tp_mesh = _layout(spec, mesh)
    if tp_mesh is not None:  # the API refuses distillation with tensorParallel
        raise ValueError("parallelism.tensorParallel: a distillation teacher has no "
                         "tensor-parallel placement: use tensorParallel 1")
    dtype = COMPUTE_DTYPES[spec.precision]
    model.requires_grad_(False)
    for parameter in model.parameters():
        parameter.data = parameter.data.to(dtype)  # the rotary tables (buffers) stay fp32
    model.to(device)
    model.eval()
    if spec.compile:
        for block in model.layers:
            block.compile()
    if _shards(spec, data_mesh):
        _shard(model, data_mesh, dtype)
    return model


def _layout(spec: ParallelismSpec, mesh: DeviceMesh | TrainingMesh
            ) -> tuple[ParallelismSpec, DeviceMesh, DeviceMesh | None]:
    """The spec with its strategy decided, the mesh data parallelism spans, and the
    tensor-parallel mesh (None without)."""
    if isinstance(mesh, TrainingMesh):
        return mesh.parallelism(spec), mesh.data_parallel, mesh.tensor_parallel
    return spec, mesh, None


def _shards(spec: ParallelismSpec, mesh: DeviceMesh) -> bool:
    """Whether FSDP2 shards the models: strategy fsdp (or hsdp) with several processes."""
    return spec.strategy in ("fsdp", "hsdp") and mesh.size() > 1


def _shard(model: LanguageModel, mesh: DeviceMesh, dtype: torch.dtype) -> FSDPModule:
    """FSDP2 over `mesh`: each block, then the root (torchtitan's order), computing in
    `dtype` and reducing gradients in fp32; `model`, now an FSDPModule."""
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return cast(FSDPModule, model)


def float8_unsupported(device: torch.device) -> str | None:
    """Why float8 training cannot run on `device`, or None when it can."""
    if device.type != "cuda":
        return (f"this process trains on {device.type}, and float8 training needs an NVIDIA "
                "GPU with float8 tensor cores")
    capability = torch.cuda.get_device_capability(device)
    if capability < FLOAT8_CAPABILITY:
        return (f"{torch.cuda.get_device_name(device)} has compute capability "
                f"{capability[0]}.{capability[1]}, and float8 tensor cores need "
                f"{FLOAT8_CAPABILITY[0]}.{FLOAT8_CAPABILITY[1]} or newer (Ada, Hopper, Blackwell)")
    return None


def convert_to_float8(model: LanguageModel, device: torch.device,
                      all_gather_in_float8: bool) -> None:
    """Swap the transformer blocks' linear layers for torchao's Float8Linear, in place.

    Raises PrecisionUnsupported, naming `parallelism.precision`, where float8
    cannot run or torchao is missing.
    """
    reason = float8_unsupported(device)
    if reason is not None:
        raise PrecisionUnsupported(
            f"parallelism.precision: fp8 is not supported here: {reason}. Use precision bf16.")
    recipe = os.environ.get(FLOAT8_RECIPE_ENV, DEFAULT_FLOAT8_RECIPE)
    if recipe not in FLOAT8_RECIPES:
        raise ValueError(f"{FLOAT8_RECIPE_ENV}={recipe!r} is not one of "
                         f"{', '.join(FLOAT8_RECIPES)}")
    try:
        float8 = importlib.import_module("torchao.float8")  # optional dependency, untyped
    except ImportError as error:
        raise PrecisionUnsupported(
            f"parallelism.precision: fp8 needs torchao, which is not installed ({error}): "
            f"{INSTALL_GPU_EXTRA}") from error
    if recipe == "tensorwise":
        config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=all_gather_in_float8)
    else:  # torchao gathers rowwise-scaled weights in high precision
        config = float8.Float8LinearConfig.from_recipe_name(recipe)

    def in_a_block(module: nn.Module, name: str) -> bool:
        # float8 matmuls need both dimensions divisible by 16. The INL dynamics controller
        # stays bf16: its matmuls are small, and its outputs are the control gains.
        return (name.startswith("layers.") and ".dynamics." not in name
                and isinstance(module, nn.Linear)
                and module.in_features % 16 == 0 and module.out_features % 16 == 0)

    float8.convert_to_float8_training(model, config=config, module_filter_fn=in_a_block)


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
