"""Estimate a job's memory per GPU and recommend a configuration that fits.

`kubetrain estimate FILE [--gpu-memory GiB] [--world-size N]` exits 0 when the
job fits (and shows the largest micro-batch with the same global batch that would
fit, when that is larger), 1 (after printing a recommendation) when it does not.
A job with the in-memory checkpoint tier (spec.checkpoint.memory) also gets the tier's
host memory per worker pod on its own line (memory_budget.py: shard x versions kept x
(1 + replicas) x processes per worker, at minReplicas as the operator sizes pods), and
exits 1 with that arithmetic when it exceeds checkpoint.memory.maxWorkerMemory. A job with
either tier staging on the GPU (checkpoint.memory, checkpoint.async) gets the path each
tier's snapshots will take (staging.py): a device-side first phase where the GPU memory this
estimate leaves free keeps memory_budget's headroom after a state shard, else the overlapped
host copy; with checkpoint.async, the S3 tier's staging buffer in host memory per pod too.

For the job's model, micro-batch, sequence length, precision, activation
checkpointing, strategy and world size it adds up, per training process:

- parameters, gradients and optimizer state, all fp32 (master weights), divided
  by the world size under FSDP and whole under DDP;
- FSDP's working set: two blocks' gathered parameters (the one computing and the
  one prefetched) and their unsharded fp32 gradients;
- activations kept for backward, per token and layer (with `d` = dim, `q` = query
  width (heads x head size: d unless the family sets headDim), `k` = key/value width,
  `f` = feed-forward width, `b` = bytes of the compute dtype): b·(8d + 3q + 3k + 4f)
  without checkpointing - block input, two norms (with their fp32 intermediates), q,
  k, v, rotated q/k, attention output, residual, the four SwiGLU tensors; fused
  attention keeps no seq-by-seq matrix - and b·d for a checkpointed block, which also
  recomputes one block's worth during backward. By family (`block_activations`):
  per-head q/k norms (Qwen3, Gemma 3) keep their input and output, b·(2q + 2k), and a
  scale per head; Gemma 3's norms after attention and the feed-forward b·(4d + 2); a
  local layer whose window is shorter than the sequence its keys and values repeated to
  every query head (the masked kernel does not share them), b·2(q - k), and its mask as
  scores to add, b·seq² per local layer and micro-batch (`window_masks`);
  counted with saved-tensor hooks in fp32 (tests/trainer/test_families.py), not yet
  measured on a GPU;
  INL dynamics (`model.dynamics`) add b·(8d + 2w) per token and block (w = the
  controller's width: its two hidden tensors; the three sigmoids, beta, the
  error, the velocity before and after its clamp, the new hidden state; counted
  with saved-tensor hooks) and a checkpointed block keeps its velocity too, 2·b·d,
  besides the controller's parameters in every parameter figure. These counted
  tensors are then scaled by what the GPU measured (bench/mfu.py, one H100): eager
  blocks under autocast keep 1.12 times as much (the residual stream and the norms'
  inputs are fp32 until the first cast), compiled blocks 0.75 times (inductor's fused
  kernels keep no elementwise intermediates), and fp8 blocks 0.65 of that (float8
  linears save their inputs in float8). The block recomputed under checkpointing is
  counted as eager;
- without FSDP, under autocast (bf16/fp16/fp8): the compute-dtype copies of the
  blocks' weights that autocast caches during forward and backward keeps: b·(block
  parameters), one byte each for fp8's float8 linears;
- the output projection and loss (loss.py), by implementation: `full` holds the
  logits, their fp32 copy and gradient, tokens·vocab·(b + 8); `chunked` (the
  default) the same for one chunk of `sizing.loss_chunk_tokens` tokens, plus the
  output weight cast to the compute dtype without FSDP; `liger` (CUDA, when
  installed) its fp32 weight-gradient accumulator vocab·d·4, the input gradient
  tokens·d·b and one chunk of its own size;
- with `distillation`, the frozen teacher (distill.py), whose dimensions and INL
  dynamics come from its config.json: its weights in the compute dtype, the
  dynamics controllers' included (sharded under FSDP, whole otherwise), with no
  gradients or optimizer state, FSDP's two gathered teacher
  blocks, its final hidden states of the micro-batch (tokens·d_teacher·b) and its
  whole output weight (vocab·d_teacher·b, gathered once per micro-batch under FSDP),
  which both live until the student's backward, and per loss chunk (of
  `sizing.distillation_chunk_tokens`, half a cross-entropy chunk) the teacher's
  logits with their fp32 copy and log-softmax, tokens·vocab·(b + 8); the student's
  loss is then the chunked distillation loss whatever `output_loss` says, counted
  as the chunked loss over those shorter chunks plus its extra log-softmax and its
  gradient, tokens·vocab·8;
- 3 GiB and a byte per parameter of the process for the CUDA context, cuBLAS
  workspaces and the caching allocator's reserved-but-free blocks (fitted on the
  H100 with llama-1b and llama-8b widths).

A state-space model (`model.architecture: ssm`, ssm.py) is counted with its own
parameters (sizing.ssm_parameter_count) and, per block and token, the activations its
chunked scan keeps (`sizing.ssm_block_activation_bytes`: the compute-dtype tensors, the
fp32 scan's inputs, decays, within-chunk scores and chunk states; within 3 % of the
saved-tensor count on CPU); a checkpointed block keeps its input, b·d. The description
also gives its recurrent state for generation (`sizing.ssm_state_elements`, fp32), which
does not grow with the context.

The figures are planning estimates, not guarantees. Measured peak / estimate on one
H100 (bench/mfu.py; tests/trainer/test_estimate.py keeps the figures): 0.96 to 0.99
for llama-1b at micro-batch 4 to 16, bf16 and fp8, eager and compiled, without and
with selective checkpointing, and for llama-8b widths at micro-batch 4; not yet
measured: compiled blocks under checkpointing, and FSDP over several GPUs. On CPU
(bench/memory.py, without the context term): within 7 % for two fp32 steps of a
128k-vocabulary model. Torch-free: it runs where torch is not installed.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from typing import Literal

from kubetrain.api.families import FAMILIES
from kubetrain.api.manifest import InvalidManifest, load_job
from kubetrain.api.trainingjob import ModelDims, TrainingJobSpec
from kubetrain.sizing import (
    CONTROLLER_WIDTH,
    block_parameter_count,
    distillation_chunk_tokens,
    loss_chunk_tokens,
    parameter_count,
    ssm_block_activation_bytes,
    ssm_block_parameter_count,
    ssm_parameter_count,
    ssm_state_elements,
)
from kubetrain.trainer.mesh_shape import (
    TENSOR_PARALLEL_DEGREES,
    MeshError,
    MeshShape,
    Strategy,
    mesh_shape,
    tensor_parallel_allowed,
)

GIB = 1024**3
# Measured on one H100 (bench/mfu.py, llama-1b and llama-8b widths, bf16 and fp8, eager and
# compiled, micro-batch 4 to 16): the CUDA context, cuBLAS workspaces and the caching
# allocator's reserved-but-free blocks came to about 3 GiB plus a byte per parameter.
CONTEXT_BYTES = 3 * GIB
ALLOCATOR_BYTES_PER_PARAMETER = 1
# What a block keeps for backward, measured against the tensors counted below (`full_block`):
# eager under autocast keeps more (the residual stream and the norms' inputs stay fp32
# before the first cast), inductor's fused kernels keep less (no elementwise intermediates
# of RMSNorm, RoPE and SwiGLU), and float8 linears keep their inputs in float8.
EAGER_AUTOCAST_ACTIVATIONS = 1.12
COMPILED_ACTIVATIONS = 0.75
FLOAT8_ACTIVATIONS = 0.65
COMPUTE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 2}  # fp8: a bf16 model, float8 matmuls
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1}  # fp32 tensors per parameter
Checkpointing = Literal["none", "selective", "full"]
OutputLossName = Literal["full", "chunked", "liger"]


@dataclass(frozen=True)
class Plan:
    """The settings that decide memory: what the job asks for, or a recommended variant."""

    micro_batch_size: int
    gradient_accumulation: int
    activation_checkpointing: Checkpointing


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per training process, by component."""

    parameters: int
    gradients: int
    optimizer: int
    fsdp_working_set: int
    weight_copies: int
    activations: int
    logits: int
    teacher: int = 0  # distillation: everything the frozen teacher adds
    context: int = CONTEXT_BYTES  # with the allocator's slack (estimate_memory adds it)

    @property
    def total(self) -> int:
        return (self.parameters + self.gradients + self.optimizer + self.fsdp_working_set
                + self.weight_copies + self.activations + self.logits + self.teacher
                + self.context)


