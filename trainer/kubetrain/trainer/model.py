"""The Llama-style decoder every TrainingJob trains, in plain PyTorch.

RMSNorm, rotary position embeddings, grouped-query attention through
`F.scaled_dot_product_attention`, a SwiGLU feed-forward and optionally tied
input/output embeddings. The other families are switches on this one block
(kubetrain.api.families, chosen by `ModelDims.family`): Qwen2's q/k/v biases,
Qwen3's and Gemma 3's RMSNorm on each query and key head, Gemma 3's tanh-GELU
gate, 1 + w norm scales, sqrt(dim) embedding scale and norms after attention
and the feed-forward; and, per layer, a sliding attention window (Mistral's on
every layer, Gemma 3's on its local layers, which also have their own rotary
base). Rotary frequencies may be stretched (`RopeScaling`: Llama 3.1, Gemma 3).
Nothing here knows about parallelism, precision or
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

from kubetrain.api.families import FAMILIES
from kubetrain.api.presets import RopeScaling
from kubetrain.api.trainingjob import DynamicsSpec, ModelDims
from kubetrain.sizing import CONTROLLER_WIDTH
from kubetrain.trainer.loss import OutputLoss, chunked_cross_entropy


class RMSNorm(nn.Module):
    """Root-mean-square normalisation with a learned per-channel scale: the weight, or with
    `unit_offset` (Gemma) 1 + the weight, which then starts at zero."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 even when the block computes in bf16: the mean of squares underflows.
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:  # Gemma scales in fp32 and casts once; Llama casts, then scales
            return (normed * (1.0 + self.weight.float())).type_as(x)
        return normed.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.constant_(self.weight, 0.0 if self.unit_offset else 1.0)


def rotary_tables(
    head_dim: int, max_seq_len: int, theta: float, scaling: RopeScaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, frequency) pair, each [max_seq_len, head_dim // 2]."""
    frequencies = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if scaling is not None:
        frequencies = stretched(frequencies, scaling)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), frequencies)
    return angles.cos(), angles.sin()


