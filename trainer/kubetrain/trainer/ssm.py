"""The state-space student (`model.architecture: ssm`), in plain PyTorch.

Design followed: Mamba-2's SSD layer (Dao & Gu, "Transformers are SSMs", ICML 2024),
with the reference chunked algorithm of its `ssd_minimal.py`. Each block's mixer
projects the input to a gate z, x, B, C and a step size dt per head; x, B and C go
through a short causal depthwise convolution and SiLU; then, per head h with a
scalar decay a_t = exp(dt_t · A_h) (A_h < 0, learned), the state S [head_dim, N]

    S_t = a_t · S_{t-1} + dt_t · x_t ⊗ B_t        y_t = S_t · C_t + D_h · x_t

is read out by C, gated by SiLU(z) through an RMSNorm, and projected back.
B and C are shared by the heads of a group, as keys and values are shared in
grouped-query attention. Two ways compute the same y:

- `StateSpaceModel.forward` (training, prefill): the chunked parallel scan. Within a
  chunk of Q tokens the output is a masked, decay-weighted C·B "attention" (quadratic
  in Q only); across chunks only the states pass, decayed by the chunk's total.
  Cost is linear in the sequence length.
- `StateSpaceModel.step` (generation): the recurrence above, one token at a time, with
  a fixed-size state per layer (the head states and the convolution's last inputs,
  `sizing.ssm_state_elements`): a token costs the same at any context length.

Where it departs from Mamba-2:
- Each block keeps the teacher's layout, as "The Mamba in the Llama" (Wang et al.,
  2024) does when distilling: pre-norm mixer and a pre-norm SwiGLU feed-forward, each
  on the residual stream, so width, depth, feed-forward size, heads (head size) and
  groups all come from a transformer's ModelDims (`model.fromTeacher`). Mamba-2 stacks
  mixer-only blocks.
- The head size is the attention heads' (dim / nHeads), not Mamba-2's fixed 64, and
  the groups are nKvHeads; the inner width (2·dim), state size N (64) and
  convolution width (4) are this version's constants (sizing.py), recorded in exports.
- No fused kernels: the scan is a handful of einsums, so it runs on CPU and under
  torch.compile; the per-chunk states are combined with a [chunks x chunks] decay
  matrix as in `ssd_minimal.py`, not a sequential kernel.
- No positional embeddings (the recurrence orders tokens); `max_seq_len` only bounds
  training inputs, as for the transformer.

Nothing here knows about parallelism: `parallelize.py` wraps `layers` as it does the
transformer's. Given targets, the model returns the summed token loss through the same
`output_loss` (loss.py) as the transformer, so distillation and every loss
implementation apply unchanged.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from kubetrain.api.trainingjob import ModelDims
from kubetrain.sizing import SSM_CHUNK_SIZE, SSM_CONV_WIDTH, ssm_shape
from kubetrain.trainer.loss import OutputLoss, chunked_cross_entropy
from kubetrain.trainer.model import FeedForward, RMSNorm, init_normal

# Mamba-2's initial step sizes: softplus(dt_bias) log-uniform in [DT_MIN, DT_MAX]; A_h
# uniform in [A_MIN, A_MAX] (negated), so heads start with a range of memory lengths.
DT_MIN, DT_MAX, A_MIN, A_MAX = 1e-3, 1e-1, 1.0, 16.0

# One layer's recurrent state: the convolution's last inputs [batch, channels, width - 1]
# and the head states [batch, heads, head_dim, N].
LayerState = tuple[torch.Tensor, torch.Tensor]


def segment_sums(x: torch.Tensor) -> torch.Tensor:
    """[..., T] → [..., T, T]: out[i, j] = x[j+1] + ... + x[i] for i >= j, -inf above the
    diagonal, so exp() of it is the decay from position j to i (0 where j is after i).
    Summed from masked copies rather than as a difference of cumulative sums, which
    loses precision on long chunks (as ssd_minimal.py does)."""
    length = x.shape[-1]
    x = x.unsqueeze(-1).expand(*x.shape, length)  # [..., T(i), T(j)] holds x[i]
    strictly_lower = torch.ones(length, length, dtype=torch.bool, device=x.device).tril(-1)
    sums = x.masked_fill(~strictly_lower, 0).cumsum(dim=-2)
    lower = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
    return sums.masked_fill(~lower, -math.inf)


def chunked_scan(x: torch.Tensor, log_decay: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                 chunk: int, initial: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD recurrence over a whole sequence, chunk by chunk in parallel.

    x [batch, seq, heads, P] (already multiplied by dt), log_decay [batch, seq, heads]
    (dt·A, <= 0), b and c [batch, seq, heads, N]; `initial` the state before the first
    token [batch, heads, P, N] (zeros when None). Returns y [batch, seq, heads, P]
    (without the D skip) and the state after the last token. A sequence that is not a
    multiple of `chunk` is padded with tokens that neither decay nor add to the state.
    """
    seq = x.shape[1]
    pad = -seq % chunk
    if pad:
        x, b, c = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, b, c))
        log_decay = F.pad(log_decay, (0, 0, 0, pad))
    chunks = (seq + pad) // chunk
    x, b, c = (t.unflatten(1, (chunks, chunk)) for t in (x, b, c))  # [B, n, Q, H, *]
    a = log_decay.unflatten(1, (chunks, chunk)).permute(0, 3, 1, 2)  # [B, H, n, Q]
    a_cumsum = a.cumsum(dim=-1)

    # 1. Within each chunk: y_i = sum_{j <= i} (C_i · B_j) decay(j → i) x_j.
    decay = torch.exp(segment_sums(a))  # [B, H, n, Q, Q]
    scores = torch.einsum("bclhn,bcshn->bhcls", c, b) * decay
    y_diagonal = torch.einsum("bhcls,bcshp->bclhp", scores, x)

    # 2. Each chunk's own state: its inputs decayed to its last token.
    to_end = torch.exp(a_cumsum[..., -1:] - a_cumsum)  # [B, H, n, Q]
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", b, to_end, x)

    # 3. Across chunks: the state entering each chunk, the decayed sum of all before it.
    if initial is None:
        initial = torch.zeros_like(states[:, 0])
    states = torch.cat([initial.unsqueeze(1), states], dim=1)  # [B, n+1, H, P, N]
    chunk_decay = torch.exp(segment_sums(F.pad(a_cumsum[..., -1], (1, 0))))  # [B,H,n+1,n+1]
    states = torch.einsum("bhzc,bchpn->bzhpn", chunk_decay, states)
    entering, final = states[:, :-1], states[:, -1]

    # 4. What the entering state contributes to each token, decayed to it.
    from_start = torch.exp(a_cumsum)  # [B, H, n, Q]
    y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", c, entering, from_start)
    y = (y_diagonal + y_off).flatten(1, 2)[:, :seq]
    return y, final


