"""Model presets: architecture dimensions plus the training defaults of their scale.

Torch-free data shared by the API (valid preset names, defaults), the trainer
(building the model) and the memory planner. Dimensions follow the Llama family;
the hyperparameter defaults follow the GPT-3 / Llama papers' choices for each size
(smaller models take larger learning rates and smaller batches).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args


@dataclass(frozen=True)
class Preset:
    """Architecture of one preset and the optimisation defaults of its scale."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_dim: int
    tie_embeddings: bool
    rope_theta: float
    learning_rate: float
    warmup_steps: int
    global_batch_tokens: int


PRESETS: dict[str, Preset] = {
    # A few hundred thousand parameters: trains on a CPU in seconds, for tests and the demo.
    "tiny": Preset(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=2048, ffn_dim=192,
        tie_embeddings=True, rope_theta=10_000.0,
        learning_rate=3e-3, warmup_steps=20, global_batch_tokens=8_192,
    ),
    "llama-125m": Preset(
        dim=768, n_layers=12, n_heads=12, n_kv_heads=12, vocab_size=32_000, ffn_dim=2048,
        tie_embeddings=True, rope_theta=10_000.0,
        learning_rate=6e-4, warmup_steps=700, global_batch_tokens=524_288,
    ),
    "llama-350m": Preset(
        dim=1024, n_layers=24, n_heads=16, n_kv_heads=16, vocab_size=32_000, ffn_dim=2816,
        tie_embeddings=True, rope_theta=10_000.0,
        learning_rate=3e-4, warmup_steps=1000, global_batch_tokens=524_288,
    ),
    "llama-1b": Preset(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128_256, ffn_dim=8192,
        tie_embeddings=True, rope_theta=500_000.0,
        learning_rate=3e-4, warmup_steps=2000, global_batch_tokens=1_048_576,
    ),
    "llama-3b": Preset(
        dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128_256, ffn_dim=8192,
        tie_embeddings=True, rope_theta=500_000.0,
        learning_rate=3e-4, warmup_steps=2000, global_batch_tokens=2_097_152,
    ),
    "llama-7b": Preset(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=32_000, ffn_dim=11_008,
        tie_embeddings=False, rope_theta=10_000.0,
        learning_rate=3e-4, warmup_steps=2000, global_batch_tokens=4_194_304,
    ),
    "llama-8b": Preset(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128_256, ffn_dim=14_336,
        tie_embeddings=False, rope_theta=500_000.0,
        learning_rate=3e-4, warmup_steps=2000, global_batch_tokens=4_194_304,
    ),
}

PresetName = Literal[
    "tiny", "llama-125m", "llama-350m", "llama-1b", "llama-3b", "llama-7b", "llama-8b"
]
PRESET_NAMES: tuple[str, ...] = get_args(PresetName)
assert set(PRESET_NAMES) == set(PRESETS), "PresetName and PRESETS disagree"
