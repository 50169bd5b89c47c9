"""The config.json of a `model.init` folder: read, checked, and compared with the job.

Which Llama configurations kubetrain can build (model_type llama, SiLU, no
attention or MLP bias, rotary embeddings without scaling, no quantisation) and
which dimensions a config.json gives: anything else is refused naming the key,
never approximated. A `kubetrain` object in config.json marks features of
kubetrain's own exports (extra layers); a marker this version does not know is
refused too, rather than loading the model without those layers' weights.
Torch-free, so `kubetrain estimate` sizes a model.init job from it; the weights
themselves are pretrained.py's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic.alias_generators import to_camel

from kubetrain.api.trainingjob import ModelDims, ModelSpec, StorageSpec, TrainingJobSpec
from kubetrain.trainer.storage import open_storage

CONFIG_NAME = "config.json"
# Keys of config.json's "kubetrain" object that this version builds the layers of.
KNOWN_MARKERS: frozenset[str] = frozenset()

# ModelSpec field -> the config.json key it corresponds to.
CONFIG_KEYS = {
    "dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads", "vocab_size": "vocab_size",
    "ffn_dim": "intermediate_size", "tie_embeddings": "tie_word_embeddings",
    "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps",
}


class PretrainedError(ValueError):
    """The folder cannot initialise this job's model: what is wrong, where, and what to do."""


@dataclass(frozen=True)
class PretrainedConfig:
    """What config.json says: the dimensions, the longest trained context, kubetrain markers."""

    uri: str
    dims: ModelDims
    max_positions: int | None
    markers: dict[str, Any]

    @property
    def where(self) -> str:
        return f"config.json at {self.uri}"


def read_config(uri: str, storage: StorageSpec | None) -> PretrainedConfig:
    """Read and check `<uri>/config.json`; PretrainedError when it is missing or unsupported."""
    store = open_storage(uri, storage)
    try:
        raw = store.read_bytes(CONFIG_NAME)
    except FileNotFoundError:
        raise PretrainedError(
            f"model.init: there is no {CONFIG_NAME} at {store.uri}: point model.init at a "
            "Hugging Face model folder (config.json with safetensors weights), such as "
            "another job's <checkpoint.uri>/export") from None
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as error:
        raise PretrainedError(f"model.init: {CONFIG_NAME} at {store.uri} is not JSON: "
                              f"{error}") from None
    if not isinstance(config, dict):
        raise PretrainedError(f"model.init: {CONFIG_NAME} at {store.uri} is not a JSON object")
    return parse_config(config, store.uri)


