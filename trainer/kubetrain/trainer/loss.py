"""The output projection and next-token cross-entropy, without holding the full logits.

A model's last hidden states [tokens, dim] times the output weight [vocab, dim]
make logits [tokens, vocab]: with a 128k vocabulary, 8 x 2048 tokens of fp32
logits are 8 GiB, and autograd keeps them, their fp32 copy and their gradient.
Every implementation here takes the hidden states, the weight and the targets
and returns the summed token loss in fp32; they differ only in what they hold:

- `full`: the plain computation (logits, then `F.cross_entropy`): the reference.
- `chunked`: pure PyTorch, runs everywhere. The tokens are cut into chunks of
  about 256 MiB of fp32 logits (`sizing.loss_chunk_tokens`); each chunk is activation-
  checkpointed, so forward keeps only its inputs and backward recomputes one
  chunk's logits at a time (one extra output matmul in exchange for the memory).
- `liger`: Liger Kernel's fused linear cross-entropy (CUDA, when `liger-kernel`
  is installed): chunked too, with the gradients computed in forward and no
  recomputation.

Knowledge distillation (`distillation_loss`) has the same shape with a second,
frozen weight: (1 - alpha) * CE(student, labels) + alpha * T^2 * KL(softmax(teacher /
T) || softmax(student / T)), summed over tokens. It is chunked and checkpointed the
same way, the teacher's logits too: forward keeps, per chunk, only the two models'
hidden states [chunk, dim] and the weights, and backward recomputes one chunk's
student and teacher logits at a time (two extra output matmuls, one for each model).
Its chunks are half as long (`sizing.distillation_chunk_tokens`), since each token has
two rows of logits. What it holds beyond the plain loss: the teacher's final hidden
states of the micro-batch ([tokens, dim], compute dtype) and the teacher's output
weight, whole ([vocab, dim], compute dtype), from the teacher's forward until the
student's backward; at the peak one chunk of teacher logits, their fp32 copy and the
two log-softmaxes at temperature T.

`select_output_loss` picks one: `liger` on CUDA when it imports, else `chunked`;
`KUBETRAIN_OUTPUT_LOSS=full|chunked|liger` overrides the choice (for
benchmarks and diagnosis). The matmul runs in the autocast dtype when autocast
is on, as `nn.Linear` would; the softmax and the loss are fp32. This module owns
the loss arithmetic only: the model calls it, the loop chooses it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from kubetrain.sizing import distillation_chunk_tokens, loss_chunk_tokens

OUTPUT_LOSS_ENV = "KUBETRAIN_OUTPUT_LOSS"
LIGER_MODULE = "liger_kernel.transformers.functional"

OutputLossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class OutputLoss:
    """A named implementation: `fn(hidden [N, dim], weight [vocab, dim], targets [N])`."""

    name: str
    fn: OutputLossFn

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor,
                 targets: torch.Tensor) -> torch.Tensor:
        return self.fn(hidden, weight, targets)


def full_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor,
                       targets: torch.Tensor) -> torch.Tensor:
    """Summed token loss through the whole logits tensor (what `nn.Linear` + CE would do)."""
    dtype = _compute_dtype(hidden, weight)
    return _chunk_loss(hidden.to(dtype), weight, targets, dtype)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          chunk: int | None = None) -> torch.Tensor:
    """Summed token loss, one checkpointed chunk of `chunk` tokens at a time."""
    dtype = _compute_dtype(hidden, weight)
    hidden = hidden.to(dtype)
    chunk = chunk or loss_chunk_tokens(weight.shape[0])
    return _per_chunk(_chunk_loss, [
        (h, weight, t, dtype)
        for h, t in zip(hidden.split(chunk), targets.split(chunk), strict=True)]).sum()


def liger_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor,
                        targets: torch.Tensor) -> torch.Tensor:
    """Summed token loss through Liger Kernel's fused linear cross-entropy (CUDA only)."""
    liger = importlib.import_module(LIGER_MODULE)  # optional: imported by name, untyped
    dtype = _compute_dtype(hidden, weight)
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    loss = liger.liger_fused_linear_cross_entropy(hidden, weight, targets, reduction="sum",
                                                  accum_dtype=torch.float32)
    return torch.as_tensor(loss).float()


@dataclass(frozen=True)
class DistillationLosses:
    """The distillation loss of some tokens, summed over them, and its two terms."""

    loss: torch.Tensor  # (1 - alpha) * ce + alpha * kd; autograd flows through it
    ce: torch.Tensor  # cross-entropy on the labels, detached
    kd: torch.Tensor  # T^2 * KL(teacher || student) at temperature T, detached


def distillation_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                      teacher_hidden: torch.Tensor, teacher_weight: torch.Tensor, *,
                      temperature: float, alpha: float,
                      chunk: int | None = None) -> DistillationLosses:
    """Summed distillation loss of N tokens, one checkpointed chunk of `chunk` tokens at a time.

    `hidden` [N, dim] and `weight` [vocab, dim] are the student's final hidden states
    and output weight, `teacher_hidden` [N, teacher dim] and `teacher_weight` [vocab,
    teacher dim] the teacher's (no gradient reaches them). Both models' logits are
    computed in the student's compute dtype; the softmaxes and the loss are fp32.
    """
    dtype = _compute_dtype(hidden, weight)
    hidden = hidden.to(dtype)
    teacher_hidden, teacher_weight = teacher_hidden.detach(), teacher_weight.detach()
    chunk = chunk or distillation_chunk_tokens(weight.shape[0])
    pieces = zip(hidden.split(chunk), targets.split(chunk), teacher_hidden.split(chunk),
                 strict=True)
    ce, kd = _per_chunk(_distillation_chunk, [
        (h, weight, t, th, teacher_weight, dtype, temperature)
        for h, t, th in pieces]).sum(0).unbind()
    return DistillationLosses((1 - alpha) * ce + alpha * kd, ce.detach(), kd.detach())


