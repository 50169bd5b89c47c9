"""spec.model: a preset, dimensions that override it, or pretrained weights to start from."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from kubetrain.api.base import URI_MAX_LENGTH, URI_RULES, ApiModel, check_uri, problem
from kubetrain.api.families import FAMILY_NAMES, Family
from kubetrain.api.presets import (
    PRESET_NAMES,
    PRESETS,
    ModelDims,
    Preset,
    PresetName,
    family_problems,
)

# --- model, data, optimisation -----------------------------------------------------


class DynamicsSpec(ApiModel):
    """INL dynamics: a learned second-order controller on each block's hidden state."""

    enabled: bool = Field(
        default=False,
        description="After attention in every block, move the hidden state h towards a learned "
        "per-channel equilibrium mu through a velocity v carried from block to block: "
        "v' = alpha*v - beta*(h - mu), h' = h + g*v', with alpha, beta and g computed from h "
        "by a small learned controller. Off (the default) builds exactly the plain model. "
        "Exports of such a model are marked in config.json and do not load in Hugging Face "
        "transformers; `kubetrain generate` and model.init load them (a model.init job "
        "takes these settings from the folder's config.json).",
    )
    beta_max: float = Field(
        default=2.0, gt=0,
        description="Upper bound of the restoring gain beta (beta = betaMax * sigmoid(...)), "
        "so the controller can never push harder than this.",
    )
    velocity_max: float = Field(
        default=10.0, gt=0,
        description="The velocity is clamped to [-velocityMax, velocityMax] in every block.",
    )


