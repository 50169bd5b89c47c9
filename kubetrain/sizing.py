"""Model size arithmetic: parameter count and training FLOPs per token of a ModelDims.

Torch-free, so the memory planner (`kubetrain estimate`) and the trainer's MFU
share one definition, and so do the loss (loss.py) and the planner for the loss's
chunk size; `model.py` builds exactly the parameters counted here (a
test checks the two agree). `dynamics` says whether the blocks carry INL
dynamics (`model.dynamics.enabled`), which are not part of ModelDims.
"""

from __future__ import annotations

from dataclasses import dataclass

from kubetrain.api.families import FAMILIES
from kubetrain.api.presets import ModelDims

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
    """Parameters of one transformer block: attention (with its family's q/k/v biases and
    q/k norms), the gated feed-forward, two RMSNorms (four with post-norms) and, with
    `dynamics`, the INL controller."""
    traits = FAMILIES[dims.family]
    queries, keys = dims.n_heads * dims.head_size, dims.n_kv_heads * dims.head_size
    attention = 2 * dims.dim * queries + 2 * dims.dim * keys
    biases = queries + 2 * keys if traits.qkv_bias else 0
    head_norms = 2 * dims.head_size if traits.qk_norm else 0
    feed_forward = 3 * dims.dim * dims.ffn_dim
    norms = (4 if traits.post_norms else 2) * dims.dim
    controller = dynamics_parameter_count(dims.dim) if dynamics else 0
    return attention + biases + head_norms + feed_forward + norms + controller


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
    plus 12·H·Q·T per layer for the attention scores and their weighted sum
    (H heads, Q head size, T sequence length; a local layer's T is at most its
    sliding window, the keys one query sees).
    """
    matmul_parameters = parameter_count(dims, dynamics)
    if not dims.tie_embeddings:
        matmul_parameters -= dims.vocab_size * dims.dim
    window = min(seq_len, dims.sliding_window or seq_len)
    keys = sum(window if local else seq_len for local in dims.local_layers)
    attention = 12 * dims.n_heads * dims.head_size * keys
    return 6 * matmul_parameters + attention


# The state-space student (ssm.py, `model.architecture: ssm`). Its shape comes from the
# same ModelDims as a transformer's: the mixer's heads are the attention heads' size
# (dim / nHeads) and B/C are shared by groups of heads as key/value heads are (nKvHeads
# groups); these four are fixed by this version and written into its exports.
SSM_EXPAND = 2  # the mixer's inner width is SSM_EXPAND x dim, as Mamba's
SSM_STATE_SIZE = 64  # N: state entries per head channel
SSM_CONV_WIDTH = 4  # the short causal depthwise convolution before the scan
SSM_CHUNK_SIZE = 64  # tokens per chunk of the parallel scan (a compute choice, not a weight)


@dataclass(frozen=True)
class SSMShape:
    """The mixer's widths for one ModelDims (see ssm.py)."""

    inner: int  # SSM_EXPAND x dim
    heads: int  # inner / head_dim
    head_dim: int  # dim / nHeads, the attention heads' size
    groups: int  # nKvHeads: heads share B and C within a group
    state: int  # SSM_STATE_SIZE

    @property
    def conv_channels(self) -> int:
        """x, B and C go through the convolution together."""
        return self.inner + 2 * self.groups * self.state

    @property
    def in_features(self) -> int:
        """The input projection's outputs: the gate z, x, B, C and one dt per head."""
        return 2 * self.inner + 2 * self.groups * self.state + self.heads


def ssm_shape(dims: ModelDims) -> SSMShape:
    """The SSM mixer of a model of these dimensions."""
    head_dim = dims.dim // dims.n_heads
    inner = SSM_EXPAND * dims.dim
    return SSMShape(inner=inner, heads=inner // head_dim, head_dim=head_dim,
                    groups=dims.n_kv_heads, state=SSM_STATE_SIZE)