def job_plan(spec: TrainingJobSpec, world_size: int, mesh: MeshShape | None = None) -> Plan:
    """The plan the job's spec describes at `world_size` processes laid out as `mesh`
    (default: the spec's own; the processes of a tensor-parallel group share micro-batches)."""
    mesh = mesh or spec_mesh(spec, world_size)
    return Plan(spec.optimization.micro_batch_size, spec.gradient_accumulation(mesh.dp_size),
                spec.parallelism.activation_checkpointing)


def spec_mesh(spec: TrainingJobSpec, world_size: int) -> MeshShape:
    """The mesh the spec names at `world_size` processes; under strategy auto the one it
    starts from before auto knows the GPU (fsdp, with the spec's tensorParallel).
    Raises MeshError when the spec cannot be laid out on that many processes."""
    strategy: Strategy | None = "fsdp" if spec.parallelism.strategy == "auto" else None
    return mesh_shape(spec.parallelism, spec.workers.procs_per_worker, world_size, strategy)


def estimate_memory(spec: TrainingJobSpec, world_size: int, plan: Plan,
                    output_loss: OutputLossName = "chunked",
                    dims: ModelDims | None = None,
                    teacher: ModelDims | None = None,
                    teacher_dynamics: bool = False,
                    mesh: MeshShape | None = None) -> MemoryEstimate:
    """Memory per process for `spec` trained by `world_size` processes with `plan`,
    the loss computed by `output_loss` (loss.py); `dims` (default: the spec's) are the
    model's dimensions, which a model.init job takes from its config.json; `teacher`
    the dimensions of a distillation teacher and `teacher_dynamics` whether it has INL
    dynamics (its config.json's; see `teacher_model`); `mesh` how the processes are laid
    out (default: the spec's, `spec_mesh`).
    """
    dims = dims or spec.model.resolve()
    mesh = mesh or spec_mesh(spec, world_size)
    tp = mesh.tensor_parallel
    dynamics = spec.model.dynamics.enabled
    n_params = parameter_count(dims, dynamics)
    block_params = block_parameter_count(dims, dynamics) // tp
    # Under tensor parallelism FSDP2 always wraps the model (for its precision policy).
    sharded = mesh.strategy in ("fsdp", "hsdp") and (mesh.shard > 1 or tp > 1)
    shards = mesh.parameter_shards
    compute = COMPUTE_BYTES[spec.parallelism.precision]

    tokens = plan.micro_batch_size * spec.data.seq_len
    full_block = compute * block_activations(dims, dynamics, spec.data.seq_len) * tokens
    block_input = compute * dims.dim * tokens * (2 if dynamics else 1)  # and the velocity
    if spec.model.architecture == "ssm":  # no attention, no dynamics: the SSM's own terms
        n_params, block_params = ssm_parameter_count(dims), ssm_block_parameter_count(dims)
        full_block = plan.micro_batch_size * ssm_block_activation_bytes(
            dims, spec.data.seq_len, compute)
    # Without FSDP the weights stay fp32 and autocast computes with cached casts of them.
    casts = not sharded and compute < 4
    precision = spec.parallelism.precision
    eager_block = full_block
    if spec.model.architecture != "ssm":  # the SSM's counted terms are autograd's own
        eager_block = round(full_block * (EAGER_AUTOCAST_ACTIVATIONS if casts else 1.0)
                            * (FLOAT8_ACTIVATIONS if precision == "fp8" else 1.0))
        full_block = (round(full_block * COMPILED_ACTIVATIONS
                            * (FLOAT8_ACTIVATIONS if precision == "fp8" else 1.0))
                      if spec.parallelism.compile else eager_block)
    if tp > 1:
        # Tensor and sequence parallelism split every kept tensor, except the block's two
        # all-gathered inputs (to attention and to the feed-forward), kept whole for backward.
        gathered = 2 * compute * dims.dim * tokens
        full_block = full_block // tp + gathered * (tp - 1) // tp
        eager_block = eager_block // tp + gathered * (tp - 1) // tp
        block_input //= tp
    checkpointed = {"none": 0, "selective": (dims.n_layers + 1) // 2,
                    "full": dims.n_layers}[plan.activation_checkpointing]
    activations = ((dims.n_layers - checkpointed) * full_block + checkpointed * block_input
                   + window_masks(dims, spec.data.seq_len, compute))
    if checkpointed:
        # The block being recomputed during backward, counted as eager (not yet measured
        # compiled).
        activations += eager_block
    logits = _loss_bytes(output_loss, tokens, dims.vocab_size, dims.dim, compute, casts)
    if tp > 1:
        # The vocabulary-parallel chunked loss (tensor_parallel.py): chunks of its slice of
        # the vocabulary, plus the final hidden states gathered whole.
        logits = (_loss_bytes("chunked", tokens, dims.vocab_size // tp, dims.dim, compute,
                              casts) + compute * dims.dim * tokens)
    teacher_bytes = 0
    if teacher is not None:
        chunk = min(tokens, distillation_chunk_tokens(dims.vocab_size))
        weight_cast = dims.vocab_size * dims.dim * compute if casts else 0
        logits = chunk * dims.vocab_size * (compute + 8 + 8) + weight_cast
        teacher_bytes = _teacher_bytes(teacher, teacher_dynamics, tokens, chunk, compute,
                                       sharded, shards)
    return MemoryEstimate(
        parameters=4 * n_params // shards,
        gradients=4 * n_params // shards,
        optimizer=4 * OPTIMIZER_STATES[spec.optimization.optimizer] * n_params // shards,
        fsdp_working_set=2 * block_params * (compute + 4) if sharded else 0,
        # float8 linears keep 1-byte casts of their weights.
        weight_copies=((1 if precision == "fp8" else compute) * dims.n_layers * block_params
                       if casts else 0),
        activations=activations,
        logits=logits,
        teacher=teacher_bytes,
        context=CONTEXT_BYTES + ALLOCATOR_BYTES_PER_PARAMETER * n_params // shards,
    )