class ModelSpec(ApiModel):
    """The model: a preset, optionally with dimensions overridden, or fully custom dims."""

    init: str | None = Field(
        default=None, max_length=URI_MAX_LENGTH, json_schema_extra=URI_RULES,
        description="Start from pretrained weights: the URI of a Hugging Face model folder "
        "(config.json with model.safetensors, or sharded safetensors with "
        "model.safetensors.index.json) of a Llama, Qwen2/2.5, Qwen3, Mistral or Gemma 3 "
        "causal language model, such as one downloaded from the hub or another job's "
        "export (<checkpoint.uri>/export): s3://bucket/prefix, file:///path or a path, read "
        "with spec.storage. The architecture and family come from its config.json: leave "
        "the dimensions below unset (one set to a different value is refused, naming both); "
        "the preset then only supplies the training defaults. A configuration kubetrain "
        "cannot build exactly (a rope scaling, bias or attention pattern its family's block "
        "does not have) is refused, naming the key; kubetrain's own exports with INL "
        "dynamics load too, and then set model.dynamics. A checkpoint always wins: the "
        "weights are read only when the job starts with no checkpoint of its own and none "
        "in checkpoint.resumeFrom.",
    )
    architecture: Literal["transformer", "ssm"] = Field(
        default="transformer",
        description="transformer: the Llama-style decoder, of model.family. ssm: a "
        "state-space model "
        "(Mamba-2 style gated, selective SSM mixer in place of attention, the same SwiGLU "
        "feed-forward), whose generation costs the same per token at any context length; "
        "usually a distillation student (see fromTeacher). Its exports are marked "
        "model_type kubetrain_ssm, which Hugging Face transformers does not load; "
        "`kubetrain generate` and model.init do.",
    )
    from_teacher: bool = Field(
        default=False,
        description="Size the model from distillation.teacher's config.json: its width, "
        "depth, heads, feed-forward width and vocabulary, and start from the teacher's "
        "token embeddings (and output projection). Needs spec.distillation. Dimensions set "
        "here must agree with the teacher's (one that differs is refused, naming both). A "
        "transformer student is of the teacher's family; an SSM takes only its widths.",
    )
    preset: PresetName | Literal["custom"] = Field(
        default="llama-125m",
        description="Architecture preset: " + ", ".join(PRESET_NAMES) + ". Dimensions set "
        "below override the preset's; `custom` builds the model from the dimensions alone. "
        "The qwen, mistral and gemma presets carry fine-tuning defaults: start them from "
        "the released weights with model.init.",
    )
    family: Family | None = Field(
        default=None,
        description="The block's family (" + ", ".join(FAMILY_NAMES) + "): llama; qwen2 "
        "(Qwen2 and 2.5: biases on q, k and v); qwen3 (an RMSNorm on each query and key "
        "head); mistral; gemma3 (GeGLU, norms before and after attention and the "
        "feed-forward, 1 + w norm scales, embeddings scaled by sqrt(dim), q/k norms). "
        "Default: the preset's (llama for custom). Set it with preset custom; a preset's "
        "family is its own. A model.init job takes it from config.json's model_type.",
    )
    head_dim: int | None = Field(
        default=None, ge=2,
        description="Channels per attention head, where it is not dim / nHeads (Qwen3, "
        "Mistral and Gemma set it); default: the preset's, or dim / nHeads.",
    )
    dim: int | None = Field(default=None, ge=8, description="Hidden size.")
    n_layers: int | None = Field(default=None, ge=1, description="Number of transformer blocks.")
    n_heads: int | None = Field(default=None, ge=1, description="Number of attention heads.")
    n_kv_heads: int | None = Field(
        default=None, ge=1,
        description="Key/value heads for grouped-query attention (divides nHeads).",
    )
    vocab_size: int | None = Field(
        default=None, ge=2,
        description="Vocabulary size; defaults to the tokenizer's when the data names one.",
    )
    ffn_dim: int | None = Field(default=None, ge=1, description="SwiGLU hidden size.")
    tie_embeddings: bool | None = Field(
        default=None, description="Share the input embedding and output projection weights."
    )
    rope_theta: float | None = Field(default=None, gt=0, description="Rotary embedding base.")
    norm_eps: float = Field(default=1e-5, gt=0, description="RMSNorm epsilon.")
    dropout: float = Field(
        default=0.0, ge=0, lt=1,
        description="Dropout probability while training, on the attention weights and on "
        "each block's attention and feed-forward outputs before they join the residual "
        "stream; 0 (the default) turns it off. Masks are drawn from each rank's torch "
        "random generators (seeded from optimization.seed and the rank), which checkpoints "
        "save and resumes restore, so a resumed run draws the masks an uninterrupted run "
        "would. Evaluation and exported models run without it.",
    )
    dynamics: DynamicsSpec = Field(
        default_factory=DynamicsSpec,
        description="INL dynamics, a stability layer after attention in every block (off by "
        "default).",
    )

    @field_validator("init")
    @classmethod
    def _uri_scheme(cls, value: str | None) -> str | None:
        if value is not None:
            check_uri(value)
        return value

    @model_validator(mode="after")
    def _dimensions_resolve(self) -> ModelSpec:
        if self.architecture == "ssm" and self.dynamics.enabled:
            raise problem("dynamics.enabled", "INL dynamics act after attention, and "
                          "architecture ssm has none: set dynamics.enabled false or "
                          "architecture transformer")
        if self.from_teacher and self.init is not None:
            raise problem("fromTeacher", "and model.init both say where the weights start: "
                          "remove one (fromTeacher takes the teacher's embeddings, model.init "
                          "a whole model)")
        if (preset := self.preset_defaults) is not None and self.family not in (
                None, preset.dims.family):
            raise problem("family", f"({self.family}) is not preset {self.preset}'s "
                          f"({preset.dims.family}): a preset's family is its own; set preset "
                          f"custom to build a {self.family} model of your dimensions")
        if self.init is not None or self.from_teacher:
            # The dimensions are a config.json's, read by the trainer; it checks any set here.
            return self
        if self.preset == "custom":
            missing = [n for n in ("dim", "n_layers", "n_heads") if getattr(self, n) is None]
            if missing:
                names = ", ".join(to_camel(n) for n in missing)
                raise problem(to_camel(missing[0]),
                              f"a custom model needs {names}: set them or pick a preset")
        dims = self.resolve()
        if dims.head_dim is None and dims.dim % dims.n_heads:
            raise problem("nHeads", f"({dims.n_heads}) must divide dim ({dims.dim}), or set "
                          "headDim")
        if dims.n_heads % dims.n_kv_heads:
            raise problem("nKvHeads", f"({dims.n_kv_heads}) must divide nHeads ({dims.n_heads})")
        if dims.head_size % 2:
            raise problem("nHeads" if dims.head_dim is None else "headDim",
                          f"head size ({dims.head_size}) must be even for rotary embeddings")
        _check_family(self, dims)
        return self

    def resolve(self) -> ModelDims:
        """The final dimensions: the preset's, overridden by any dimension set here.

        Not for a model with `init`: its dimensions are its config.json's, which only the
        trainer reads (`kubetrain.trainer.pretrained_config.trained_model`).
        """
        overrides = {name: getattr(self, name) for name in ModelDims.model_fields
                     if getattr(self, name, None) is not None}
        if (preset := self.preset_defaults) is not None:
            return ModelDims.model_validate({**preset.dims.model_dump(), **overrides})
        dim, n_heads = overrides["dim"], overrides["n_heads"]
        return ModelDims(**{
            "n_kv_heads": n_heads, "vocab_size": 32_000, "ffn_dim": _swiglu_hidden(dim),
            "tie_embeddings": False, "rope_theta": 10_000.0, **overrides,
        })

    @property
    def preset_defaults(self) -> Preset | None:
        return PRESETS.get(self.preset)


def _check_family(model: ModelSpec, dims: ModelDims) -> None:
    """Refuse what the model's family cannot build or export, and the features that are
    built on the Llama block alone."""
    problems = family_problems(dims)
    if problems:
        field, _, message = problems[0].partition(": ")
        raise problem(field, message)
    if dims.family == "llama":
        return
    if model.architecture == "ssm":
        raise problem("architecture", f"ssm builds its own block, with no attention for the "
                      f"{dims.family} family to differ in: use a llama preset or preset "
                      "custom, or size the SSM from a teacher of any family with fromTeacher")
    if model.dynamics.enabled:
        raise problem("dynamics.enabled", f"INL dynamics are built on the Llama block and "
                      f"exported as a Llama, not on {dims.family}'s: set dynamics.enabled "
                      "false or use a llama model")


def _swiglu_hidden(dim: int, multiple_of: int = 256) -> int:
    """Llama's SwiGLU width: 2/3 of 4*dim, rounded up to a multiple."""
    hidden = int(2 * 4 * dim / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)

