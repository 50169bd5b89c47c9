"""Each model family's Hugging Face format: its config.json and tensor names, both ways.

model.init reads a folder's config.json into ModelDims with `read_dims` (through
pretrained_config.py, which also handles kubetrain's own markers) and export.py writes
ModelDims back with `write_config`; `block_name` maps a block's tensor names, the same
table both ways. What a family's block is made of lives in kubetrain.api.families; this
module only says how transformers spells it:

    family   model_type   class               block norms (kubetrain -> transformers)
    llama    llama        LlamaForCausalLM    attention_norm -> input_layernorm,
    qwen2    qwen2        Qwen2ForCausalLM    ffn_norm -> post_attention_layernorm
    qwen3    qwen3        Qwen3ForCausalLM
    mistral  mistral      MistralForCausalLM
    gemma3   gemma3_text  Gemma3ForCausalLM   attention_norm -> input_layernorm,
                                              post_attention_norm -> post_attention_layernorm,
                                              ffn_norm -> pre_feedforward_layernorm,
                                              post_ffn_norm -> post_feedforward_layernorm

A configuration kubetrain cannot build exactly is refused naming the key, never
approximated: an activation, bias, logit soft-cap or rotary scaling the family's block
does not have, Qwen's optional sliding window, or Gemma 3 local and global layers that
do not alternate as every Nth layer global. Both the layout transformers 5 writes
(`rope_parameters`, per layer type for Gemma 3) and the older one (`rope_theta`,
`rope_scaling`, `rope_local_base_freq`, `sliding_window_pattern`), which most folders on
the hub still have, are read. Torch-free, like pretrained_config.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubetrain.api.families import FAMILIES, FAMILY_NAMES
from kubetrain.api.presets import ModelDims, RopeScaling, family_problems

Refuse = Callable[[str], Exception]


@dataclass(frozen=True)
class HfFamily:
    """How transformers names a family: config.json's model_type and the model class."""

    model_type: str
    architecture: str


HF_FAMILIES: dict[str, HfFamily] = {
    "llama": HfFamily("llama", "LlamaForCausalLM"),
    "qwen2": HfFamily("qwen2", "Qwen2ForCausalLM"),
    "qwen3": HfFamily("qwen3", "Qwen3ForCausalLM"),
    "mistral": HfFamily("mistral", "MistralForCausalLM"),
    "gemma3": HfFamily("gemma3_text", "Gemma3ForCausalLM"),
}
assert set(HF_FAMILIES) == set(FAMILY_NAMES), "every family needs its Hugging Face names"
MODEL_TYPES = {hf.model_type: family for family, hf in HF_FAMILIES.items()}


@dataclass(frozen=True)
class ImageText:
    """An image-text model whose text decoder is a family's model (Gemma 3 from 4B up is
    one on the hub): model.init trains the decoder and leaves the vision tower in the folder."""

    family: str
    architecture: str
    text_prefixes: dict[str, str]  # a text tensor's prefix in the folder -> the family's
    vision_prefixes: tuple[str, ...]  # tensors of the vision tower and its projector


IMAGE_TEXT = {"gemma3": ImageText(
    "gemma3", "Gemma3ForConditionalGeneration",
    # As transformers saves it (and the hub has it), and as its own classes name it.
    {"language_model.model.": "model.", "language_model.lm_head.": "lm_head.",
     "model.language_model.": "model."},
    ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
     "model.multi_modal_projector."))}


def text_tensor_name(name: str, image_text: ImageText) -> str | None:
    """The family's name of an image-text folder's tensor; None for the vision tower's."""
    if name.startswith(image_text.vision_prefixes):
        return None
    for prefix, replaced in image_text.text_prefixes.items():
        if name.startswith(prefix):
            return replaced + name.removeprefix(prefix)
    return name


# A block's tensors, after `layers.{i}.` (kubetrain) and `model.layers.{i}.` (transformers).
_BLOCK_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
# With norms after each branch (Gemma), "post attention" means after attention's output.
_POST_NORM_NAMES = _BLOCK_NAMES | {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffn_norm.weight": "post_feedforward_layernorm.weight",
}
# Tensors whose rows are each head's rotary channels: kubetrain rotates interleaved pairs,
# transformers the two halves of a head, so import and export permute their rows per head.
ROTATED_ROWS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                "self_attn.q_proj.bias", "self_attn.k_proj.bias",
                "self_attn.q_norm.weight", "self_attn.k_norm.weight")

