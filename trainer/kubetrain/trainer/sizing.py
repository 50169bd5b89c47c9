"""Model size arithmetic: parameter count and training FLOPs per token of a ModelDims.

Torch-free, so the memory planner (`kubetrain estimate`) and the trainer's MFU
share one definition, and so do the loss (loss.py) and the planner for the loss's
chunk size; `model.py` builds exactly the parameters counted here (a
test checks the two agree). `dynamics` says whether the blocks carry INL
dynamics (`model.dynamics.enabled`), which are not part of ModelDims.
"""

from __future__ import annotations

from kubetrain.api.trainingjob import ModelDims

CONTROLLER_WIDTH = 64  # hidden width of the INL dynamics controller (model.Dynamics)

CHUNK_LOGITS_BYTES = 256 * 1024**2  # fp32 logits of one loss chunk: 523 tokens of a 128k vocabulary


def loss_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk of the chunked loss (loss.py): about `CHUNK_LOGITS_BYTES` of fp32 logits."""
    return max(1, CHUNK_LOGITS_BYTES // (4 * vocab_size))


def distillation_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk of the distillation loss (loss.py): each token has two rows of logits
    (student and teacher), so half the tokens of a cross-entropy chunk hold the same bytes."""
    return max(1, CHUNK_LOGITS_BYTES // (8 * vocab_size))


def dynamics_parameter_count(dim: int) -> int:
    """Parameters of one block's INL dynamics: mu and the two-layer controller (with biases)."""
    return dim + (dim * CONTROLLER_WIDTH + CONTROLLER_WIDTH) + (CONTROLLER_WIDTH * 3 * dim
                                                                + 3 * dim)


def block_parameter_count(dims: ModelDims, dynamics: bool = False) -> int:
    """Parameters of one transformer block: attention, SwiGLU feed-forward, two RMSNorms
    and, with `dynamics`, the INL controller."""
    head_dim = dims.dim // dims.n_heads
    attention = 2 * dims.dim * dims.dim + 2 * dims.dim * dims.n_kv_heads * head_dim
    feed_forward = 3 * dims.dim * dims.ffn_dim
    norms = 2 * dims.dim
    controller = dynamics_parameter_count(dims.dim) if dynamics else 0
    return attention + feed_forward + norms + controller


def parameter_count(dims: ModelDims, dynamics: bool = False) -> int:
    """All parameters of the model, a tied embedding counted once."""
    embedding = dims.vocab_size * dims.dim
    output = 0 if dims.tie_embeddings else dims.vocab_size * dims.dim
    final_norm = dims.dim
    return (embedding + dims.n_layers * block_parameter_count(dims, dynamics) + final_norm
            + output)


def flops_per_token(dims: ModelDims, seq_len: int, dynamics: bool = False) -> int:
    """Training FLOPs (forward + backward) per token, as torchtitan and nanoGPT count them.

    6·N for the matrix multiplies of the N parameters that take part in one
    (an untied input embedding is a lookup, not a matmul, so it is left out),
    plus 12·L·H·Q·T for the attention scores and their weighted sum
    (L layers, H heads, Q head size, T sequence length).
    """
    matmul_parameters = parameter_count(dims, dynamics)
    if not dims.tie_embeddings:
        matmul_parameters -= dims.vocab_size * dims.dim
    head_dim = dims.dim // dims.n_heads
    attention = 12 * dims.n_layers * dims.n_heads * head_dim * seq_len
    return 6 * matmul_parameters + attention
