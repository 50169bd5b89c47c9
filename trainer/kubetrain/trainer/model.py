"""The Llama-style decoder every TrainingJob trains, in plain PyTorch.

RMSNorm, rotary position embeddings, grouped-query attention through
`F.scaled_dot_product_attention`, a SwiGLU feed-forward and optionally tied
input/output embeddings. Nothing here knows about parallelism, precision or
activation checkpointing: `parallelize.py` applies those from outside, so this
file reads like the architecture and nothing else. Parameter counts and FLOPs
per token live beside it in `sizing.py`. Dropout (off by default) acts on the
attention weights and on each residual branch's output, in training mode only.
Given targets, the model returns the summed token loss instead of the logits,
through `output_loss` (loss.py), which never holds the whole [tokens, vocab]
logits; the trainer picks the implementation.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kubetrain.api.trainingjob import ModelDims
from kubetrain.trainer.loss import OutputLoss, chunked_cross_entropy


class RMSNorm(nn.Module):
    """Root-mean-square normalisation with a learned per-channel scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 even when the block computes in bf16: the mean of squares underflows.
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rotary_tables(
    head_dim: int, max_seq_len: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, frequency) pair, each [max_seq_len, head_dim // 2]."""
    frequencies = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), frequencies)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs of x [batch, heads, seq, head_dim] by their position's angles."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal self-attention; n_kv_heads < n_heads shares each key/value head over a group."""

    def __init__(self, dims: ModelDims, dropout: float = 0.0) -> None:
        super().__init__()
        self.dropout = dropout  # on the attention weights, while training
        self.n_heads = dims.n_heads
        self.n_kv_heads = dims.n_kv_heads
        self.head_dim = dims.dim // dims.n_heads
        self.wq = nn.Linear(dims.dim, dims.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dims.dim, dims.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dims.dim, dims.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dims.n_heads * self.head_dim, dims.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads,
            dropout_p=self.dropout if self.training else 0.0,
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: attention, then feed-forward, each branch dropped out."""

    def __init__(self, dims: ModelDims, dropout: float = 0.0) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(dims.dim, dims.norm_eps)
        self.attention = Attention(dims, dropout)
        self.ffn_norm = RMSNorm(dims.dim, dims.norm_eps)
        self.feed_forward = FeedForward(dims.dim, dims.ffn_dim)
        # Identity when off: the model without dropout computes exactly what it did before.
        self.residual_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.residual_dropout(self.attention(self.attention_norm(x), cos, sin))
        return x + self.residual_dropout(self.feed_forward(self.ffn_norm(x)))


class Transformer(nn.Module):
    """Token ids [batch, seq] → next-token logits [batch, seq, vocab], or with targets
    [batch, seq] the summed fp32 cross-entropy of the next tokens (a scalar)."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, dims: ModelDims, max_seq_len: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.dims = dims
        self.max_seq_len = max_seq_len
        self.tok_embeddings = nn.Embedding(dims.vocab_size, dims.dim)
        # A ModuleList indexed by position, so parallelize() can wrap blocks one by one.
        self.layers = nn.ModuleList(TransformerBlock(dims, dropout)
                                    for _ in range(dims.n_layers))
        self.norm = RMSNorm(dims.dim, dims.norm_eps)
        self.output = nn.Linear(dims.dim, dims.vocab_size, bias=False)
        if dims.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Derived from the dimensions, never trained: kept out of checkpoints (persistent=False).
        cos, sin = rotary_tables(dims.dim // dims.n_heads, max_seq_len, dims.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # The loss through the output projection; the trainer may choose another (loss.py).
        self.output_loss = OutputLoss("chunked", chunked_cross_entropy)
        self.init_weights()

    def init_weights(self) -> None:
        """Initialise every parameter and buffer (also after `to_empty` from the meta device).

        Normal(0, 0.02) weights as in GPT-2/Llama, with residual output projections
        scaled by 1/sqrt(2·layers) so the residual stream's variance stays flat
        with depth.
        """
        cos, sin = rotary_tables(self.dims.dim // self.dims.n_heads, self.max_seq_len,
                                 self.dims.rope_theta)
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)
        residual_std = 0.02 / math.sqrt(2 * self.dims.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                is_residual_output = name.endswith(("attention.wo", "feed_forward.w2"))
                nn.init.normal_(module.weight, std=residual_std if is_residual_output else 0.02)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None, *,
                final_hidden: bool = False) -> torch.Tensor:
        """Logits, or given `targets` the summed loss; with `final_hidden` the normalised last
        hidden states [batch, seq, dim] (a distillation teacher's: the student's loss applies
        its output projection chunk by chunk)."""
        seq = tokens.shape[1]
        if seq > self.max_seq_len:
            raise ValueError(f"sequence of {seq} tokens is longer than the model's "
                             f"max_seq_len ({self.max_seq_len})")
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        x = self.tok_embeddings(tokens)
        for block in self.layers:
            x = block(x, cos, sin)
        hidden = self.norm(x)
        if final_hidden:
            return hidden
        if targets is None:
            return self.output(hidden)
        return self.output_loss(hidden.flatten(0, 1), self.output.weight, targets.flatten())
