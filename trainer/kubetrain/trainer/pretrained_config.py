"""The config.json of a `model.init` folder: read, checked, and compared with the job.

Which configurations kubetrain can build - the families of kubetrain.api.families
(model_type llama, qwen2, qwen3, mistral, gemma3_text), each as hf_families.py reads it,
from float weights - and which dimensions a config.json gives: anything else is refused
naming the key, never approximated. A `kubetrain` object in config.json marks features of
kubetrain's own exports (extra layers); a marker this version does not know is
refused too, rather than loading the model without those layers' weights. The
one it knows is `dynamics` (INL dynamics, `model.dynamics`), whose format -
model_type, architectures and marker, which export.py writes with
`dynamics_config` - lives here so that reader and writer share it. A model.init
job's `model.dynamics` is its folder's (`trained_model`); so are a distillation
teacher's (`teacher_config`). The other is `ssm`: a state-space model (ssm.py,
`model.architecture: ssm`), model_type kubetrain_ssm, whose marker records the mixer's
constants (`ssm_config`); a model.init job's architecture is its folder's too. A
`model.fromTeacher` job takes its dimensions from the teacher's config.json
(`trained_model`), checked against the spec as model.init's are: a transformer student
is of the teacher's family, an SSM student takes only its widths (`teacher_dims`).
Torch-free, so `kubetrain estimate` sizes a model.init job from it; the weights
themselves are pretrained.py's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic.alias_generators import to_camel

from kubetrain.api.trainingjob import (
    DynamicsSpec,
    ModelDims,
    ModelSpec,
    StorageSpec,
    TrainingJobSpec,
)
from kubetrain.sizing import (
    CONTROLLER_WIDTH,
    SSM_CONV_WIDTH,
    SSM_EXPAND,
    SSM_STATE_SIZE,
)
from kubetrain.trainer.hf_families import HF_FAMILIES, IMAGE_TEXT, family_of, read_dims
from kubetrain.trainer.storage import open_storage

CONFIG_NAME = "config.json"
TEACHER_FIELD = "spec.distillation.teacher"
LLAMA_FAMILY = "llama"
# A model with INL dynamics: a model_type transformers does not know, so it refuses the
# folder instead of loading the Llama part and dropping the dynamics' tensors.
DYNAMICS_MODEL_TYPE, DYNAMICS_ARCHITECTURE = "kubetrain_dynamics", "KubetrainDynamicsForCausalLM"
# Keys of config.json's "kubetrain" object that this version builds the layers of.
KNOWN_MARKERS: frozenset[str] = frozenset({"dynamics", "ssm"})
DYNAMICS_MARKER_KEYS = ("betaMax", "velocityMax", "controllerWidth")
# A state-space model (ssm.py): likewise unknown to transformers, and its mixer's constants.
SSM_MODEL_TYPE, SSM_ARCHITECTURE = "kubetrain_ssm", "KubetrainSSMForCausalLM"
SSM_MARKER = {"expand": SSM_EXPAND, "stateSize": SSM_STATE_SIZE, "convWidth": SSM_CONV_WIDTH}

# ModelSpec field -> the config.json key it corresponds to.
CONFIG_KEYS = {
    "family": "family (model_type)", "dim": "hidden_size", "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim", "vocab_size": "vocab_size", "ffn_dim": "intermediate_size",
    "tie_embeddings": "tie_word_embeddings", "rope_theta": "rope_theta",
    "norm_eps": "rms_norm_eps",
}
# ModelDims attributes to compare a ModelSpec field with, where not the field's own name.
_COMPARED_AS = {"head_dim": "head_size"}


class PretrainedError(ValueError):
    """The folder cannot initialise this job's model: what is wrong, where, and what to do."""