def parse_config(config: dict[str, Any], uri: str) -> PretrainedConfig:
    """The checked contents of a config.json read from the folder `uri`."""
    where = f"{CONFIG_NAME} at {uri}"

    def refuse(message: str) -> PretrainedError:
        return PretrainedError(f"model.init: {where} {message}")

    model_type = config.get("model_type")
    if model_type != "llama":
        raise refuse(f"has model_type {model_type!r}: kubetrain builds Llama models "
                     "(model_type llama, LlamaForCausalLM) only")
    architectures = config.get("architectures") or ["LlamaForCausalLM"]
    if "LlamaForCausalLM" not in architectures:
        raise refuse(f"has architectures {architectures}: kubetrain needs a LlamaForCausalLM "
                     "(a language-model head); a bare LlamaModel has none")
    markers = config.get("kubetrain") or {}
    if not isinstance(markers, dict):
        raise refuse(f"has a kubetrain entry that is not an object: {markers!r}")
    unknown = sorted(set(markers) - KNOWN_MARKERS)
    if unknown:
        names = ", ".join(f"kubetrain.{name}" for name in unknown)
        raise refuse(f"marks the model with {names}: it was exported by a kubetrain with a "
                     "feature this version does not build, and loading it would drop those "
                     "layers' weights; start the job with a kubetrain version that has it")
    if config.get("quantization_config"):
        raise refuse("describes a quantised model (quantization_config): kubetrain trains "
                     "from float weights; use the unquantised checkpoint")
    if config.get("hidden_act", "silu") != "silu":
        raise refuse(f"has hidden_act {config['hidden_act']!r}: kubetrain's feed-forward "
                     "is SwiGLU (silu)")
    for bias in ("attention_bias", "mlp_bias"):
        if config.get(bias):
            raise refuse(f"has {bias}: true: kubetrain's projections have no bias")
    rope_theta = _rope_theta(config, refuse)

    def integer(key: str, default: int | None = None) -> int:
        value = config.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise refuse(f"needs {key} as a positive integer, found {value!r}")
        return value

    dim, n_heads = integer("hidden_size"), integer("num_attention_heads")
    n_kv_heads = integer("num_key_value_heads", n_heads)
    if dim % n_heads or n_heads % n_kv_heads or (dim // n_heads) % 2:
        raise refuse(f"has hidden_size {dim}, num_attention_heads {n_heads} and "
                     f"num_key_value_heads {n_kv_heads}: kubetrain needs the heads to divide "
                     "hidden_size into an even head size and the key/value heads to divide "
                     "the heads")
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim != dim // n_heads:
        raise refuse(f"has head_dim {head_dim}, not hidden_size / num_attention_heads "
                     f"({dim // n_heads}): kubetrain derives the head size from those")
    norm_eps = config.get("rms_norm_eps", 1e-6)  # transformers' LlamaConfig default
    if not isinstance(norm_eps, int | float) or norm_eps <= 0:
        raise refuse(f"needs rms_norm_eps as a positive number, found {norm_eps!r}")
    max_positions = config.get("max_position_embeddings")
    dims = ModelDims(
        dim=dim, n_layers=integer("num_hidden_layers"), n_heads=n_heads, n_kv_heads=n_kv_heads,
        vocab_size=integer("vocab_size"), ffn_dim=integer("intermediate_size"),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        rope_theta=rope_theta, norm_eps=float(norm_eps))
    return PretrainedConfig(uri, dims, max_positions if isinstance(max_positions, int) else None,
                            dict(markers))


def _rope_theta(config: dict[str, Any], refuse: Callable[[str], PretrainedError]) -> float:
    """The rotary base, from rope_parameters (transformers 5) or rope_theta, refusing scaling."""
    parameters = config.get("rope_parameters")
    for key in ("rope_scaling", "rope_parameters"):
        value = config.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise refuse(f"has {key} {value!r}: kubetrain supports only plain rotary "
                         "embeddings (rope_type default)")
        rope_type = value.get("rope_type", value.get("type", "default"))
        if rope_type != "default":
            raise refuse(f"has {key} with rope_type {rope_type!r}: kubetrain supports only "
                         "plain rotary embeddings (rope_type default), without scaling")
    theta = (parameters or {}).get("rope_theta", config.get("rope_theta", 10_000.0))
    if isinstance(theta, bool) or not isinstance(theta, int | float) or theta <= 0:
        raise refuse(f"needs rope_theta as a positive number, found {theta!r}")
    return float(theta)


def check_model_spec(model: ModelSpec, config: PretrainedConfig) -> None:
    """Refuse a spec.model dimension that disagrees with config.json, naming both values.

    normEps is compared only when it is not the default (1e-5): a manifest that leaves it
    out cannot be told from one that writes the default, and the API server fills it in.
    """
    default_eps = ModelSpec.model_fields["norm_eps"].default
    conflicts = []
    for field, key in CONFIG_KEYS.items():
        value = getattr(model, field)
        if value is None or (field == "norm_eps" and value == default_eps):
            continue
        found = getattr(config.dims, field)
        if value != found:
            name = f"model.{to_camel(field)}"
            conflicts.append(f"spec.{name} is {_show(value)} but {config.where} says {key} "
                             f"{_show(found)}: remove {name} or set it to {_show(found)}")
    if conflicts:
        raise PretrainedError("; ".join(conflicts) + " (model.init takes the architecture "
                              "from config.json)")


def _show(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def job_dims(spec: TrainingJobSpec) -> ModelDims:
    """The dimensions of the job's model: config.json's with model.init, else the spec's.

    With model.init, also refuses dimensions set in spec.model that disagree and a
    data.seqLen longer than the model's max_position_embeddings. A spec without
    vocabSize takes its vocabulary from the data (the caller's part).
    """
    if spec.model.init is None:
        return spec.model.resolve()
    config = read_config(spec.model.init, spec.storage)
    check_model_spec(spec.model, config)
    if config.max_positions is not None and spec.data.seq_len > config.max_positions:
        raise PretrainedError(
            f"spec.data.seqLen ({spec.data.seq_len}) is longer than max_position_embeddings "
            f"({config.max_positions}) in {config.where}: the model was not trained on "
            "positions that far; lower data.seqLen")
    return config.dims


def check_vocabulary(dims: ModelDims, data_vocab_size: int, uri: str) -> None:
    """Refuse training data whose token ids the pretrained model has no embedding for."""
    if data_vocab_size > dims.vocab_size:
        raise PretrainedError(
            f"the training data's tokenizer has {data_vocab_size} tokens but the model at "
            f"model.init ({uri}) has vocab_size {dims.vocab_size}: prepare the data with the "
            "model's own tokenizer (kubetrain prepare --tokenizer <model.init>/tokenizer.json)")
