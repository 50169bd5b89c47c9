"""Model families: the Llama block, and the few switches by which Qwen, Mistral and Gemma differ.

Torch-free data shared by the API (the family names, what each may set), the trainer's
model (which pieces each block has: model.py), sizing (what those pieces count) and import
and export (hf_families.py). A family is a set of switches on one block, never a model of
its own:

    family   q/k/v bias  q/k norm   norm scale  feed-forward  embeddings  norms per block
    llama    -           -          w           SwiGLU        x           2 (before)
    qwen2    q, k, v     -          w           SwiGLU        x           2
    qwen3    -           each head  w           SwiGLU        x           2
    mistral  -           -          w           SwiGLU        x           2
    gemma3   -           each head  1 + w       GeGLU (tanh)  x * sqrt(d) 4 (before and after)

What varies within a family is a ModelDims field (presets.py): the head size, the attention
windows (Mistral's on every layer, Gemma 3's local layers between global ones), the rotary
bases and scaling, Gemma's attention scale. `presets.family_problems`, beside ModelDims,
says which of those a family's Hugging Face configuration can express, so that nothing is
trained that its export would describe wrongly. This module imports nothing of the API's:
presets.py stands on it, not the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

Family = Literal["llama", "qwen2", "qwen3", "mistral", "gemma3"]
FAMILY_NAMES: tuple[str, ...] = get_args(Family)
Windows = Literal["none", "every_layer", "interleaved"]


@dataclass(frozen=True)
class FamilyTraits:
    """How a family's block differs from Llama's, and which dimensions it can have."""

    qkv_bias: bool = False  # a bias on the query, key and value projections (not the output)
    qk_norm: bool = False  # an RMSNorm over each query and key head, before the rotation
    unit_offset_norms: bool = False  # RMSNorm scales by 1 + weight (weights start at zero)
    gelu: bool = False  # the feed-forward gate is tanh-approximated GELU, not SiLU
    scaled_embeddings: bool = False  # token embeddings times sqrt(dim)
    post_norms: bool = False  # an RMSNorm on attention's and the feed-forward's outputs too
    tied_by_default: bool = False  # tie_word_embeddings when config.json leaves it out
    windows: Windows = "none"  # sliding-window attention: on which layers it may be
    rope_scalings: tuple[str, ...] = ()  # the RopeScaling kinds its config can express
    local_rope: bool = False  # local layers have a rotary base of their own
    query_scale: bool = False  # scores may be scaled by other than 1/sqrt(head size)


FAMILIES: dict[str, FamilyTraits] = {
    "llama": FamilyTraits(rope_scalings=("linear", "llama3")),
    "qwen2": FamilyTraits(qkv_bias=True),
    "qwen3": FamilyTraits(qk_norm=True),
    "mistral": FamilyTraits(windows="every_layer"),
    "gemma3": FamilyTraits(qk_norm=True, unit_offset_norms=True, gelu=True,
                           scaled_embeddings=True, post_norms=True, tied_by_default=True,
                           windows="interleaved", rope_scalings=("linear",), local_rope=True,
                           query_scale=True),
}
assert set(FAMILIES) == set(FAMILY_NAMES), "Family and FAMILIES disagree"