def block_activations(dims: ModelDims, dynamics: bool = False, seq_len: int = 0) -> int:
    """Numbers one transformer block keeps for backward per token (see the module docstring):
    8d + 3q + 3k + 4f, the dynamics' 8d + 2w, and by family the per-head q/k norms' input
    and output (2q + 2k) with their per-head scales, and the post-branch norms' (4d + 2).
    Local layers whose window is shorter than `seq_len` keep their keys and values repeated
    to every query head, 2(q - k) more, averaged over the blocks."""
    traits = FAMILIES[dims.family]
    d, f = dims.dim, dims.ffn_dim
    q, k = dims.n_heads * dims.head_size, dims.n_kv_heads * dims.head_size
    kept = 8 * d + 3 * q + 3 * k + 4 * f
    if dims.sliding_window is not None and seq_len > dims.sliding_window:
        kept += 2 * (q - k) * sum(dims.local_layers) // dims.n_layers
    if dynamics:
        kept += 8 * d + 2 * CONTROLLER_WIDTH
    if traits.qk_norm:
        kept += 2 * (q + k) + dims.n_heads + dims.n_kv_heads
    if traits.post_norms:
        kept += 2 * (2 * d + 1)
    return kept


def window_masks(dims: ModelDims, seq_len: int, compute: int) -> int:
    """Bytes of the local layers' sliding-window masks, as attention keeps them for
    backward: one [seq, seq] in the compute dtype per local layer (the boolean mask the
    model passes is turned into scores to add, once per layer and shared by the batch)."""
    if dims.sliding_window is None or seq_len <= dims.sliding_window:
        return 0
    return compute * seq_len * seq_len * sum(dims.local_layers)


