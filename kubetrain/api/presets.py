"""Model presets: architecture dimensions plus the training defaults of their scale.

Torch-free data shared by the API (valid preset names, defaults), the trainer
(building the model) and the memory planner. Dimensions follow the Llama family;
the hyperparameter defaults follow the GPT-3 / Llama papers' choices for each size
(smaller models take larger learning rates and smaller batches).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict


class ModelDims(BaseModel):
    """The dimensions that define a model's architecture."""

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

PresetName = Literal[
    "tiny", "llama-125m", "llama-350m", "llama-1b", "llama-3b", "llama-7b", "llama-8b",
    "llama-70b",
]
PRESET_NAMES: tuple[str, ...] = get_args(PresetName)
assert set(PRESET_NAMES) == set(PRESETS), "PresetName and PRESETS disagree"