def ssm_block_parameter_count(dims: ModelDims) -> int:
    """Parameters of one SSM block: the mixer (input projection, convolution with bias, dt
    bias, A, D, gated norm, output projection), the SwiGLU feed-forward and two RMSNorms."""
    shape = ssm_shape(dims)
    mixer = (dims.dim * shape.in_features + shape.conv_channels * (SSM_CONV_WIDTH + 1)
             + 3 * shape.heads + shape.inner + shape.inner * dims.dim)
    return mixer + 3 * dims.dim * dims.ffn_dim + 2 * dims.dim


def ssm_parameter_count(dims: ModelDims) -> int:
    """All parameters of the SSM, a tied embedding counted once."""
    output = 0 if dims.tie_embeddings else dims.vocab_size * dims.dim
    return (dims.vocab_size * dims.dim + dims.n_layers * ssm_block_parameter_count(dims)
            + dims.dim + output)


def ssm_state_elements(dims: ModelDims) -> int:
    """Numbers in one sequence's recurrent state over all layers (generation): each head's
    head_dim x N state and the convolution's last SSM_CONV_WIDTH - 1 inputs. It does not
    grow with the context."""
    shape = ssm_shape(dims)
    per_layer = shape.heads * shape.head_dim * shape.state + shape.conv_channels * (
        SSM_CONV_WIDTH - 1)
    return dims.n_layers * per_layer


def ssm_flops_per_token(dims: ModelDims) -> int:
    """Training FLOPs per token of the SSM: 6 per matmul parameter (the input embedding of
    an untied model is a lookup) plus the chunked scan, 3 x its forward, which per token,
    layer and chunk of Q tokens is 2·Q·(G·N + H·P) within the chunk (C·B scores, then
    their weighted sum of x) and 4·H·P·N to and from the chunk states."""
    shape = ssm_shape(dims)
    matmul = ssm_parameter_count(dims) - (0 if dims.tie_embeddings
                                          else dims.vocab_size * dims.dim)
    q, h, p, n, g = SSM_CHUNK_SIZE, shape.heads, shape.head_dim, shape.state, shape.groups
    scan = 2 * q * (g * n + h * p) + 4 * h * p * n
    return 6 * matmul + 3 * dims.n_layers * scan


def ssm_block_activation_bytes(dims: ModelDims, seq_len: int, compute_bytes: int) -> int:
    """Bytes one SSM block keeps for backward per sequence of `seq_len` tokens, counted with
    saved-tensor hooks (tests/trainer/test_ssm.py checks it against them).

    Per token, in the compute dtype (b bytes): the block's input and norms' outputs (3·d),
    the SwiGLU's four tensors (4·f), the input projection's output, the convolution's
    output, and four inner-width tensors of the gated output. Always in fp32 (the scan
    runs in fp32, `ssm.Mixer.forward`): the norms' fp32 intermediates and the scan's inputs
    and outputs (4·d + 7·inner under bf16/fp16; in an fp32 run the same tensors are
    fewer, 3·d + conv + 4·inner, being the ones above), and over the chunk-padded sequence
    of c chunks of Q tokens, per token: 4·H step sizes and decays, 5·H·N for B and C
    repeated to the heads, 3·H·Q for the within-chunk decays and scores, 2·H·P·N/Q for the
    chunk states; and H·(c + 1)² per sequence for the decays between chunks.
    """
    shape = ssm_shape(dims)
    d, f, inner, conv = dims.dim, dims.ffn_dim, shape.inner, shape.conv_channels
    h, p, n = shape.heads, shape.head_dim, shape.state
    q = SSM_CHUNK_SIZE
    chunks = -(-seq_len // q)
    padded = chunks * q
    in_compute = compute_bytes * (3 * d + 4 * f + shape.in_features + conv + 4 * inner) * seq_len
    fp32_copies = (4 * d + 7 * inner) if compute_bytes < 4 else (3 * d + conv + 4 * inner)
    scan = (4 * h + 5 * h * n + 3 * h * q + 2 * h * p * n // q) * padded + h * (chunks + 1) ** 2
    return in_compute + 4 * (fp32_copies * seq_len + scan)
