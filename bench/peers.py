"""The trainers a kubetrain user would pick instead, as peers for bench/mfu.py.

    python bench/peers.py --peer hf --liger --compile [--checkpointing full] \\
        [--micro-batch 16] [--steps 12] [--result out.json]
    python bench/peers.py --peer torchtitan --compile --checkpointing selective
    python bench/peers.py --cpu --peer hf        # tiny dimensions on the CPU: checks the harness

- `hf`: Hugging Face transformers' `LlamaForCausalLM`, optionally with Liger Kernel's
  Llama patches (fused linear cross-entropy, RMSNorm, SwiGLU, RoPE), torch.compile of
  each decoder layer and gradient checkpointing: the usual fine-tuning stack.
- `torchtitan`: torchtitan's own Llama 3 model, made ready by its own
  `parallelize_llama` (activation checkpointing, then per-block compile, as its
  trainer does; on one GPU FSDP is not applied and the step runs under bf16 autocast,
  as torchtitan's trainer does on one device), with its cross-entropy loss compiled.

Every peer trains the llama-1b dimensions (vocabulary 128256, tied embeddings) the way
kubetrain trains in one process: fp32 master weights under bf16 autocast, fused AdamW,
gradient clipping at 1.0, on random token ids. Throughput is wall time over the timed
steps after a synchronised warm-up (compile included in the warm-up); MFU uses
kubetrain's own formula (`sizing.flops_per_token`, `metrics.peak_flops`); peak memory
is the allocator's peak reservation plus what the process holds outside it, as
bench/mfu.py measures kubetrain. The result (one JSON object) says `ok`, `oom` (the
combination does not fit) or `unavailable` (the peer's packages do not import here, with
why). Peer code lives here only, never in the product.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kubetrain.api.presets import PRESETS
from kubetrain.api.trainingjob import ModelDims
from kubetrain.sizing import flops_per_token
from kubetrain.trainer.metrics import peak_flops

LLAMA_1B = PRESETS["llama-1b"].dims
CPU_DIMS = ModelDims(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=2048, ffn_dim=192,
                     tie_embeddings=True, rope_theta=500_000.0)
WARM_UP_STEPS = 3  # compile, autotuning and the allocator settle here
LEARNING_RATE = 3e-4
CLIP_NORM = 1.0

# One training step: token ids [batch, seq + 1] in (inputs and their next tokens), the
# loss (already backpropagated and stepped) out.
Step = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class PeerResult:
    variant: str
    status: str  # ok | oom | unavailable | failed
    reason: str = ""
    tokens_per_second: float = 0.0
    mfu: float = 0.0
    step_time: float = 0.0
    peak: int = 0
    peak_allocated: int = 0
    loss: float = 0.0


def variant_name(peer: str, liger: bool, compile_: bool, checkpointing: str) -> str:
    parts = [peer] + (["liger"] if liger else []) + (["compile"] if compile_ else [])
    if checkpointing != "none":
        parts.append(f"ac-{checkpointing}")
    return "+".join(parts)


def parse_variant(name: str) -> dict[str, Any]:
    """The options `variant_name` encoded: hf+liger+compile+ac-full → peer hf, liger, ..."""
    peer, *parts = name.split("+")
    unknown = set(parts) - {"liger", "compile", "ac-selective", "ac-full"}
    if peer not in ("hf", "torchtitan") or unknown:
        raise ValueError(f"{name!r} is not a peer variant (hf or torchtitan, then any of "
                         "+liger, +compile, +ac-selective, +ac-full)")
    checkpointing = next((part[3:] for part in parts if part.startswith("ac-")), "none")
    return {"peer": peer, "liger": "liger" in parts, "compile_": "compile" in parts,
            "checkpointing": checkpointing}


def hf_step(dims: ModelDims, seq_len: int, device: torch.device, liger: bool, compile_: bool,
            checkpointing: str) -> Step:
    """transformers' Llama, trained as a user of the HF stack would train it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        # Patches the classes, so it comes before the model is built.
        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=True)
    config = LlamaConfig(
        vocab_size=dims.vocab_size, hidden_size=dims.dim, intermediate_size=dims.ffn_dim,
        num_hidden_layers=dims.n_layers, num_attention_heads=dims.n_heads,
        num_key_value_heads=dims.n_kv_heads, max_position_embeddings=seq_len,
        rms_norm_eps=dims.norm_eps, tie_word_embeddings=dims.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": dims.rope_theta},
        use_cache=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(device)  # fp32 master weights
    model.train()
    if checkpointing == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif checkpointing != "none":
        raise ValueError(f"the hf peer checkpoints every layer or none, not {checkpointing!r}")
    if compile_:
        # Each decoder layer, as kubetrain and torchtitan compile theirs. Compiling the whole
        # model breaks on Liger's fused loss under torch 2.11 (dynamo cannot trace its
        # in-place addmm with out_dtype) and would put the loss inside the graph besides.
        for layer in model.model.layers:
            layer.compile()

    def loss_of(tokens: torch.Tensor) -> torch.Tensor:
        # transformers shifts the labels itself: the first seq tokens are both.
        inputs = tokens[:, :-1]
        return model(input_ids=inputs, labels=inputs).loss

    return training_step(model, loss_of, device)


def torchtitan_step(dims: ModelDims, seq_len: int, device: torch.device, compile_: bool,
                    checkpointing: str) -> Step:
    """torchtitan's Llama 3 through its own parallelize_llama, on a world of one."""
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs, parallelize_llama

    head_dim = dims.dim // dims.n_heads
    assert dims.ffn_dim % 256 == 0
    # torchtitan derives the SwiGLU width: 2/3 of 4·dim, times the multiplier, rounded up to
    # multiple_of. This multiplier gives the preset's width exactly.
    multiplier = dims.ffn_dim / int(2 * 4 * dims.dim / 3)
    args = TransformerModelArgs(
        dim=dims.dim, n_layers=dims.n_layers, n_heads=dims.n_heads, n_kv_heads=dims.n_kv_heads,
        vocab_size=dims.vocab_size, multiple_of=min(256, dims.ffn_dim),
        ffn_dim_multiplier=multiplier, norm_eps=dims.norm_eps, rope_theta=dims.rope_theta,
        max_seq_len=seq_len)
    with torch.device("meta"):
        model = Transformer(args)
    assert model.layers["0"].feed_forward.w1.out_features == dims.ffn_dim, "SwiGLU width"
    assert head_dim * dims.n_heads == dims.dim

    job = JobConfig()
    job.training.seq_len = seq_len
    job.training.mixed_precision_param = "bfloat16"
    job.compile.enable = compile_
    job.compile.components = ["model", "loss"] if compile_ else []
    job.activation_checkpoint.mode = checkpointing
    job.activation_checkpoint.selective_ac_option = "op"
    parallel_dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1,
                                 world_size=1)
    model = parallelize_llama(model, parallel_dims, job)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    if dims.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.train()
    loss_fn = torch.compile(cross_entropy_loss) if compile_ else cross_entropy_loss

    def loss_of(tokens: torch.Tensor) -> torch.Tensor:
        return loss_fn(model(tokens[:, :-1]), tokens[:, 1:])

    return training_step(model, loss_of, device)


