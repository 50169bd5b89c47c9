"""Tensor parallelism for the transformer blocks: the plans, and the loss over a sharded vocabulary.

`apply_tensor_parallel(model, tp_mesh)` is torchtitan's Llama plan (Megatron-LM's split,
with sequence parallelism), applied with `torch.distributed.tensor.parallel`:

- each block: the query, key, value and SwiGLU gate/up projections column-wise (each
  process computes whole heads, and a slice of the feed-forward width; their biases,
  where the family has them, split with them), the attention output and SwiGLU down
  projections row-wise, so a block costs one all-gather before attention and one
  before the feed-forward, and one reduce-scatter after each;
- sequence parallelism between them: the residual stream, the RMSNorms (the norms after
  each branch too, where the family has them) and the dropout run on 1/N of the
  sequence, so nothing is computed or kept N times; per-head q/k norms run on the
  process's own heads with replicated weights;
- the token embedding row-wise (a vocabulary-parallel lookup, reduce-scattered onto the
  sequence), the final norm sequence-parallel and its output gathered for the loss;
- the output projection's weight column-wise: each process holds 1/N of the vocabulary.
  A tied output projection stays the embedding's weight (both are split by vocabulary).

The loss (`vocab_parallel_cross_entropy`) never gathers the vocabulary: each process
computes its slice of the logits and the softmax's maximum, normaliser and target logit
are all-reduced across the tensor-parallel group (Megatron-LM's vocabulary-parallel
cross-entropy); and it goes chunk by checkpointed chunk like loss.py's `chunked`, so a
process holds at most one chunk of [tokens, vocab / N] fp32 logits. What it costs over
the unsplit chunked loss: the final norm's output all-gathered ([tokens, dim], kept until
backward), three all-reduces of [chunk] per chunk in forward and again in backward's
recomputation, and a reduce-scatter of the hidden states' gradient.

The attention modules' head counts become the heads one process holds (torchtitan did
the same before it moved to `view(..., -1, head_dim)`), so the model itself stays plain
PyTorch. The state-space model and INL dynamics have no plan: mesh.py refuses them with
the field that asks for it, before any of this runs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import checkpoint

from kubetrain.api.trainingjob import tensor_parallel_problems
from kubetrain.sizing import loss_chunk_tokens
from kubetrain.trainer.loss import OutputLoss
from kubetrain.trainer.mesh_shape import MeshError
from kubetrain.trainer.model import Transformer

VOCAB_PARALLEL = "vocab_parallel"


def apply_tensor_parallel(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Split `model`'s blocks, embedding and output projection over `tp_mesh`, in place,
    and make its loss the vocabulary-parallel one."""
    degree = tp_mesh.size()
    # The final dimensions (a model.init's config.json, the tokenizer's vocabulary): the
    # API checked only what the spec names.
    problems = tensor_parallel_problems(model.dims, None, degree)
    if problems:
        raise MeshError("; ".join(problems))
    tied = model.dims.tie_embeddings
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        # Never called in training (the loss reads its weight): this splits the weight by
        # vocabulary, and a logits call (generation) returns them split the same way.
        "output": ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1),
                                  use_local_output=False),
    })
    # The loss takes the final hidden states whole, as a DTensor (see the loss below).
    parallelize_module(model.norm, tp_mesh, PrepareModuleOutput(
        output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=False))
    if tied:  # both were split by vocabulary: one parameter again
        model.output.weight = model.tok_embeddings.weight
    for block in model.layers:
        plan = {
            "attention_norm": SequenceParallel(),
            # x, the rotary tables and the sliding window's mask (or None).
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None, None),
                desired_input_layouts=(Replicate(), None, None, None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
        attention: Any = block.attention
        if attention.q_norm is not None:
            # Per-head norms act on this process's heads ([batch, seq, heads, head_dim]
            # split on dim 2); their weights are replicated, and their gradients summed.
            for norm in ("attention.q_norm", "attention.k_norm"):
                plan[norm] = SequenceParallel(sequence_dim=2, use_local_output=True)
        if block.post_attention_norm is not None:
            # After a branch, on 1/N of the sequence, as local tensors like the residual.
            plan["post_attention_norm"] = SequenceParallel(use_local_output=True)
            plan["post_ffn_norm"] = SequenceParallel(use_local_output=True)
        parallelize_module(block, tp_mesh, plan)
        attention.n_heads //= degree  # the heads this process computes
        attention.n_kv_heads //= degree
    model.output_loss = OutputLoss(VOCAB_PARALLEL, vocab_parallel_cross_entropy)


def vocab_parallel_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor,
                                 targets: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """Summed token loss with the output weight split by vocabulary (see the module docstring).

    `hidden` [N, dim] is a DTensor replicated over the tensor-parallel group, `weight`
    [vocab, dim] a DTensor split by rows over it; `targets` [N] are whole on every process.
    The result, the same on every process of the group, is fp32.
    """
    assert isinstance(hidden, DTensor) and isinstance(weight, DTensor), (
        "the vocabulary-parallel loss needs the tensor-parallel model's DTensors")
    mesh = weight.device_mesh
    group = mesh.get_group()
    # Each process's gradient of the hidden states covers only its slice of the vocabulary:
    # a partial sum, which DTensor reduce-scatters back onto the sequence.
    hidden_local = hidden.to_local(grad_placements=[Partial()])
    weight_local = weight.to_local()
    rows = weight_local.shape[0]
    first = mesh.get_local_rank() * rows
    dtype = (torch.get_autocast_dtype(hidden_local.device.type)
             if torch.is_autocast_enabled(hidden_local.device.type)
             else torch.promote_types(hidden_local.dtype, weight_local.dtype))
    chunk = chunk or loss_chunk_tokens(rows)
    pieces = list(zip(hidden_local.to(dtype).split(chunk), targets.split(chunk), strict=True))
    if not torch.is_grad_enabled() or len(pieces) == 1:
        losses = [_chunk_loss(h, weight_local, t, first, dtype, group) for h, t in pieces]
    else:
        losses = [checkpoint(_chunk_loss, h, weight_local, t, first, dtype, group,
                             use_reentrant=False) for h, t in pieces]
    return torch.stack(losses).sum()


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                first: int, dtype: torch.dtype, group: dist.ProcessGroup) -> torch.Tensor:
    """The summed cross-entropy of one chunk, from this process's slice of its logits."""
    with torch.autocast(hidden.device.type, enabled=False):
        logits = (hidden @ weight.to(dtype).t()).float()  # [chunk, vocab / N]
    # The maximum only steadies the exponentials: no gradient flows through it.
    maximum = logits.detach().amax(dim=-1)
    dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - maximum.unsqueeze(-1)
    normaliser = _SumOverGroup.apply(shifted.exp().sum(dim=-1), group)
    local = targets - first
    here = (local >= 0) & (local < logits.shape[-1])
    picked = shifted.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = _SumOverGroup.apply(picked * here, group)
    return (normaliser.log() - target_logit).sum()


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) in forward; in backward each process's input gets the gradient as is,
    since every process of the group computes the same loss from the sum."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None