def _teacher_bytes(teacher: ModelDims, dynamics: bool, tokens: int, chunk: int, compute: int,
                   sharded: bool, shards: int) -> int:
    """What a frozen distillation teacher holds (see the module docstring)."""
    weights = compute * parameter_count(teacher, dynamics) // shards
    gathered_blocks = 2 * block_parameter_count(teacher, dynamics) * compute if sharded else 0
    hidden = tokens * teacher.dim * compute
    output_weight = teacher.vocab_size * teacher.dim * compute if sharded else 0
    chunk_logits = chunk * teacher.vocab_size * (compute + 8)
    return weights + gathered_blocks + hidden + output_weight + chunk_logits


def teacher_model(spec: TrainingJobSpec) -> tuple[ModelDims | None, bool]:
    """The job's distillation teacher as the trainer builds it: its dimensions and whether
    it has INL dynamics, from its config.json (read through the storage layer, like
    model.init's); (None, False) without a teacher."""
    if spec.distillation is None:
        return None, False
    from kubetrain.trainer.pretrained_config import teacher_config

    config = teacher_config(spec)
    return config.dims, config.dynamics.enabled


def _loss_bytes(output_loss: OutputLossName, tokens: int, vocab: int, dim: int, compute: int,
                casts: bool) -> int:
    """What the output projection and loss hold at their peak (see the module docstring)."""
    per_logit = compute + 8  # the logits, their fp32 copy, and its gradient
    if output_loss == "full":
        return tokens * vocab * per_logit
    if output_loss == "chunked":
        weight_cast = vocab * dim * compute if casts else 0
        return min(tokens, loss_chunk_tokens(vocab)) * vocab * per_logit + weight_cast
    # Liger: chunks of next_power_of_2(tokens / ceil(vocab / dim)) tokens.
    chunk = 1 << max(0, math.ceil(math.log2(max(1, tokens / math.ceil(vocab / dim)))))
    return vocab * dim * 4 + tokens * dim * compute + min(tokens, chunk) * vocab * per_logit


