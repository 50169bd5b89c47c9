"""spec.parallelism: sharding strategy, tensor parallelism, precision, recomputation."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from kubetrain.api.base import ApiModel, cel
from kubetrain.api.presets import ModelDims

TP_NEEDS_SHARDING = ("tensorParallel needs strategy fsdp, hsdp or auto: ddp keeps a whole "
                     "copy of the model on every process")
TP_WITHOUT_FP8 = ("tensorParallel with precision fp8 is not supported (float8 tensor-parallel "
                  "plans are not applied): use precision bf16, or tensorParallel 1")


def tensor_parallel_problems(dims: ModelDims, seq_len: int | None, degree: int,
                             vocabulary: bool = True) -> list[str]:
    """Why a model of `dims` cannot be split `degree` ways by tensor parallelism ([] if it
    can): each process holds an equal part of the heads, the feed-forward width, the
    vocabulary (when `vocabulary`: a preset's is replaced by the tokenizer's) and, under
    sequence parallelism, of every sequence."""
    if degree == 1:
        return []
    sizes = [("model.nHeads", dims.n_heads), ("model.nKvHeads", dims.n_kv_heads),
             ("model.ffnDim", dims.ffn_dim)]
    if vocabulary:
        sizes.append(("model.vocabSize", dims.vocab_size))
    if seq_len is not None:
        sizes.append(("data.seqLen", seq_len))
    return [f"parallelism.tensorParallel ({degree}) must divide {name} ({value}): each "
            "process holds an equal part of it; choose a tensorParallel that divides it"
            for name, value in sizes if value % degree]


class ParallelismSpec(ApiModel):
    """How the model is distributed and computed."""

    model_config = ConfigDict(json_schema_extra={"x-kubetrain-cel": [
        cel("self.strategy == oldSelf.strategy",
            "strategy cannot change after creation", ".strategy"),
        cel("!has(self.tensorParallel) || self.tensorParallel == 1 || !has(self.strategy) "
            "|| self.strategy != 'ddp'", TP_NEEDS_SHARDING, ".tensorParallel"),
        cel("!has(self.tensorParallel) || self.tensorParallel == 1 || !has(self.precision) "
            "|| self.precision != 'fp8'", TP_WITHOUT_FP8, ".tensorParallel"),
    ]})

    strategy: Literal["fsdp", "ddp", "hsdp", "auto"] = Field(
        default="fsdp",
        description="fsdp (FSDP2, every parameter sharded over all processes), ddp "
        "(replicated), hsdp (sharded within a pod, replicated across pods: only gradients "
        "cross the network between nodes; replicas scales the replicate dimension) or auto "
        "(hsdp, fsdp or fsdp with tensor parallelism within a pod, the first whose "
        "memory estimate fits the GPU: docs/training.md).",
    )
    tensor_parallel: int = Field(
        default=1, ge=1, le=64,
        description="Split every transformer block over this many processes of one pod "
        "(tensor parallelism, with sequence parallelism on the norms and the loss computed "
        "over the split vocabulary); it must divide workers.procsPerWorker and composes "
        "with fsdp and hsdp as a 2-D or 3-D mesh. The processes of a group read the same "
        "batches. Not with ddp, fp8, the ssm architecture, INL dynamics or distillation.",
    )
    precision: Literal["bf16", "fp16", "fp32", "fp8"] = Field(
        default="bf16",
        description="Compute precision: bf16 (fp32 master weights and reductions), fp16 "
        "(with a gradient scaler), fp32, or fp8: bf16 with the transformer blocks' linear "
        "layers in float8 (torchao; FSDP2 gathers their weights in float8), on GPUs with "
        "float8 support only (compute capability 8.9 or newer: Ada, Hopper, Blackwell).",
    )
    activation_checkpointing: Literal["none", "selective", "full"] = Field(
        default="none",
        description="Recompute activations in backward to save memory: none, selective "
        "(every other block) or full (every block).",
    )
    compile: bool = Field(default=False, description="torch.compile each transformer block.")