@dataclass(frozen=True)
class PretrainedConfig:
    """What config.json says: the dimensions, the longest trained context, kubetrain markers
    and the INL dynamics they describe (disabled without the marker)."""

    uri: str
    dims: ModelDims
    max_positions: int | None
    markers: dict[str, Any]
    dynamics: DynamicsSpec
    architecture: str = "transformer"  # ModelSpec.architecture: "ssm" for a kubetrain_ssm
    image_text: bool = False  # an image-text model's folder, of which the text decoder is read

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

    markers = config.get("kubetrain") or {}
    if not isinstance(markers, dict):
        raise refuse(f"has a kubetrain entry that is not an object: {markers!r}")
    unknown = sorted(set(markers) - KNOWN_MARKERS)
    if unknown:
        names = ", ".join(f"kubetrain.{name}" for name in unknown)
        raise refuse(f"marks the model with {names}: it was exported by a kubetrain with a "
                     "feature this version does not build, and loading it would drop those "
                     "layers' weights; start the job with a kubetrain version that has it")
    dynamics = _dynamics(markers.get("dynamics"), refuse)
    model_type = config.get("model_type")
    ssm = _ssm(markers.get("ssm"), model_type, refuse)
    if dynamics.enabled and model_type != DYNAMICS_MODEL_TYPE:
        raise refuse(f"marks kubetrain.dynamics but has model_type {model_type!r}: kubetrain "
                     f"exports a model with INL dynamics as model_type {DYNAMICS_MODEL_TYPE}, "
                     "so that transformers does not load it as a Llama; restore that "
                     "model_type, or the folder is not such an export")
    if model_type == DYNAMICS_MODEL_TYPE and not dynamics.enabled:
        raise refuse(f"has model_type {DYNAMICS_MODEL_TYPE} but no kubetrain.dynamics entry "
                     "(betaMax, velocityMax, controllerWidth): the dynamics' bounds are "
                     "unknown; re-export the model with kubetrain")
    # kubetrain's own exports with dynamics and SSMs are Llama-shaped; the rest say their family.
    family = (LLAMA_FAMILY if model_type in (DYNAMICS_MODEL_TYPE, SSM_MODEL_TYPE)
              else family_of(model_type))
    image_text = IMAGE_TEXT.get(model_type) if isinstance(model_type, str) else None
    if image_text is not None:  # its text decoder, described by text_config
        family, text = image_text.family, config.get("text_config")
        if not isinstance(text, dict):
            raise refuse(f"has model_type {model_type!r} but no text_config object: kubetrain "
                         "reads an image-text model's text decoder from it")
        config = {**text, "architectures": [
            HF_FAMILIES[family].architecture if name == image_text.architecture else name
            for name in config.get("architectures") or [image_text.architecture]]}
    if family is None:
        known = ", ".join(hf.model_type for hf in HF_FAMILIES.values())
        raise refuse(f"has model_type {model_type!r}: kubetrain builds the families {known} "
                     f"and its own exports with INL dynamics ({DYNAMICS_MODEL_TYPE}) or "
                     f"state-space models ({SSM_MODEL_TYPE})")
    architecture = (SSM_ARCHITECTURE if ssm else DYNAMICS_ARCHITECTURE if dynamics.enabled
                    else HF_FAMILIES[family].architecture)
    architectures = config.get("architectures") or [architecture]
    if architecture not in architectures:
        raise refuse(f"has architectures {architectures}: kubetrain needs a {architecture} "
                     "(a language-model head); a bare base model has none")
    if config.get("quantization_config"):
        raise refuse("describes a quantised model (quantization_config): kubetrain trains "
                     "from float weights; use the unquantised checkpoint")
    dims = read_dims(config, family, refuse)
    max_positions = config.get("max_position_embeddings")
    return PretrainedConfig(uri, dims, max_positions if isinstance(max_positions, int) else None,
                            dict(markers), dynamics, "ssm" if ssm else "transformer",
                            image_text=image_text is not None)