class Mixer(nn.Module):
    """Mamba-2's SSD mixer: in_proj → causal conv + SiLU → scan → gated RMSNorm → out_proj."""

    def __init__(self, dims: ModelDims, chunk_size: int = SSM_CHUNK_SIZE) -> None:
        super().__init__()
        self.shape = shape = ssm_shape(dims)
        self.chunk_size = chunk_size
        self.in_proj = nn.Linear(dims.dim, shape.in_features, bias=False)
        # Depthwise: each of x's, B's and C's channels sees its own last SSM_CONV_WIDTH inputs.
        self.conv = nn.Conv1d(shape.conv_channels, shape.conv_channels, SSM_CONV_WIDTH,
                              groups=shape.conv_channels, padding=SSM_CONV_WIDTH - 1)
        self.dt_bias = nn.Parameter(torch.empty(shape.heads))
        self.a_log = nn.Parameter(torch.empty(shape.heads))  # A = -exp(a_log)
        self.skip = nn.Parameter(torch.empty(shape.heads))  # D
        self.norm = RMSNorm(shape.inner, dims.norm_eps)
        self.out_proj = nn.Linear(shape.inner, dims.dim, bias=False)

    def reset_parameters(self) -> None:
        """Mamba-2's initialisation of the SSM's own parameters (the projections are drawn
        by the model's `init_weights` like every other linear layer)."""
        shape = self.shape
        with torch.no_grad():
            dt = torch.exp(torch.rand(shape.heads) * (math.log(DT_MAX) - math.log(DT_MIN))
                           + math.log(DT_MIN))
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus⁻¹(dt)
            self.a_log.copy_(torch.log(torch.empty(shape.heads).uniform_(A_MIN, A_MAX)))
            self.skip.fill_(1.0)
        self.conv.reset_parameters()
        self.norm.reset_parameters()

    def _split(self, projected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                       torch.Tensor]:
        shape = self.shape
        z, xbc, dt = projected.split([shape.inner, shape.conv_channels, shape.heads], dim=-1)
        return z, xbc, dt

    def _heads(self, xbc: torch.Tensor, dt: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., H, P], dt [..., H], the log decay dt·A [..., H], and B, C [..., H, N]
        repeated from their groups to the heads."""
        shape = self.shape
        x, b, c = xbc.split([shape.inner, shape.groups * shape.state,
                             shape.groups * shape.state], dim=-1)
        x = x.unflatten(-1, (shape.heads, shape.head_dim))
        per_group = shape.heads // shape.groups
        b, c = (t.unflatten(-1, (shape.groups, shape.state))
                .repeat_interleave(per_group, dim=-2) for t in (b, c))
        dt = F.softplus(dt.float() + self.dt_bias)
        log_decay = dt * -torch.exp(self.a_log.float())
        return x, dt, log_decay, b, c

    def _out(self, y: torch.Tensor, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        y = y + x * self.skip.unsqueeze(-1)
        y = y.flatten(-2).type_as(z)
        return self.out_proj(self.norm(y * F.silu(z)))

    def forward(self, hidden: torch.Tensor, *, with_state: bool = False
                ) -> tuple[torch.Tensor, LayerState | None]:
        """[batch, seq, dim] → [batch, seq, dim] by the chunked scan; `with_state` also
        returns the recurrent state after the last token (prefill before `step`)."""
        seq = hidden.shape[1]
        z, xbc_in, dt = self._split(self.in_proj(hidden))
        xbc = F.silu(self.conv(xbc_in.transpose(1, 2))[..., :seq].transpose(1, 2))
        x, dt, log_decay, b, c = self._heads(xbc, dt)
        # The scan in fp32, autocast or not: products of many decays underflow in bf16.
        with torch.autocast(hidden.device.type, enabled=False):
            y, final = chunked_scan((x.float() * dt.unsqueeze(-1)), log_decay, b.float(),
                                    c.float(), self.chunk_size)
        out = self._out(y, x.float(), z)
        if not with_state:
            return out, None
        width = SSM_CONV_WIDTH - 1
        conv_state = F.pad(xbc_in.transpose(1, 2), (max(0, width - seq), 0))[..., -width:]
        return out, (conv_state, final)

    def step(self, hidden: torch.Tensor, state: LayerState) -> tuple[torch.Tensor, LayerState]:
        """One token [batch, dim] and the state before it → the output [batch, dim] and the
        state after it: the recurrence itself, in time independent of the context."""
        conv_state, ssm_state = state
        z, xbc_in, dt = self._split(self.in_proj(hidden))
        window = torch.cat([conv_state, xbc_in.unsqueeze(-1)], dim=-1)  # [B, ch, width]
        bias = self.conv.bias
        assert bias is not None, "the convolution is built with a bias"
        xbc = F.silu((window * self.conv.weight.squeeze(1)).sum(-1) + bias)
        x, dt, log_decay, b, c = self._heads(xbc, dt)
        x = x.float()
        update = (x * dt.unsqueeze(-1)).unsqueeze(-1) * b.float().unsqueeze(-2)  # [B,H,P,N]
        ssm_state = torch.exp(log_decay)[..., None, None] * ssm_state + update
        y = (ssm_state * c.float().unsqueeze(-2)).sum(-1)
        return self._out(y, x, z), (window[..., 1:], ssm_state)

    def empty_state(self, batch: int, device: torch.device, dtype: torch.dtype) -> LayerState:
        """The state before any token: zeros, of the size every later state has."""
        shape = self.shape
        return (torch.zeros(batch, shape.conv_channels, SSM_CONV_WIDTH - 1, device=device,
                            dtype=dtype),
                torch.zeros(batch, shape.heads, shape.head_dim, shape.state, device=device,
                            dtype=torch.float32))


class SSMBlock(nn.Module):
    """Pre-norm residual block: the SSD mixer, then the SwiGLU feed-forward."""

    def __init__(self, dims: ModelDims, dropout: float = 0.0,
                 chunk_size: int = SSM_CHUNK_SIZE) -> None:
        super().__init__()
        self.mixer_norm = RMSNorm(dims.dim, dims.norm_eps)
        self.mixer = Mixer(dims, chunk_size)
        self.ffn_norm = RMSNorm(dims.dim, dims.norm_eps)
        self.feed_forward = FeedForward(dims.dim, dims.ffn_dim)
        self.residual_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.residual_dropout(self.mixer(self.mixer_norm(x))[0])
        return x + self.residual_dropout(self.feed_forward(self.ffn_norm(x)))

    def prefill(self, x: torch.Tensor) -> tuple[torch.Tensor, LayerState]:
        mixed, state = self.mixer(self.mixer_norm(x), with_state=True)
        assert state is not None
        x = x + mixed
        return x + self.feed_forward(self.ffn_norm(x)), state

    def step(self, x: torch.Tensor, state: LayerState) -> tuple[torch.Tensor, LayerState]:
        mixed, state = self.mixer.step(self.mixer_norm(x), state)
        x = x + mixed
        return x + self.feed_forward(self.ffn_norm(x)), state


class StateSpaceModel(nn.Module):
    """Token ids [batch, seq] → next-token logits [batch, seq, vocab], or with targets the
    summed fp32 cross-entropy (a scalar), like `Transformer`; plus `prefill` and `step`
    for generation with a fixed-size state."""

    def __init__(self, dims: ModelDims, max_seq_len: int, dropout: float = 0.0,
                 chunk_size: int = SSM_CHUNK_SIZE) -> None:
        super().__init__()
        self.dims = dims
        self.max_seq_len = max_seq_len
        self.tok_embeddings = nn.Embedding(dims.vocab_size, dims.dim)
        self.layers = nn.ModuleList(SSMBlock(dims, dropout, chunk_size)
                                    for _ in range(dims.n_layers))
        self.norm = RMSNorm(dims.dim, dims.norm_eps)
        self.output = nn.Linear(dims.dim, dims.vocab_size, bias=False)
        if dims.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.output_loss = OutputLoss("chunked", chunked_cross_entropy)
        self.init_weights()

    def init_weights(self) -> None:
        """Normal(0, 0.02) linear and embedding weights, the residual outputs (the mixer's
        and the feed-forward's) scaled by 1/sqrt(2·layers) as in the transformer; the
        SSM's own parameters as Mamba-2 draws them (`Mixer.reset_parameters`)."""
        init_normal(self, self.dims.n_layers, ("mixer.out_proj", "feed_forward.w2"),
                    reset=(Mixer, RMSNorm))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None, *,
                final_hidden: bool = False) -> torch.Tensor:
        """Logits, or given `targets` the summed loss; with `final_hidden` the normalised last
        hidden states (as `Transformer.forward`)."""
        seq = tokens.shape[1]
        if seq > self.max_seq_len:
            raise ValueError(f"sequence of {seq} tokens is longer than the model's "
                             f"max_seq_len ({self.max_seq_len})")
        x = self.tok_embeddings(tokens)
        for block in self.layers:
            x = block(x)
        hidden = self.norm(x)
        if final_hidden:
            return hidden
        if targets is None:
            return self.output(hidden)
        return self.output_loss(hidden.flatten(0, 1), self.output.weight, targets.flatten())

    def blocks(self) -> list[SSMBlock]:
        """The blocks, unwrapped: generation runs on a plain model, never a parallelized one."""
        return [cast(SSMBlock, block) for block in self.layers]

    def prefill(self, tokens: torch.Tensor) -> tuple[torch.Tensor, list[LayerState]]:
        """Logits of `tokens` [batch, seq] by the parallel scan, and every layer's state
        after the last of them, to continue from with `step`. Any length: the scan has no
        positional limit."""
        x = self.tok_embeddings(tokens)
        states = []
        for block in self.blocks():
            x, state = block.prefill(x)
            states.append(state)
        return self.output(self.norm(x)), states

    def empty_state(self, batch: int) -> list[LayerState]:
        """Every layer's state before the first token."""
        weight = self.tok_embeddings.weight
        return [block.mixer.empty_state(batch, weight.device, weight.dtype)
                for block in self.blocks()]

    def step(self, token: torch.Tensor, states: list[LayerState]
             ) -> tuple[torch.Tensor, list[LayerState]]:
        """The logits [batch, vocab] after one more token [batch], and the states after it."""
        x = self.tok_embeddings(token)
        after = []
        for block, state in zip(self.blocks(), states, strict=True):
            x, state = block.step(x, state)
            after.append(state)
        return self.output(self.norm(x)), after