GLOBAL, LOCAL = "full_attention", "sliding_attention"  # transformers' layer_types
GEMMA_GELU = "gelu_pytorch_tanh"


def block_name(name: str, dims: ModelDims) -> str | None:
    """The transformers name of a block tensor (`name` after `layers.{i}.`), None if the
    family's block has no such tensor in transformers."""
    names = _POST_NORM_NAMES if FAMILIES[dims.family].post_norms else _BLOCK_NAMES
    return names.get(name)


def family_of(model_type: object) -> str | None:
    """The family whose config.json says `model_type`, None when kubetrain builds none."""
    return MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None


def read_dims(config: dict[str, Any], family: str, refuse: Refuse) -> ModelDims:
    """The dimensions a `family` config.json describes, or `refuse(message)` raised."""
    traits = FAMILIES[family]
    _check_block(config, family, refuse)

    def integer(key: str, default: int | None = None) -> int:
        value = config.get(key, default)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise refuse(f"needs {key} as a positive integer, found {value!r}")
        return value

    dim, n_heads = integer("hidden_size"), integer("num_attention_heads")
    n_kv_heads = integer("num_key_value_heads", n_heads)
    if config.get("head_dim") is None and dim % n_heads:
        raise refuse(f"has hidden_size {dim} and num_attention_heads {n_heads} but no head_dim: "
                     "the heads must divide hidden_size, or head_dim say the head size")
    head_dim = integer("head_dim") if config.get("head_dim") is not None else dim // n_heads
    if n_heads % n_kv_heads or head_dim % 2:
        raise refuse(f"has num_attention_heads {n_heads}, num_key_value_heads {n_kv_heads} and "
                     f"a head size of {head_dim}: kubetrain needs the key/value heads to "
                     "divide the heads, and an even head size for rotary embeddings")
    norm_eps = config.get("rms_norm_eps", 1e-6)  # transformers' default in every family
    if isinstance(norm_eps, bool) or not isinstance(norm_eps, int | float) or norm_eps <= 0:
        raise refuse(f"needs rms_norm_eps as a positive number, found {norm_eps!r}")
    n_layers = integer("num_hidden_layers")
    window, global_every = _windows(config, family, n_layers, refuse)
    rope_theta, local_theta, scaling = _rope(config, family, refuse)
    dims = ModelDims(
        family=family, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
        head_dim=head_dim, vocab_size=integer("vocab_size"),
        ffn_dim=integer("intermediate_size"),
        tie_embeddings=bool(config.get("tie_word_embeddings", traits.tied_by_default)),
        rope_theta=rope_theta, norm_eps=float(norm_eps), sliding_window=window,
        global_every=global_every, local_rope_theta=local_theta, rope_scaling=scaling,
        query_scale_dim=integer("query_pre_attn_scalar", 256) if traits.query_scale else None)
    problems = family_problems(dims)
    if problems:  # read_dims builds only what the family has: a bug, said plainly
        raise refuse(f"describes a model its family cannot have: {'; '.join(problems)}")
    return dims


def _check_block(config: dict[str, Any], family: str, refuse: Refuse) -> None:
    """Refuse the block options kubetrain's block for `family` does not have."""
    traits = FAMILIES[family]
    if traits.gelu:
        activation = config.get("hidden_activation") or config.get("hidden_act") or GEMMA_GELU
        if activation != GEMMA_GELU:
            raise refuse(f"has hidden_activation {activation!r}: kubetrain's {family} "
                         f"feed-forward is GeGLU with tanh-approximated GELU ({GEMMA_GELU})")
    elif config.get("hidden_act", "silu") != "silu":
        raise refuse(f"has hidden_act {config['hidden_act']!r}: kubetrain's feed-forward "
                     "is SwiGLU (silu)")
    for bias in ("attention_bias", "mlp_bias"):
        if config.get(bias):
            which = ("only q, k and v" if traits.qkv_bias else "none")
            raise refuse(f"has {bias}: true: in kubetrain's {family} block {which} of the "
                         "projections have a bias")
    for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
        if config.get(cap) is not None:
            raise refuse(f"has {cap} {config[cap]!r}: kubetrain's {family} has no logit "
                         "soft-capping (Gemma 3's released models have none)")
    if config.get("partial_rotary_factor", 1.0) != 1.0:
        raise refuse(f"has partial_rotary_factor {config['partial_rotary_factor']!r}: "
                     "kubetrain rotates every channel of a head")
    if config.get("use_bidirectional_attention"):
        raise refuse("has use_bidirectional_attention: true: kubetrain trains causal "
                     "language models")