def recommend(spec: TrainingJobSpec, world_size: int, gpu_bytes: int,
              output_loss: OutputLossName = "chunked",
              dims: ModelDims | None = None,
              teacher: ModelDims | None = None,
              teacher_dynamics: bool = False,
              grow: bool = False,
              mesh: MeshShape | None = None) -> Plan | None:
    """The plan that fits `gpu_bytes` with the least recomputation, then the largest micro-batch.

    The global batch stays exactly what the job asks for: the micro-batch is a divisor of
    it, and gradient accumulation makes up the rest. With `grow` (a job that fits, using
    the memory it leaves free) the micro-batch may exceed the job's, at the job's own
    activation checkpointing; otherwise it never does. None when
    not even micro-batch 1 with full checkpointing fits (more processes, or a smaller
    model, are needed).
    """
    asked = job_plan(spec, world_size, mesh)
    global_sequences = asked.micro_batch_size * asked.gradient_accumulation
    largest = global_sequences if grow else asked.micro_batch_size
    micro_batches = [m for m in range(largest, 0, -1) if global_sequences % m == 0]
    levels: tuple[Checkpointing, ...] = (
        (asked.activation_checkpointing,) if grow else ("none", "selective", "full"))
    for checkpointing in levels:
        for micro in micro_batches:
            plan = Plan(micro, global_sequences // micro, checkpointing)
            if estimate_memory(spec, world_size, plan, output_loss, dims, teacher,
                               teacher_dynamics, mesh).total <= gpu_bytes:
                return plan
    return None


def trained_model(spec: TrainingJobSpec) -> tuple[TrainingJobSpec, ModelDims]:
    """The job as the trainer builds it: its spec, and the model's dimensions. A model.init
    job's come from config.json (read through the storage layer, so sizing such a job
    needs the trainer extra), its INL dynamics too."""
    if spec.model.init is None and not spec.model.from_teacher:
        return spec, spec.model.resolve()
    from kubetrain.trainer.pretrained_config import trained_model as from_config

    return from_config(spec)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="TrainingJob manifest")
    parser.add_argument("--gpu-memory", type=float, default=80.0, metavar="GiB",
                        help="memory of one GPU in GiB (default 80, an H100)")
    parser.add_argument("--world-size", type=int, default=None, metavar="N",
                        help="training processes (default replicas x procsPerWorker)")


