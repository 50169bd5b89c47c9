"""Model presets: architecture dimensions plus the training defaults of their scale.

Torch-free data shared by the API (valid preset names, defaults), the trainer
(building the model) and the memory planner. The `tiny` and `llama-*` presets are
Llama shapes whose hyperparameter defaults follow the GPT-3 / Llama papers' choices
for pretraining at each size (smaller models take larger learning rates and smaller
batches). The Qwen, Mistral and Gemma presets are the released models' shapes
(their config.json on the Hugging Face hub) with fine-tuning defaults, since a job
starts them from the released weights (model.init): full fine-tuning learning rates
of 1e-5 at 7-12B parameters up to 5e-5 below 1B, a short warm-up, and batches of a
quarter to half a million tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, model_validator

from kubetrain.api.families import FAMILIES, Family


class RopeScaling(BaseModel):
    """Rotary frequencies stretched for contexts longer than pretraining's.

    `linear` divides every frequency by `factor` (Gemma 3's global layers). `llama3`
    (Llama 3.1 and 3.2) divides only the frequencies whose wavelength is longer than
    `original_max_positions / low_freq_factor`, keeps those shorter than
    `original_max_positions / high_freq_factor`, and blends linearly in between.
    """

    model_config = ConfigDict(frozen=True)

    kind: Literal["linear", "llama3"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192


class ModelDims(BaseModel):
    """The dimensions that define a model's architecture.

    The fields after `norm_eps` are where families differ (families.py); their defaults
    are Llama's, so dimensions recorded before families existed read back unchanged.
    """

    model_config = ConfigDict(frozen=True)

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_dim: int
    tie_embeddings: bool
    rope_theta: float
    norm_eps: float = 1e-5
    family: Family = "llama"
    head_dim: int | None = None  # None: dim / n_heads (then never written as that number)
    sliding_window: int | None = None  # tokens a local layer's query sees, its own included
    global_every: int | None = None  # with a window: layers N-1, 2N-1, ... are global
    local_rope_theta: float | None = None  # local layers' rotary base (None: rope_theta)
    rope_scaling: RopeScaling | None = None  # global layers' (local layers are never scaled)
    query_scale_dim: int | None = None  # scores scaled by 1/sqrt(this); None: the head size

    @model_validator(mode="before")
    @classmethod
    def _one_spelling(cls, values: Any) -> Any:
        # One spelling per model, so that dimensions read from a config.json compare equal
        # to a preset's or a spec's: a value that says what its default says is no value.
        if not isinstance(values, dict):
            return values
        values = dict(values)
        dim, heads = values.get("dim"), values.get("n_heads")
        if isinstance(dim, int) and isinstance(heads, int) and heads and dim % heads == 0 \
                and values.get("head_dim") == dim // heads:
            values["head_dim"] = None
        head_size = values.get("head_dim") or (dim // heads if isinstance(dim, int) and
                                               isinstance(heads, int) and heads else None)
        if values.get("query_scale_dim") is not None and values["query_scale_dim"] == head_size:
            values["query_scale_dim"] = None
        if values.get("local_rope_theta") is not None and \
                values["local_rope_theta"] == values.get("rope_theta"):
            values["local_rope_theta"] = None
        return values

    @property
    def head_size(self) -> int:
        """Channels per attention head."""
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

    @property
    def local_layers(self) -> tuple[bool, ...]:
        """Whether each layer attends through the sliding window (a local layer)."""
        if self.sliding_window is None:
            return (False,) * self.n_layers
        every = self.global_every
        return tuple(every is None or (layer + 1) % every != 0 for layer in range(self.n_layers))


def family_problems(dims: ModelDims) -> list[str]:
    """What in `dims` its family cannot have ([] when nothing): each says the field and why."""
    traits = FAMILIES[dims.family]
    problems = []
    if dims.sliding_window is not None and traits.windows == "none":
        problems.append(f"slidingWindow: {dims.family} attends over the whole sequence in "
                        "every layer; only mistral and gemma3 have sliding windows")
    if dims.global_every is not None and traits.windows != "interleaved":
        problems.append(f"globalEvery: {dims.family} has no local and global layers to "
                        "interleave; only gemma3 does")
    if dims.global_every is not None and dims.sliding_window is None:
        problems.append("globalEvery: interleaves local layers with global ones, and without "
                        "slidingWindow there are no local layers")
    if dims.local_rope_theta is not None and not traits.local_rope:
        problems.append(f"localRopeTheta: {dims.family} has one rotary base for every layer")
    if dims.rope_scaling is not None and dims.rope_scaling.kind not in traits.rope_scalings:
        kinds = " or ".join(traits.rope_scalings) or "none"
        problems.append(f"ropeScaling: {dims.family} has no {dims.rope_scaling.kind} rotary "
                        f"scaling (its configuration expresses {kinds})")
    if dims.query_scale_dim is not None and not traits.query_scale:
        problems.append(f"queryScaleDim: {dims.family} scales attention scores by "
                        "1/sqrt(head size)")
    if dims.head_size % 2:
        problems.append(f"headDim: the head size ({dims.head_size}) must be even for rotary "
                        "embeddings")
    return problems


@dataclass(frozen=True)
class Preset:
    """Architecture of one preset and the optimisation defaults of its scale."""

    dims: ModelDims
    learning_rate: float
    warmup_steps: int
    global_batch_tokens: int


def _llama(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, vocab_size: int,
           ffn_dim: int, tie_embeddings: bool, rope_theta: float) -> ModelDims:
    return ModelDims(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                     vocab_size=vocab_size, ffn_dim=ffn_dim, tie_embeddings=tie_embeddings,
                     rope_theta=rope_theta)


PRESETS: dict[str, Preset] = {
    # A few hundred thousand parameters: trains on a CPU in seconds, for tests and the demo.
    "tiny": Preset(_llama(64, 2, 4, 2, 2048, 192, True, 10_000.0),
                   learning_rate=3e-3, warmup_steps=20, global_batch_tokens=8_192),
    "llama-125m": Preset(_llama(768, 12, 12, 12, 32_000, 2048, True, 10_000.0),
                         learning_rate=6e-4, warmup_steps=700, global_batch_tokens=524_288),
    "llama-350m": Preset(_llama(1024, 24, 16, 16, 32_000, 2816, True, 10_000.0),
                         learning_rate=3e-4, warmup_steps=1000, global_batch_tokens=524_288),
    "llama-1b": Preset(_llama(2048, 16, 32, 8, 128_256, 8192, True, 500_000.0),
                       learning_rate=3e-4, warmup_steps=2000, global_batch_tokens=1_048_576),
    "llama-3b": Preset(_llama(3072, 28, 24, 8, 128_256, 8192, True, 500_000.0),
                       learning_rate=3e-4, warmup_steps=2000, global_batch_tokens=2_097_152),
    "llama-7b": Preset(_llama(4096, 32, 32, 32, 32_000, 11_008, False, 10_000.0),
                       learning_rate=3e-4, warmup_steps=2000, global_batch_tokens=4_194_304),
    "llama-8b": Preset(_llama(4096, 32, 32, 8, 128_256, 14_336, False, 500_000.0),
                       learning_rate=3e-4, warmup_steps=2000, global_batch_tokens=4_194_304),
    # Llama 3 70B's shape: sized for several nodes (kubetrain estimate; docs/training.md).
    "llama-70b": Preset(_llama(8192, 80, 64, 8, 128_256, 28_672, False, 500_000.0),
                        learning_rate=1.5e-4, warmup_steps=2000, global_batch_tokens=4_194_304),
}


def _qwen3(dim: int, n_layers: int, n_heads: int, ffn_dim: int, tie_embeddings: bool) -> ModelDims:
    """Qwen3 dense: 8 key/value heads of 128 channels, a 151,936-token vocabulary."""
    return ModelDims(family="qwen3", dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=8,
                     head_dim=128, vocab_size=151_936, ffn_dim=ffn_dim,
                     tie_embeddings=tie_embeddings, rope_theta=1_000_000.0, norm_eps=1e-6)


def _gemma3(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_dim: int,
            vocab_size: int, window: int, scaling: RopeScaling | None) -> ModelDims:
    """Gemma 3 text: heads of 256, five local layers to each global one, rotary bases of
    10,000 (local) and 1,000,000 (global, stretched 8x from 4B up)."""
    return ModelDims(family="gemma3", dim=dim, n_layers=n_layers, n_heads=n_heads,
                     n_kv_heads=n_kv_heads, head_dim=256, vocab_size=vocab_size, ffn_dim=ffn_dim,
                     tie_embeddings=True, rope_theta=1_000_000.0, norm_eps=1e-6,
                     sliding_window=window, global_every=6, local_rope_theta=10_000.0,
                     rope_scaling=scaling, query_scale_dim=256)


_EIGHTFOLD = RopeScaling(kind="linear", factor=8.0)

PRESETS.update({
    # Fine-tuning defaults (see the module docstring): start these from model.init.
    "qwen3-0.6b": Preset(_qwen3(1024, 28, 16, 3072, True),
                         learning_rate=5e-5, warmup_steps=50, global_batch_tokens=262_144),
    "qwen3-1.7b": Preset(_qwen3(2048, 28, 16, 6144, True),
                         learning_rate=3e-5, warmup_steps=50, global_batch_tokens=262_144),
    "qwen3-4b": Preset(_qwen3(2560, 36, 32, 9728, True),
                       learning_rate=2e-5, warmup_steps=100, global_batch_tokens=524_288),
    "qwen3-8b": Preset(_qwen3(4096, 36, 32, 12_288, False),
                       learning_rate=1e-5, warmup_steps=100, global_batch_tokens=524_288),
    "qwen2.5-7b": Preset(ModelDims(family="qwen2", dim=3584, n_layers=28, n_heads=28,
                                   n_kv_heads=4, vocab_size=152_064, ffn_dim=18_944,
                                   tie_embeddings=False, rope_theta=1_000_000.0, norm_eps=1e-6),
                         learning_rate=1e-5, warmup_steps=100, global_batch_tokens=524_288),
    # Mistral 7B v0.3: no sliding window (v0.1's was 4096), a 32,768-token vocabulary.
    "mistral-7b": Preset(ModelDims(family="mistral", dim=4096, n_layers=32, n_heads=32,
                                   n_kv_heads=8, vocab_size=32_768, ffn_dim=14_336,
                                   tie_embeddings=False, rope_theta=1_000_000.0, norm_eps=1e-5),
                         learning_rate=1e-5, warmup_steps=100, global_batch_tokens=524_288),
    "gemma3-1b": Preset(_gemma3(1152, 26, 4, 1, 6912, 262_144, 512, None),
                        learning_rate=3e-5, warmup_steps=50, global_batch_tokens=262_144),
    "gemma3-4b": Preset(_gemma3(2560, 34, 8, 4, 10_240, 262_208, 1024, _EIGHTFOLD),
                        learning_rate=2e-5, warmup_steps=100, global_batch_tokens=524_288),
    "gemma3-12b": Preset(_gemma3(3840, 48, 16, 8, 15_360, 262_208, 1024, _EIGHTFOLD),
                         learning_rate=1e-5, warmup_steps=100, global_batch_tokens=524_288),
})

PresetName = Literal[
    "tiny", "llama-125m", "llama-350m", "llama-1b", "llama-3b", "llama-7b", "llama-8b",
    "llama-70b", "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen2.5-7b",
    "mistral-7b", "gemma3-1b", "gemma3-4b", "gemma3-12b",
]
PRESET_NAMES: tuple[str, ...] = get_args(PresetName)
assert set(PRESET_NAMES) == set(PRESETS), "PresetName and PRESETS disagree"