def ssm_config() -> dict[str, Any]:
    """The config.json entries that mark a state-space model (export.py writes them)."""
    return {"architectures": [SSM_ARCHITECTURE], "model_type": SSM_MODEL_TYPE,
            "kubetrain": {"ssm": dict(SSM_MARKER)}}


def _ssm(marker: object, model_type: object, refuse: Callable[[str], PretrainedError]) -> bool:
    """Whether config.json describes a kubetrain state-space model; refuses a marker and
    model_type that disagree, or mixer constants this version does not build."""
    if marker is None and model_type != SSM_MODEL_TYPE:
        return False
    if marker is None:
        raise refuse(f"has model_type {SSM_MODEL_TYPE} but no kubetrain.ssm entry "
                     f"({', '.join(SSM_MARKER)}): re-export the model with kubetrain")
    if model_type != SSM_MODEL_TYPE:
        raise refuse(f"marks kubetrain.ssm but has model_type {model_type!r}: kubetrain "
                     f"exports a state-space model as model_type {SSM_MODEL_TYPE}, so that "
                     "transformers does not load it as a Llama; restore that model_type, or "
                     "the folder is not such an export")
    if marker != SSM_MARKER:
        raise refuse(f"has kubetrain.ssm {marker!r}, but this kubetrain builds the SSM mixer "
                     f"with {SSM_MARKER}: start the job with the kubetrain version that "
                     "exported the model")
    return True


def dynamics_config(dynamics: DynamicsSpec) -> dict[str, Any]:
    """The config.json entries that mark a model with INL dynamics (export.py writes them)."""
    return {"architectures": [DYNAMICS_ARCHITECTURE], "model_type": DYNAMICS_MODEL_TYPE,
            "kubetrain": {"dynamics": {"betaMax": dynamics.beta_max,
                                       "velocityMax": dynamics.velocity_max,
                                       "controllerWidth": CONTROLLER_WIDTH}}}