def run(args: argparse.Namespace) -> int:
    try:
        job = load_job(args.file)
    except InvalidManifest as error:
        print(f"kubetrain estimate: {error}", file=sys.stderr)
        return 2
    if job.spec.own_code:
        print(f"kubetrain estimate: {args.file} runs your own code (spec.trainer), whose model "
              "and batch kubetrain cannot see, so it cannot size its memory: estimate sizes "
              "kubetrain's trainer (spec.model, spec.optimization). Measure your script's "
              "peak instead (torch.cuda.max_memory_allocated after a few steps).",
              file=sys.stderr)
        return 2
    try:
        spec, dims = trained_model(job.spec)
        teacher, teacher_dynamics = teacher_model(spec)
    except (ValueError, OSError) as error:  # a config.json: unreadable or refused
        print(f"kubetrain estimate: {error}", file=sys.stderr)
        return 2
    world_size = args.world_size or spec.workers.replicas * spec.workers.procs_per_worker
    gpu_bytes = int(args.gpu_memory * GIB)
    try:
        if spec.parallelism.strategy == "auto":
            mesh, why = auto_shape(spec, dims, world_size, gpu_bytes)
            chosen = f"parallelism.strategy auto chose {mesh.describe()}: {why}\n"
        else:
            mesh, chosen = spec_mesh(spec, world_size), ""
    except MeshError as error:
        print(f"kubetrain estimate: {error}", file=sys.stderr)
        return 2
    plan = job_plan(spec, world_size, mesh)
    estimate = estimate_memory(spec, world_size, plan, dims=dims, teacher=teacher,
                               teacher_dynamics=teacher_dynamics, mesh=mesh)
    print(_describe(spec, world_size, plan, dims, teacher, teacher_dynamics, mesh) + chosen)
    print(_table(spec, mesh, estimate))
    fits = estimate.total <= gpu_bytes
    verdict = "fits" if fits else "does NOT fit"
    print(f"  {verdict} in {args.gpu_memory:g} GiB ({estimate.total / gpu_bytes:.0%} of it)")
    meshes = mesh_estimates(spec, world_size, dims, teacher, teacher_dynamics)
    print(_mesh_table(meshes, mesh, gpu_bytes))
    tier_fits = _memory_tier(spec, dims, world_size)
    _checkpoint_staging(spec, dims, world_size, gpu_bytes - estimate.total, gpu_bytes)
    if fits:
        larger = recommend(spec, world_size, gpu_bytes, dims=dims, teacher=teacher,
                           teacher_dynamics=teacher_dynamics, grow=True, mesh=mesh)
        if larger is not None and larger.micro_batch_size > plan.micro_batch_size:
            total = estimate_memory(spec, world_size, larger, dims=dims, teacher=teacher,
                                    teacher_dynamics=teacher_dynamics, mesh=mesh).total
            print(f"\nThe memory left over fits a larger micro-batch, the same global batch "
                  f"({total / GIB:.1f} GiB per GPU; larger micro-batches run faster):\n"
                  + _plan_lines(larger))
        return 0 if tier_fits else 1
    other = next(((shape, total) for shape, total in meshes if total <= gpu_bytes), None)
    if other is not None:
        print(f"\n{other[0].describe()} fits at the job's micro-batch ({other[1] / GIB:.1f} GiB "
              f"per GPU):\n" + _mesh_lines(other[0]))
    better = recommend(spec, world_size, gpu_bytes, dims=dims, teacher=teacher,
                       teacher_dynamics=teacher_dynamics, mesh=mesh)
    if better is None:
        if other is None:
            print(f"\nNothing fits {args.gpu_memory:g} GiB with {world_size} processes: use "
                  "more processes (workers.replicas or procsPerWorker) with strategy fsdp, or "
                  "a smaller model.")
        return 1
    total = estimate_memory(spec, world_size, better, dims=dims, teacher=teacher,
                            teacher_dynamics=teacher_dynamics, mesh=mesh).total
    print(f"\nRecommended for {args.gpu_memory:g} GiB ({total / GIB:.1f} GiB per GPU):\n"
          + _plan_lines(better))
    return 1


def _memory_tier(spec: TrainingJobSpec, dims: ModelDims, world_size: int) -> bool:
    """Print spec.checkpoint.memory's host memory per worker pod on its own line (it is pod
    memory, not GPU memory: memory_budget's shard x versions x (1 + replicas) x processes);
    False, after saying why with the numbers, when it exceeds maxWorkerMemory. The spec's
    own validation refuses that already where the spec sizes the model; a model.init job's
    size is known only here, from its config.json."""
    if spec.checkpoint.memory is None:
        return True
    from kubetrain.memory_budget import parse_quantity, tier_budget

    parameters = (ssm_parameter_count(dims) if spec.model.architecture == "ssm"
                  else parameter_count(dims, spec.model.dynamics.enabled))
    sized = tier_budget(spec, parameters=parameters)  # at minReplicas, as the operator sizes
    assert sized is not None  # a tier and a parameter count
    print(f"\n  {'host memory per worker pod (not GPU)':<40}{'GiB':>8}")
    print(f"  {'in-memory checkpoints (checkpoint.memory)':<40}"
          f"{sized.per_worker / GIB:>8.2f}\n    {sized.describe()}")
    here = tier_budget(spec, world_size=world_size, parameters=parameters)
    if here is not None and here.per_worker != sized.per_worker:
        print(f"  {'  at ' + str(world_size) + ' processes':<40}{here.per_worker / GIB:>8.2f}"
              "  (the operator sizes pods at minReplicas, where shards are largest)")
    limit = spec.checkpoint.memory.max_worker_memory
    if limit is None or sized.per_worker <= parse_quantity(limit):
        return True
    print(f"\n  does NOT fit spec.checkpoint.memory.maxWorkerMemory ({limit}, "
          f"{parse_quantity(limit) / GIB:.2f} GiB): the tier needs {sized.describe()}. Lower "
          "checkpoint.memory.replicas, run more workers (minReplicas) to shard the state "
          "further, or raise maxWorkerMemory.")
    return False


