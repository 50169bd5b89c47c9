"""The Llama-style decoder every TrainingJob trains, in plain PyTorch.

RMSNorm, rotary position embeddings, grouped-query attention through
`F.scaled_dot_product_attention`, a SwiGLU feed-forward and optionally tied
input/output embeddings. Nothing here knows about parallelism, precision or
activation checkpointing: `parallelize.py` applies those from outside, so this
file reads like the architecture and nothing else. Parameter counts and FLOPs
per token live beside it in `sizing.py`. Dropout (off by default) acts on the
attention weights and on each residual branch's output, in training mode only.
INL dynamics (off by default, `Dynamics`) adds a learned second-order controller
after attention in every block, with a velocity carried from block to block.
Given targets, the model returns the summed token loss instead of the logits,
through `output_loss` (loss.py), which never holds the whole [tokens, vocab]
logits; the trainer picks the implementation.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kubetrain.api.trainingjob import DynamicsSpec, ModelDims
from kubetrain.sizing import CONTROLLER_WIDTH
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


# The controller's starting outputs, set through its output biases: alpha (inertia) 0.9,
# beta (restoring gain) 0.05 of betaMax and gate 0.1, so each block starts close to the
# plain residual block and learns how much control it wants.
INITIAL_ALPHA, INITIAL_BETA_FRACTION, INITIAL_GATE = 0.9, 0.05, 0.1


class Dynamics(nn.Module):
    """INL dynamics: a second-order controller on the hidden state h, with velocity v.

        error = h - mu
        v'    = clamp(alpha * v - beta * error, -velocity_max, velocity_max)
        h'    = h + g * v'

    mu is a learned per-channel equilibrium. alpha, beta and g come from h through a
    small learned controller (linear, SiLU, linear): alpha and g in [0, 1] by sigmoids,
    beta in [0, beta_max] as beta_max * sigmoid, so no input makes it push harder than
    beta_max, and the clamp bounds the velocity whatever the activations. Each forward
    also records the mean beta and the mean square of v' in `stats` (a buffer outside
    checkpoints), which the trainer reads at logged steps.
    """

    stats: torch.Tensor

    def __init__(self, dim: int, beta_max: float, velocity_max: float) -> None:
        super().__init__()
        self.beta_max = beta_max
        self.velocity_max = velocity_max
        self.equilibrium = nn.Parameter(torch.zeros(dim))  # mu
        self.controller_in = nn.Linear(dim, CONTROLLER_WIDTH)
        self.controller_out = nn.Linear(CONTROLLER_WIDTH, 3 * dim)  # alpha, beta, g
        self.register_buffer("stats", torch.zeros(2), persistent=False)

    def controls(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """alpha and g in [0, 1] and beta in [0, beta_max], per token and channel of h."""
        alpha, beta, gate = self.controller_out(F.silu(self.controller_in(h))).chunk(3, dim=-1)
        return alpha.sigmoid(), self.beta_max * beta.sigmoid(), gate.sigmoid()

    def forward(self, h: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        alpha, beta, gate = self.controls(h)
        error = h - self.equilibrium
        v = (alpha * v - beta * error).clamp(-self.velocity_max, self.velocity_max)
        self.stats.copy_(torch.stack((beta.detach().mean(), v.detach().pow(2).mean())))
        return h + gate * v, v

    def reset_parameters(self) -> None:
        """mu at zero and the controller's starting outputs; `Transformer.init_weights`
        draws the two weight matrices like every other linear layer's."""
        nn.init.zeros_(self.equilibrium)
        nn.init.zeros_(self.controller_in.bias)
        with torch.no_grad():
            alpha, beta, gate = self.controller_out.bias.chunk(3)
            alpha.fill_(math.log(INITIAL_ALPHA / (1 - INITIAL_ALPHA)))
            beta.fill_(math.log(INITIAL_BETA_FRACTION / (1 - INITIAL_BETA_FRACTION)))
            gate.fill_(math.log(INITIAL_GATE / (1 - INITIAL_GATE)))
            self.stats.zero_()


class TransformerBlock(nn.Module):
    """Pre-norm residual block: attention, then feed-forward, each branch dropped out;
    with dynamics, the controller acts between the two and passes the velocity on."""

    def __init__(self, dims: ModelDims, dropout: float = 0.0,
                 dynamics: DynamicsSpec | None = None) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(dims.dim, dims.norm_eps)
        self.attention = Attention(dims, dropout)
        # None when off: the plain block's parameters and initial random draws, unchanged.
        self.dynamics = (Dynamics(dims.dim, dynamics.beta_max, dynamics.velocity_max)
                         if dynamics is not None and dynamics.enabled else None)
        self.ffn_norm = RMSNorm(dims.dim, dims.norm_eps)
        self.feed_forward = FeedForward(dims.dim, dims.ffn_dim)
        # Identity when off: the model without dropout computes exactly what it did before.
        self.residual_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, velocity: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = x + self.residual_dropout(self.attention(self.attention_norm(x), cos, sin))
        if self.dynamics is not None:
            assert velocity is not None, "dynamics need the velocity: zeros at the first block"
            x, velocity = self.dynamics(x, velocity)
        return x + self.residual_dropout(self.feed_forward(self.ffn_norm(x))), velocity


def init_normal(model: nn.Module, n_layers: int, residual_outputs: tuple[str, ...],
                reset: tuple[type[nn.Module], ...]) -> None:
    """GPT-2/Llama's initialisation, in module order: Normal(0, 0.02) linear and embedding
    weights, the residual branches' output projections (names ending in `residual_outputs`)
    scaled by 1/sqrt(2·layers) so the residual stream's variance stays flat with depth;
    modules of the `reset` types (norms, controllers, SSM mixers) reset themselves."""
    residual_std = 0.02 / math.sqrt(2 * n_layers)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            std = residual_std if name.endswith(residual_outputs) else 0.02
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, reset):
            module.reset_parameters()  # type: ignore[operator]


class Transformer(nn.Module):
    """Token ids [batch, seq] → next-token logits [batch, seq, vocab], or with targets
    [batch, seq] the summed fp32 cross-entropy of the next tokens (a scalar)."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, dims: ModelDims, max_seq_len: int, dropout: float = 0.0,
                 dynamics: DynamicsSpec | None = None) -> None:
        super().__init__()
        self.dims = dims
        self.max_seq_len = max_seq_len
        self.has_dynamics = dynamics is not None and dynamics.enabled
        self.tok_embeddings = nn.Embedding(dims.vocab_size, dims.dim)
        # A ModuleList indexed by position, so parallelize() can wrap blocks one by one.
        self.layers = nn.ModuleList(TransformerBlock(dims, dropout, dynamics)
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
        with depth. The dynamics controller's weights are drawn the same way
        (in module order, so a model without dynamics draws exactly what it did
        before the option existed); its biases and mu are constants.
        """
        cos, sin = rotary_tables(self.dims.dim // self.dims.n_heads, self.max_seq_len,
                                 self.dims.rope_theta)
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)
        init_normal(self, self.dims.n_layers, ("attention.wo", "feed_forward.w2"),
                    reset=(RMSNorm, Dynamics))

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
        # The dynamics' velocity starts at rest and runs through every block in turn.
        velocity = torch.zeros_like(x) if self.has_dynamics else None
        for block in self.layers:
            x, velocity = block(x, velocity, cos, sin)
        hidden = self.norm(x)
        if final_hidden:
            return hidden
        if targets is None:
            return self.output(hidden)
        return self.output_loss(hidden.flatten(0, 1), self.output.weight, targets.flatten())