def _windows(config: dict[str, Any], family: str, n_layers: int,
             refuse: Refuse) -> tuple[int | None, int | None]:
    """The sliding window and how often a global layer comes (see ModelDims)."""
    windows = FAMILIES[family].windows
    if windows == "none":
        if config.get("use_sliding_window"):
            raise refuse(f"has use_sliding_window: true: kubetrain builds {family}'s attention "
                         "over the whole sequence in every layer, as the released models use "
                         "it; set use_sliding_window to false or use another folder")
        kinds = config.get("layer_types") or []
        if any(kind != GLOBAL for kind in kinds):
            raise refuse(f"has layer_types {sorted(set(kinds))}: kubetrain's {family} layers "
                         f"all attend over the whole sequence ({GLOBAL})")
        return None, None
    window = config.get("sliding_window", None if windows == "every_layer" else 4096)
    if window is None:
        return None, None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise refuse(f"needs sliding_window as a positive integer or null, found {window!r}")
    if windows == "every_layer":
        return window, None
    kinds = config.get("layer_types")
    if kinds is None:  # before layer_types: every Nth layer global (transformers 4's Gemma 3)
        every = config.get("sliding_window_pattern", config.get("_sliding_window_pattern", 6))
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise refuse(f"needs sliding_window_pattern as a positive integer, found {every!r}")
        kinds = [LOCAL if (layer + 1) % every else GLOBAL for layer in range(n_layers)]
    if not isinstance(kinds, list) or len(kinds) != n_layers or \
            any(kind not in (GLOBAL, LOCAL) for kind in kinds):
        raise refuse(f"has layer_types {kinds!r}: kubetrain needs one of {GLOBAL} and {LOCAL} "
                     f"for each of the {n_layers} layers")
    if LOCAL not in kinds:
        return None, None
    if GLOBAL not in kinds:
        return window, None
    every = kinds.index(GLOBAL) + 1
    if kinds != [LOCAL if (layer + 1) % every else GLOBAL for layer in range(n_layers)]:
        raise refuse(f"has layer_types {kinds}: kubetrain builds {family}'s local and global "
                     "layers as every Nth layer global (layers N-1, 2N-1, ...), as the "
                     "released models have them")
    return window, every


def _rope(config: dict[str, Any], family: str,
          refuse: Refuse) -> tuple[float, float | None, RopeScaling | None]:
    """The global rotary base, the local layers' base (None: the same) and the global
    layers' scaling (None: none)."""
    traits = FAMILIES[family]
    default_theta = 1_000_000.0 if traits.local_rope else 10_000.0
    parameters = config.get("rope_parameters")
    if traits.local_rope and isinstance(parameters, dict) and GLOBAL in parameters:
        theta, scaling = _rope_entry(parameters[GLOBAL], f"rope_parameters.{GLOBAL}", family,
                                     refuse)
        local, local_scaling = _rope_entry(parameters.get(LOCAL) or {},
                                           f"rope_parameters.{LOCAL}", family, refuse)
        if local_scaling is not None:
            raise refuse(f"has rope_parameters.{LOCAL} with rope_type "
                         f"{local_scaling.kind!r}: kubetrain scales only the global layers' "
                         "rotary frequencies, as Gemma 3 does")
        return _theta(theta, default_theta, refuse), _theta(local, 10_000.0, refuse), scaling
    # transformers 5 writes rope_parameters, older versions rope_scaling: either, or both
    # when they agree.
    read = [(key, _rope_entry(config[key], key, family, refuse))
            for key in ("rope_parameters", "rope_scaling") if config.get(key) is not None]
    theta, scaling = read[0][1] if read else (None, None)
    if len(read) == 2 and read[0][1][1] != read[1][1][1]:
        raise refuse(f"has rope_parameters and rope_scaling that disagree ({parameters!r} and "
                     f"{config['rope_scaling']!r}): remove the one that is not the model's")
    theta = theta if theta is not None else config.get("rope_theta")
    local = config.get("rope_local_base_freq", 10_000.0) if traits.local_rope else None
    return (_theta(theta, default_theta, refuse),
            None if local is None else _theta(local, 10_000.0, refuse), scaling)