def stretched(frequencies: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Rotary frequencies slowed for a longer context (see `RopeScaling`). llama3 keeps
    the waves that fit many times into the original context (high frequencies: local
    order), slows by `factor` those that fit less than `low_freq_factor` times, and blends
    in between by how many times they fit."""
    if scaling.kind == "linear":
        return frequencies / scaling.factor
    fits = scaling.original_max_positions / (2 * math.pi / frequencies)
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    kept = ((fits - low) / (high - low)).clamp(0.0, 1.0)  # 0: slowed by factor, 1: kept
    return (1 - kept) * frequencies / scaling.factor + kept * frequencies


def window_mask(seq: int, window: int, device: torch.device) -> torch.Tensor:
    """[seq, seq], True where a query (row) attends to a key (column): itself and the
    window - 1 tokens before it."""
    positions = torch.arange(seq, device=device)
    behind = positions.unsqueeze(1) - positions.unsqueeze(0)
    return (behind >= 0) & (behind < window)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs of x [batch, heads, seq, head_dim] by their position's angles."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal self-attention; n_kv_heads < n_heads shares each key/value head over a group.
    By family: biases on the q/k/v projections, an RMSNorm on each query and key head
    before the rotation, and a scale of the scores other than 1/sqrt(head size)."""

    def __init__(self, dims: ModelDims, dropout: float = 0.0) -> None:
        super().__init__()
        traits = FAMILIES[dims.family]
        self.dropout = dropout  # on the attention weights, while training
        self.n_heads = dims.n_heads
        self.n_kv_heads = dims.n_kv_heads
        self.head_dim = dims.head_size
        self.scale = None if dims.query_scale_dim is None else dims.query_scale_dim ** -0.5
        bias = traits.qkv_bias
        self.wq = nn.Linear(dims.dim, dims.n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(dims.dim, dims.n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(dims.dim, dims.n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(dims.n_heads * self.head_dim, dims.dim, bias=False)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if traits.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, dims.norm_eps, traits.unit_offset_norms)
            self.k_norm = RMSNorm(self.head_dim, dims.norm_eps, traits.unit_offset_norms)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """`mask` a local layer's sliding window (`window_mask`); None: causal."""
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q.transpose(1, 2), cos, sin)
        k = apply_rotary(k.transpose(1, 2), cos, sin)
        grouped = self.n_kv_heads != self.n_heads
        if mask is not None and grouped:
            # With a mask, only the memory-efficient kernel avoids the [seq, seq] scores, and
            # it does not broadcast key/value heads: give it one per query head.
            k, v = (t.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1) for t in (k, v))
            grouped = False
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale,
            enable_gqa=grouped, dropout_p=self.dropout if self.training else 0.0,
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def reset_parameters(self) -> None:
        """Zero biases (`init_normal` draws the weights, and resets the q/k norms)."""
        for projection in (self.wq, self.wk, self.wv):
            if projection.bias is not None:
                nn.init.zeros_(projection.bias)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); with `gelu` (Gemma) GeGLU, tanh-approximated."""

    def __init__(self, dim: int, hidden: int, gelu: bool = False) -> None:
        super().__init__()
        self.gelu = gelu
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = F.gelu(self.w1(x), approximate="tanh") if self.gelu else F.silu(self.w1(x))
        return self.w2(gate * self.w3(x))


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
    with dynamics, the controller acts between the two and passes the velocity on; with
    post-norms (Gemma), each branch is normalised again before it joins the residual."""

    def __init__(self, dims: ModelDims, dropout: float = 0.0,
                 dynamics: DynamicsSpec | None = None) -> None:
        super().__init__()
        traits = FAMILIES[dims.family]
        self.attention_norm = RMSNorm(dims.dim, dims.norm_eps, traits.unit_offset_norms)
        self.attention = Attention(dims, dropout)
        # None when off: the plain block's parameters and initial random draws, unchanged.
        self.dynamics = (Dynamics(dims.dim, dynamics.beta_max, dynamics.velocity_max)
                         if dynamics is not None and dynamics.enabled else None)
        self.ffn_norm = RMSNorm(dims.dim, dims.norm_eps, traits.unit_offset_norms)
        self.feed_forward = FeedForward(dims.dim, dims.ffn_dim, traits.gelu)
        # Identity when off: the model without dropout computes exactly what it did before.
        self.residual_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.post_attention_norm: RMSNorm | None = None
        self.post_ffn_norm: RMSNorm | None = None
        if traits.post_norms:
            self.post_attention_norm = RMSNorm(dims.dim, dims.norm_eps, traits.unit_offset_norms)
            self.post_ffn_norm = RMSNorm(dims.dim, dims.norm_eps, traits.unit_offset_norms)

    def forward(self, x: torch.Tensor, velocity: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`cos` and `sin` this layer's rotary tables, `mask` its sliding window (or None)."""
        attended = self.attention(self.attention_norm(x), cos, sin, mask)
        if self.post_attention_norm is not None:
            attended = self.post_attention_norm(attended)
        x = x + self.residual_dropout(attended)
        if self.dynamics is not None:
            assert velocity is not None, "dynamics need the velocity: zeros at the first block"
            x, velocity = self.dynamics(x, velocity)
        fed = self.feed_forward(self.ffn_norm(x))
        if self.post_ffn_norm is not None:
            fed = self.post_ffn_norm(fed)
        return x + self.residual_dropout(fed), velocity


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
    local_rope_cos: torch.Tensor
    local_rope_sin: torch.Tensor

    def __init__(self, dims: ModelDims, max_seq_len: int, dropout: float = 0.0,
                 dynamics: DynamicsSpec | None = None) -> None:
        super().__init__()
        traits = FAMILIES[dims.family]
        self.dims = dims
        self.max_seq_len = max_seq_len
        self.has_dynamics = dynamics is not None and dynamics.enabled
        self.local_layers = dims.local_layers  # which blocks attend through the window
        # Gemma: sqrt(dim), rounded to the embeddings' dtype as Gemma's own is.
        self.embedding_scale = dims.dim ** 0.5 if traits.scaled_embeddings else None
        self.tok_embeddings = nn.Embedding(dims.vocab_size, dims.dim)
        # A ModuleList indexed by position, so parallelize() can wrap blocks one by one.
        self.layers = nn.ModuleList(TransformerBlock(dims, dropout, dynamics)
                                    for _ in range(dims.n_layers))
        self.norm = RMSNorm(dims.dim, dims.norm_eps, traits.unit_offset_norms)
        self.output = nn.Linear(dims.dim, dims.vocab_size, bias=False)
        if dims.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Derived from the dimensions, never trained: kept out of checkpoints (persistent=False).
        for name, table in self._rotary_tables().items():
            self.register_buffer(name, table, persistent=False)
        # The loss through the output projection; the trainer may choose another (loss.py).
        self.output_loss = OutputLoss("chunked", chunked_cross_entropy)
        self.init_weights()

    def _rotary_tables(self) -> dict[str, torch.Tensor]:
        """The global layers' tables, and the local layers' where the model has any: their
        own base (local_rope_theta), never scaled."""
        dims = self.dims
        cos, sin = rotary_tables(dims.head_size, self.max_seq_len, dims.rope_theta,
                                 dims.rope_scaling)
        tables = {"rope_cos": cos, "rope_sin": sin}
        if any(self.local_layers):
            cos, sin = rotary_tables(dims.head_size, self.max_seq_len,
                                     dims.local_rope_theta or dims.rope_theta)
            tables |= {"local_rope_cos": cos, "local_rope_sin": sin}
        return tables

    def init_weights(self) -> None:
        """Initialise every parameter and buffer (also after `to_empty` from the meta device).

        Normal(0, 0.02) weights as in GPT-2/Llama, with residual output projections
        scaled by 1/sqrt(2·layers) so the residual stream's variance stays flat
        with depth. The dynamics controller's weights are drawn the same way
        (in module order, so a model without dynamics draws exactly what it did
        before the option existed); its biases and mu are constants. The families' q/k/v
        biases start at zero, their norms at a scale of one (a weight of zero for 1 + w).
        """
        with torch.no_grad():
            for name, table in self._rotary_tables().items():
                getattr(self, name).copy_(table)
        init_normal(self, self.dims.n_layers, ("attention.wo", "feed_forward.w2"),
                    reset=(RMSNorm, Dynamics, Attention))

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
        if self.embedding_scale is not None:
            x = x * torch.tensor(self.embedding_scale, dtype=x.dtype).item()
        # The dynamics' velocity starts at rest and runs through every block in turn.
        velocity = torch.zeros_like(x) if self.has_dynamics else None
        local_cos = local_sin = mask = None
        if any(self.local_layers):
            local_cos, local_sin = self.local_rope_cos[:seq], self.local_rope_sin[:seq]
            window = self.dims.sliding_window
            assert window is not None, "local layers have a window"
            mask = window_mask(seq, window, tokens.device) if seq > window else None
        for block, local in zip(self.layers, self.local_layers, strict=True):
            if local:
                x, velocity = block(x, velocity, local_cos, local_sin, mask)
            else:
                x, velocity = block(x, velocity, cos, sin)
        hidden = self.norm(x)
        if final_hidden:
            return hidden
        if targets is None:
            return self.output(hidden)
        return self.output_loss(hidden.flatten(0, 1), self.output.weight, targets.flatten())