def _checkpoint_staging(spec: TrainingJobSpec, dims: ModelDims, world_size: int, free: int,
                        gpu_bytes: int) -> None:
    """Print how each checkpoint tier will stage its snapshots on a GPU (staging.py): a
    device-side first phase where the `free` GPU memory this estimate leaves keeps
    memory_budget's headroom after a state shard (the tiers take theirs in the order they
    first snapshot: S3 first on a tie, as the loop saves), else the overlapped host copy;
    and, with checkpoint.async, the S3 tier's staging buffer in host memory per pod. The
    trainer decides from the GPU's own free memory at each tier's first snapshot and logs it."""
    from kubetrain.memory_budget import (
        device_headroom,
        device_phase_fits,
        staging_budget,
        state_bytes,
    )

    checkpoint = spec.checkpoint
    tiers = [(every, name) for every, name, on in (
        (checkpoint.every_steps, "S3 checkpoints (checkpoint.async)", checkpoint.async_),
        (checkpoint.memory.every_steps if checkpoint.memory else 0,
         "in-memory checkpoints (checkpoint.memory)", checkpoint.memory is not None),
    ) if on]
    if not tiers:
        return
    parameters = (ssm_parameter_count(dims) if spec.model.architecture == "ssm"
                  else parameter_count(dims, spec.model.dynamics.enabled))
    shard, headroom = state_bytes(spec, parameters, world_size), device_headroom(gpu_bytes)
    print(f"\n  checkpoint staging on the GPU: {shard / GIB:.2f} GiB state shard per process, "
          f"{headroom / GIB:.2f} GiB kept free\n  (the trainer decides from the GPU's free "
          "memory at each tier's first snapshot, and logs it)")
    for _, name in sorted(tiers, key=lambda tier: tier[0]):
        if device_phase_fits(free, shard, gpu_bytes):
            path = f"device-side first phase ({free / GIB:.2f} GiB free before it)"
            free -= shard
        else:
            path = (f"overlapped host copy ({max(free, 0) / GIB:.2f} GiB free: too little for a "
                    "device-side first phase)")
        print(f"  {name}\n    {path}")
    staged = staging_budget(spec, world_size=world_size, parameters=parameters)
    if staged is not None:
        sized = staging_budget(spec, parameters=parameters)  # at minReplicas, as the operator
        assert sized is not None
        print(f"\n  {'host memory per worker pod (not GPU)':<40}{'GiB':>8}\n"
              f"  {'S3 staging buffer (checkpoint.async)':<40}{sized.per_worker / GIB:>8.2f}"
              f"\n    {sized.describe()}")
        if staged.per_worker != sized.per_worker:
            print(f"  {'  at ' + str(world_size) + ' processes':<40}"
                  f"{staged.per_worker / GIB:>8.2f}  (the operator sizes pods at minReplicas)")


def mesh_estimates(spec: TrainingJobSpec, world_size: int, dims: ModelDims,
                   teacher: ModelDims | None = None, teacher_dynamics: bool = False
                   ) -> list[tuple[MeshShape, int]]:
    """Bytes per GPU at the job's plan under every mesh the pod shape allows: fsdp, hsdp
    (several pods), and each with every tensor-parallel degree the model and the pod allow."""
    procs = spec.workers.procs_per_worker
    several_pods = world_size > procs and world_size % procs == 0
    strategies: list[Strategy] = ["fsdp", "hsdp"] if several_pods else ["fsdp"]
    found = []
    for degree in (1, *TENSOR_PARALLEL_DEGREES):
        if degree > procs or procs % degree or (
                degree > 1 and not tensor_parallel_allowed(spec, dims, degree)):
            continue
        parallelism = spec.parallelism.model_copy(update={"tensor_parallel": degree})
        for strategy in strategies:
            shape = mesh_shape(parallelism, procs, world_size, strategy)
            plan = job_plan(spec, world_size, shape)
            found.append((shape, estimate_memory(spec, world_size, plan, dims=dims,
                                                 teacher=teacher,
                                                 teacher_dynamics=teacher_dynamics,
                                                 mesh=shape).total))
    return found


def _mesh_table(meshes: list[tuple[MeshShape, int]], chosen: MeshShape, gpu_bytes: int) -> str:
    lines = ["\n  per GPU under each mesh (the job's micro-batch and checkpointing)"]
    for shape, total in meshes:
        mark = "  <- the job's" if shape == chosen else ""
        verdict = "fits" if total <= gpu_bytes else "does not fit"
        lines.append(f"  {shape.describe():<40}{total / GIB:>8.2f}  {verdict}{mark}")
    return "\n".join(lines)


def _mesh_lines(shape: MeshShape) -> str:
    return (f"  parallelism.strategy: {shape.strategy}\n"
            f"  parallelism.tensorParallel: {shape.tensor_parallel}")


def _plan_lines(plan: Plan) -> str:
    return (f"  optimization.microBatchSize: {plan.micro_batch_size}\n"
            f"  optimization.gradientAccumulationSteps: {plan.gradient_accumulation}\n"
            f"  parallelism.activationCheckpointing: {plan.activation_checkpointing}")