def _theta(value: object, default: float, refuse: Refuse) -> float:
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise refuse(f"needs rope_theta as a positive number, found {value!r}")
    return float(value)


def _rope_entry(entry: object, key: str, family: str,
                refuse: Refuse) -> tuple[object, RopeScaling | None]:
    """One rotary parameter set: its base (None when it has none) and its scaling."""
    if not isinstance(entry, dict):
        raise refuse(f"has {key} {entry!r}: kubetrain reads rotary parameters as an object")
    kind = entry.get("rope_type", entry.get("type", "default"))
    theta = entry.get("rope_theta")
    if kind == "default":
        return theta, None
    allowed = FAMILIES[family].rope_scalings
    if kind not in allowed:
        supported = f"default or {' or '.join(allowed)}" if allowed else "default, unscaled"
        raise refuse(f"has {key} with rope_type {kind!r}: kubetrain builds {family}'s rotary "
                     f"embeddings as rope_type {supported}")

    def number(name: str) -> float:
        value = entry.get(name)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise refuse(f"needs {key}.{name} as a positive number for rope_type {kind!r}, "
                         f"found {value!r}")
        return float(value)

    if kind == "linear":
        return theta, RopeScaling(kind="linear", factor=number("factor"))
    return theta, RopeScaling(
        kind="llama3", factor=number("factor"), low_freq_factor=number("low_freq_factor"),
        high_freq_factor=number("high_freq_factor"),
        original_max_positions=int(number("original_max_position_embeddings")))


def write_config(dims: ModelDims, max_seq_len: int, eos_token_id: int) -> dict[str, Any]:
    """The config.json from which transformers builds `dims` as the family's *ForCausalLM."""
    hf, traits = HF_FAMILIES[dims.family], FAMILIES[dims.family]
    config: dict[str, Any] = {
        "architectures": [hf.architecture],
        "model_type": hf.model_type,
        "vocab_size": dims.vocab_size,
        "hidden_size": dims.dim,
        "intermediate_size": dims.ffn_dim,
        "num_hidden_layers": dims.n_layers,
        "num_attention_heads": dims.n_heads,
        "num_key_value_heads": dims.n_kv_heads,
        "head_dim": dims.head_size,
        **({"hidden_activation": GEMMA_GELU} if traits.gelu else {"hidden_act": "silu"}),
        "max_position_embeddings": max_seq_len,
        "rms_norm_eps": dims.norm_eps,
        "rope_theta": dims.rope_theta,
        "rope_parameters": _rope_parameters(dims.rope_theta, dims.rope_scaling),
        "tie_word_embeddings": dims.tie_embeddings,
        "attention_bias": False,
    }
    if dims.family == "llama":
        config["mlp_bias"] = False
    if dims.family in ("qwen2", "qwen3"):
        config |= {"use_sliding_window": False, "sliding_window": None,
                   "layer_types": [GLOBAL] * dims.n_layers}
    if dims.family == "mistral":
        config["sliding_window"] = dims.sliding_window
    if dims.family == "gemma3":
        del config["rope_theta"]
        config |= {
            "query_pre_attn_scalar": dims.query_scale_dim or dims.head_size,
            "sliding_window": dims.sliding_window or max_seq_len,
            "layer_types": [LOCAL if local else GLOBAL for local in dims.local_layers],
            "rope_parameters": {
                GLOBAL: _rope_parameters(dims.rope_theta, dims.rope_scaling),
                LOCAL: _rope_parameters(dims.local_rope_theta or dims.rope_theta, None)},
            "final_logit_softcapping": None, "attn_logit_softcapping": None,
            "use_bidirectional_attention": False}
    config |= {"bos_token_id": eos_token_id, "eos_token_id": eos_token_id,
               "torch_dtype": "float32"}
    return config


def _rope_parameters(theta: float, scaling: RopeScaling | None) -> dict[str, Any]:
    if scaling is None:
        return {"rope_type": "default", "rope_theta": theta}
    if scaling.kind == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": scaling.factor}
    return {"rope_type": "llama3", "rope_theta": theta, "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_positions}