def training_step(model: torch.nn.Module, loss_of: Callable[[torch.Tensor], torch.Tensor],
                  device: torch.device) -> Step:
    """kubetrain's one-process recipe around a peer's loss: the loss under bf16 autocast
    over fp32 weights, backward, clipping at CLIP_NORM, a fused AdamW step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE,
                                  fused=device.type == "cuda")

    def step(tokens: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_of(tokens)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def measure(step: Step, dims: ModelDims, seq_len: int, micro_batch: int, steps: int,
            device: torch.device) -> PeerResult:
    """Time `steps` training steps after the warm-up; the result without its name."""
    generator = torch.Generator(device="cpu").manual_seed(0)

    def batch() -> torch.Tensor:
        ids = torch.randint(dims.vocab_size, (micro_batch, seq_len + 1), generator=generator)
        return ids.to(device, non_blocking=True)

    for _ in range(WARM_UP_STEPS):
        step(batch())
    synchronize(device)
    started = time.perf_counter()
    for _ in range(steps):
        loss = step(batch())
    synchronize(device)
    elapsed = time.perf_counter() - started
    tokens_per_second = steps * micro_batch * seq_len / elapsed
    peak = peak_flops(device)
    return PeerResult(
        variant="", status="ok", tokens_per_second=tokens_per_second,
        mfu=flops_per_token(dims, seq_len) * tokens_per_second / peak if peak else 0.0,
        step_time=elapsed / steps, loss=float(loss), **peak_memory(device))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory(device: torch.device) -> dict[str, int]:
    """The peak as bench/mfu.py measures kubetrain's: the allocator's peak reservation
    plus what the process holds outside the allocator (CUDA context, cuBLAS workspaces)."""
    if device.type != "cuda":
        return {"peak": 0, "peak_allocated": 0}
    free, total = torch.cuda.mem_get_info(device)
    outside = (total - free) - torch.cuda.memory_reserved(device)
    return {"peak": torch.cuda.max_memory_reserved(device) + outside,
            "peak_allocated": torch.cuda.max_memory_allocated(device)}


def run(peer: str, liger: bool, compile_: bool, checkpointing: str, micro_batch: int,
        steps: int, cpu: bool) -> PeerResult:
    name = variant_name(peer, liger, compile_, checkpointing)
    device = torch.device("cpu" if cpu else "cuda")
    dims, seq_len = (CPU_DIMS, 128) if cpu else (LLAMA_1B, 2048)
    torch.manual_seed(0)
    try:
        if peer == "hf":
            step = hf_step(dims, seq_len, device, liger, compile_, checkpointing)
        else:
            step = torchtitan_step(dims, seq_len, device, compile_, checkpointing)
    except ImportError as error:
        return PeerResult(name, "unavailable", f"{type(error).__name__}: {error}")
    try:
        result = measure(step, dims, seq_len, micro_batch, steps, device)
    except torch.OutOfMemoryError:
        return PeerResult(name, "oom", f"out of memory at micro-batch {micro_batch}",
                          **peak_memory(device))
    result.variant = name
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", choices=("hf", "torchtitan"), required=True)
    parser.add_argument("--liger", action="store_true", help="hf: Liger Kernel's Llama patches")
    parser.add_argument("--compile", action="store_true", help="torch.compile")
    parser.add_argument("--checkpointing", choices=("none", "selective", "full"),
                        default="none", help="activation checkpointing (hf: none or full)")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12, help="timed steps after the warm-up")
    parser.add_argument("--cpu", action="store_true",
                        help="tiny dimensions on the CPU, to check the harness")
    parser.add_argument("--result", help="write the result here as JSON")
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        print("bench/peers.py measures GPU throughput and needs CUDA (or --cpu): skipped.")
        return 0
    try:
        result = run(args.peer, args.liger, args.compile, args.checkpointing,
                     args.micro_batch, args.steps, args.cpu)
    except Exception as error:  # a peer that breaks is reported, not fatal to the table
        traceback.print_exc()
        result = PeerResult(variant_name(args.peer, args.liger, args.compile,
                                         args.checkpointing),
                            "failed", f"{type(error).__name__}: {error}"[:500])
    print(json.dumps(asdict(result)), flush=True)
    if args.result:
        Path(args.result).write_text(json.dumps(asdict(result)))
    return 0 if result.status in ("ok", "oom", "unavailable") else 1


if __name__ == "__main__":
    sys.exit(main())