def _describe(spec: TrainingJobSpec, world_size: int, plan: Plan, dims: ModelDims,
              teacher: ModelDims | None, teacher_dynamics: bool, mesh: MeshShape) -> str:
    name = (f"model.init {spec.model.init}" if spec.model.init
            else "custom model" if spec.model.preset == "custom" else spec.model.preset)
    if spec.model.architecture != "ssm" and dims.family != "llama":
        name += f" ({dims.family})"
    dynamics = " with INL dynamics" if spec.model.dynamics.enabled else ""
    if spec.model.architecture == "ssm":
        return _describe_ssm(spec, world_size, plan, dims, name, teacher, mesh)
    distilling = ""
    if teacher is not None and spec.distillation is not None:
        with_dynamics = " with INL dynamics" if teacher_dynamics else ""
        distilling = (f"distilled from a {parameter_count(teacher, teacher_dynamics) / 1e9:.2f}"
                      f"B-parameter teacher{with_dynamics} ({spec.distillation.teacher})\n")
    return (f"{name}{dynamics}: {parameter_count(dims, spec.model.dynamics.enabled) / 1e9:.2f}B "
            f"parameters, {world_size} processes, "
            f"{mesh.describe()}, {spec.parallelism.precision}, activation "
            f"checkpointing {plan.activation_checkpointing}\n"
            f"micro-batch {plan.micro_batch_size} x {spec.data.seq_len} tokens, "
            f"{plan.gradient_accumulation} accumulation steps\n{distilling}")


def _table(spec: TrainingJobSpec, mesh: MeshShape, estimate: MemoryEstimate) -> str:
    shards = mesh.parameter_shards
    share = f", 1/{shards} each" if shards > 1 else ""
    # The teacher is never split by tensor parallelism (the API refuses distillation with it).
    teacher_share = f", 1/{mesh.shard} each" if shards > 1 else ""
    rows = [
        (f"parameters (fp32{share})", estimate.parameters),
        (f"gradients (fp32{share})", estimate.gradients),
        (f"optimizer {spec.optimization.optimizer} state{share}", estimate.optimizer),
        ("FSDP gathered blocks", estimate.fsdp_working_set),
        ("autocast weight copies", estimate.weight_copies),
        ("activations", estimate.activations),
        ("output projection and loss (chunked)", estimate.logits),
        *([(f"distillation teacher ({spec.parallelism.precision}{teacher_share})",
            estimate.teacher)]
          if spec.distillation is not None else []),
        ("CUDA context and slack", estimate.context),
    ]
    lines = [f"  {'per GPU':<40}{'GiB':>8}"]
    lines += [f"  {label:<40}{size / GIB:>8.2f}" for label, size in rows]
    lines.append(f"  {'total':<40}{estimate.total / GIB:>8.2f}")
    return "\n".join(lines)


def _describe_ssm(spec: TrainingJobSpec, world_size: int, plan: Plan, dims: ModelDims,
                  name: str, teacher: ModelDims | None, mesh: MeshShape) -> str:
    """`_describe` for a state-space model: its parameters and its generation state."""
    if spec.model.from_teacher and spec.distillation is not None:
        name = f"sized from the teacher {spec.distillation.teacher}"
    distilling = ""
    if teacher is not None and spec.distillation is not None:
        distilling = (f"distilled from a {parameter_count(teacher) / 1e9:.2f}B-parameter "
                      f"teacher ({spec.distillation.teacher})\n")
    state = 4 * ssm_state_elements(dims)
    return (f"state-space model, {name}: {ssm_parameter_count(dims) / 1e9:.2f}B parameters, "
            f"{world_size} processes, {mesh.describe()}, "
            f"{spec.parallelism.precision}, activation checkpointing "
            f"{plan.activation_checkpointing}\n"
            f"micro-batch {plan.micro_batch_size} x {spec.data.seq_len} tokens, "
            f"{plan.gradient_accumulation} accumulation steps\n"
            f"generation state {state / 1024**2:.2f} MiB per sequence (fp32), at any "
            f"context length\n{distilling}")


def auto_shape(spec: TrainingJobSpec, dims: ModelDims, world_size: int,
               gpu_bytes: int | None) -> tuple[MeshShape, str]:
    """`strategy: auto`'s mesh for `world_size` processes and a GPU of `gpu_bytes` (None: no
    bound, on CPU), and why: see `kubetrain.trainer.mesh`'s
    docstring for the rule. Here, beside the estimate it asks, which asks it back for
    `kubetrain estimate`'s report."""
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