def _dynamics(marker: object, refuse: Callable[[str], PretrainedError]) -> DynamicsSpec:
    """The INL dynamics config.json's kubetrain.dynamics marker describes (None: none)."""
    if marker is None:
        return DynamicsSpec()
    if not isinstance(marker, dict):
        raise refuse(f"has a kubetrain.dynamics entry that is not an object: {marker!r}")
    unknown = sorted(set(marker) - set(DYNAMICS_MARKER_KEYS))
    missing = [key for key in DYNAMICS_MARKER_KEYS if key not in marker]
    if unknown or missing:
        raise refuse(f"has a kubetrain.dynamics entry with keys {sorted(marker)}: kubetrain "
                     f"reads exactly {', '.join(DYNAMICS_MARKER_KEYS)}; re-export the model "
                     "with this kubetrain version")
    width = marker["controllerWidth"]
    if isinstance(width, bool) or width != CONTROLLER_WIDTH:
        raise refuse(f"has kubetrain.dynamics.controllerWidth {width!r}, but this kubetrain "
                     f"builds the dynamics controller {CONTROLLER_WIDTH} wide: start the job "
                     "with the kubetrain version that exported the model")
    bounds = {}
    for key in ("betaMax", "velocityMax"):
        value = marker[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise refuse(f"needs kubetrain.dynamics.{key} as a positive number, found "
                         f"{value!r}")
        bounds[key] = float(value)
    return DynamicsSpec(enabled=True, beta_max=bounds["betaMax"],
                        velocity_max=bounds["velocityMax"])


def check_model_spec(model: ModelSpec, config: PretrainedConfig) -> None:
    """Refuse a spec.model dimension or dynamics setting that disagrees with config.json,
    naming both values.

    normEps and each field of model.dynamics are compared only when they are not the
    default (normEps 1e-5; dynamics enabled false, betaMax 2, velocityMax 10): a manifest
    that leaves them out cannot be told from one that writes the default, and the API
    server fills it in. Left at the default, they are the folder's.
    """
    conflicts = _dynamics_conflicts(model.dynamics, config)
    if model.architecture == "ssm" and config.architecture != "ssm":
        conflicts.append(f"spec.model.architecture is ssm but {config.where} describes a "
                         f"transformer ({config.dims.family}): remove model.architecture, or "
                         "distil an SSM from it with model.fromTeacher instead")
    conflicts += _dimension_conflicts(model, config)
    if conflicts:
        raise PretrainedError("; ".join(conflicts) + " (model.init takes the architecture "
                              "from config.json)")


def _dimension_conflicts(model: ModelSpec, config: PretrainedConfig) -> list[str]:
    """The spec.model dimensions, set, that config.json's differ from, naming both."""
    default_eps = ModelSpec.model_fields["norm_eps"].default
    conflicts = []
    for field, key in CONFIG_KEYS.items():
        value = getattr(model, field)
        if value is None or (field == "norm_eps" and value == default_eps):
            continue
        found = getattr(config.dims, _COMPARED_AS.get(field, field))
        if value != found:
            name = f"model.{to_camel(field)}"
            conflicts.append(f"spec.{name} is {_show(value)} but {config.where} says {key} "
                             f"{_show(found)}: remove {name} or set it to {_show(found)}")
    return conflicts


def _dynamics_conflicts(asked: DynamicsSpec, config: PretrainedConfig) -> list[str]:
    """spec.model.dynamics fields, set to other than their defaults, that the folder's differ
    from: whether it has dynamics at all, then (when it has) their bounds."""
    default, found = DynamicsSpec(), config.dynamics
    if asked.enabled and not found.enabled:
        return [f"spec.model.dynamics.enabled is true but {config.where} has no "
                "kubetrain.dynamics (a model without INL dynamics): remove model.dynamics "
                "or set enabled to false"]
    conflicts = []
    for field in ("beta_max", "velocity_max"):
        value = getattr(asked, field)
        if found.enabled and value != getattr(default, field) and value != getattr(found, field):
            name = f"model.dynamics.{to_camel(field)}"
            conflicts.append(f"spec.{name} is {value} but {config.where} says "
                             f"kubetrain.dynamics.{to_camel(field)} {getattr(found, field)}: "
                             f"remove {name} or set it to {getattr(found, field)}")
    return conflicts


def _show(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def trained_model(spec: TrainingJobSpec) -> tuple[TrainingJobSpec, ModelDims]:
    """The job as the trainer builds it: its spec and its model's dimensions.

    Without model.init, the spec as it is and its resolved dimensions. With model.init,
    config.json is read once and checked against the spec (check_model_spec): the
    dimensions are config.json's, and so are `model.dynamics` - whether the model has INL
    dynamics, and their bounds, are part of the folder's architecture like its
    dimensions, so everything that reads spec.model.dynamics (the model, its FLOPs and
    metrics, the spec checkpoints record, which `kubetrain generate` builds from, and
    the export's marker) sees the folder's. Also refuses dimensions set in spec.model
    that disagree and a data.seqLen longer than the model's max_position_embeddings. A
    folder's `model.architecture` (ssm for a kubetrain_ssm export) is taken the same way.
    With model.fromTeacher, the dimensions are the teacher's config.json's (`teacher_dims`).
    A spec without vocabSize takes its vocabulary from the data (the caller's part).
    """
    if spec.model.from_teacher:
        return spec, teacher_dims(spec)
    if spec.model.init is None:
        return spec, spec.model.resolve()
    config = read_config(spec.model.init, spec.storage)
    check_model_spec(spec.model, config)
    return _with_folder_architecture(spec, config), _checked_dims(spec, config)


def teacher_dims(spec: TrainingJobSpec) -> ModelDims:
    """A `model.fromTeacher` student's dimensions: the teacher's (width, depth, heads,
    feed-forward width, vocabulary, norms), refusing any set in spec.model that differ.
    The student keeps its own architecture (spec.model.architecture) and no dynamics. A
    transformer student is of the teacher's family; an SSM has no attention for a family
    to differ in, so it takes the teacher's widths and builds its own (Llama-shaped) block."""
    config = teacher_config(spec)
    conflicts = _dimension_conflicts(spec.model, config)
    if conflicts:
        raise PretrainedError("; ".join(conflicts) + " (model.fromTeacher takes the "
                              "dimensions from the teacher's config.json)")
    if spec.model.architecture == "ssm":
        return ssm_dims(config.dims)
    return config.dims


def ssm_dims(dims: ModelDims) -> ModelDims:
    """The widths of `dims` for a state-space model: its own block, with no attention, so
    none of a family's attention settings (head size, windows, rotary scaling)."""
    return ModelDims(dim=dims.dim, n_layers=dims.n_layers, n_heads=dims.n_heads,
                     n_kv_heads=dims.n_kv_heads, vocab_size=dims.vocab_size,
                     ffn_dim=dims.ffn_dim, tie_embeddings=dims.tie_embeddings,
                     rope_theta=dims.rope_theta, norm_eps=dims.norm_eps)


def _with_folder_architecture(spec: TrainingJobSpec,
                              config: PretrainedConfig) -> TrainingJobSpec:
    if (spec.model.dynamics, spec.model.architecture) == (config.dynamics,
                                                          config.architecture):
        return spec
    return spec.model_copy(update={"model": spec.model.model_copy(
        update={"dynamics": config.dynamics, "architecture": config.architecture})})


def _checked_dims(spec: TrainingJobSpec, config: PretrainedConfig) -> ModelDims:
    if config.max_positions is not None and spec.data.seq_len > config.max_positions:
        raise PretrainedError(
            f"spec.data.seqLen ({spec.data.seq_len}) is longer than max_position_embeddings "
            f"({config.max_positions}) in {config.where}: the model was not trained on "
            "positions that far; lower data.seqLen")
    return config.dims


def teacher_config(spec: TrainingJobSpec) -> PretrainedConfig:
    """The config.json of the job's distillation teacher (spec.distillation.teacher).

    The teacher is built from it as model.init's model is: its dimensions and its INL
    dynamics, so a kubetrain export with dynamics teaches with them. Refuses what
    model.init refuses, and a data.seqLen longer than its max_position_embeddings;
    every message names spec.distillation.teacher.
    """
    assert spec.distillation is not None, "teacher_config needs spec.distillation"
    try:
        config = read_config(spec.distillation.teacher, spec.storage)
    except PretrainedError as error:
        raise teacher_error(error) from None
    if config.max_positions is not None and spec.data.seq_len > config.max_positions:
        raise PretrainedError(
            f"{TEACHER_FIELD}: spec.data.seqLen ({spec.data.seq_len}) is longer than the "
            f"teacher's max_position_embeddings ({config.max_positions}) in {config.where}: "
            "it was not trained on positions that far, so its predictions there teach noise; "
            "lower data.seqLen or use a teacher trained on longer sequences")
    return config


def teacher_error(error: PretrainedError) -> PretrainedError:
    """An error of the model.init reader (this module's or pretrained.py's) about the
    teacher's folder, naming spec.distillation.teacher instead."""
    return type(error)(str(error).replace("model.init:", f"{TEACHER_FIELD}:", 1))


def check_vocabulary(dims: ModelDims, data_vocab_size: int, uri: str,
                     field: str = "model.init") -> None:
    """Refuse training data whose token ids the pretrained model (or, `field`
    distillation.teacher, the teacher a fromTeacher model is sized from) has no embedding
    for."""
    if data_vocab_size > dims.vocab_size:
        raise PretrainedError(
            f"the training data's tokenizer has {data_vocab_size} tokens but the model at "
            f"{field} ({uri}) has vocab_size {dims.vocab_size}: prepare the data with the "
            f"model's own tokenizer (kubetrain prepare --tokenizer <{field}>/tokenizer.json)")