IMPLEMENTATIONS: dict[str, OutputLossFn] = {
    "full": full_cross_entropy, "chunked": chunked_cross_entropy, "liger": liger_cross_entropy,
}


def select_output_loss(device: torch.device) -> tuple[OutputLoss, str]:
    """The implementation for `device` and a sentence saying why it was chosen."""
    asked = os.environ.get(OUTPUT_LOSS_ENV, "auto")
    if asked not in (*IMPLEMENTATIONS, "auto"):
        raise ValueError(f"{OUTPUT_LOSS_ENV}={asked!r} is not one of auto, "
                         f"{', '.join(IMPLEMENTATIONS)}")
    if asked != "auto":
        if asked == "liger" and device.type != "cuda":
            raise ValueError(f"{OUTPUT_LOSS_ENV}=liger needs a CUDA device, not {device.type}")
        return OutputLoss(asked, IMPLEMENTATIONS[asked]), f"set by {OUTPUT_LOSS_ENV}"
    if device.type != "cuda":
        return OutputLoss("chunked", chunked_cross_entropy), "Liger Kernel needs CUDA"
    try:
        importlib.import_module(LIGER_MODULE)
    except ImportError as error:
        return (OutputLoss("chunked", chunked_cross_entropy),
                f"liger-kernel is not importable ({error}); pip install 'kubetrain[gpu]'")
    return OutputLoss("liger", liger_cross_entropy), "liger-kernel is installed"


def preload_fused_loss(module: str = LIGER_MODULE) -> bool:
    """Import Liger Kernel's loss in a process that must leave CUDA untouched (the fork
    server, kubetrain.trainer.preload), where it is installed; True if it imported
    without asking for CUDA.

    Liger asks `torch.cuda.is_available()` as it loads: NVML's answer
    (PYTORCH_NVML_BASED_CUDA_CHECK) leaves CUDA untouched, the driver's would not, and a
    fork server that touched CUDA forks ranks that cannot use it. Anything that goes on
    to initialise CUDA during the import is refused with an ImportError: with peft
    installed, liger_kernel.utils imports it, and through transformers torchao asks
    Triton whether the GPU fits (seen on an H100). The libraries on that path catch the
    refusal and load on, so Liger is still imported, but False says a library decided
    without the GPU; where the refusal is not caught, Liger is left for the rank to
    import after its preflight (5 s of a restart in that image).
    """
    if importlib.util.find_spec(module.partition(".")[0]) is None:
        return False
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    lazy_init = torch.cuda._lazy_init
    refused: list[str] = []

    def refuse() -> None:
        refused.append(module)
        raise ImportError(f"{module} is imported where CUDA must stay uninitialised")

    torch.cuda._lazy_init = refuse  # torch.cuda's functions look it up as a module global
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    finally:
        torch.cuda._lazy_init = lazy_init
    return not refused


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype `nn.Linear` would compute in: autocast's when it is on."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _per_chunk(fn: Callable[..., torch.Tensor], calls: list[tuple[Any, ...]]) -> torch.Tensor:
    """`fn(*args)` for each chunk's arguments, stacked. Under autograd with several chunks
    each call is checkpointed, so backward recomputes its logits instead of keeping them;
    with no backward (evaluation) or a single chunk there is nothing to gain by it."""
    if not torch.is_grad_enabled() or len(calls) == 1:
        return torch.stack([fn(*args) for args in calls])
    return torch.stack([checkpoint(fn, *args, use_reentrant=False) for args in calls])


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    # The weight is cast inside the chunk, so the chunks' weight gradients add up in
    # the weight's own dtype (fp32 master weights under autocast), not in bf16.
    # The logits come out in the compute dtype (as nn.Linear's), the loss is fp32.
    with torch.autocast(hidden.device.type, enabled=False):
        logits = hidden @ weight.to(dtype).t()
    return F.cross_entropy(logits.float(), targets, reduction="sum")


def _distillation_chunk(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                        teacher_hidden: torch.Tensor, teacher_weight: torch.Tensor,
                        dtype: torch.dtype, temperature: float) -> torch.Tensor:
    """[cross-entropy, T^2 * KL(teacher || student)] of one chunk, each summed over its tokens."""
    with torch.autocast(hidden.device.type, enabled=False):
        logits = (hidden @ weight.to(dtype).t()).float()
        teacher_logits = (teacher_hidden.to(dtype) @ teacher_weight.to(dtype).t()).float()
    ce = F.cross_entropy(logits, targets, reduction="sum")
    # kl_div(log q, log p, log_target=True) sums p * (log p - log q): KL(p || q), p the teacher's.
    kd = F.kl_div(F.log_softmax(logits / temperature, dim=-1),
                  F.log_softmax(teacher_logits / temperature, dim=-1),
                  reduction="sum", log_target=True)
    return torch.stack((ce, kd * temperature**2))
