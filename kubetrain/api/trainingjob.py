"""The TrainingJob API (kubetrain.io/v1alpha1) as pydantic models.

The single source of truth for the resource: the operator, the trainer, the local
runner and the CLI all read a job through these models, and the CRD in
crds/trainingjob.yaml is generated from them (kubetrain.api.crd). Field
descriptions become `kubectl explain` text. Torch-free by design.

Cross-field rules live twice on purpose: as pydantic validators here (for
`kubetrain validate`, the trainer and the runner) and as CEL rules on the CRD
(`cel=` in each model's json_schema_extra) so the API server rejects the same
manifests; tests check the two agree.
"""

from __future__ import annotations

import math
import re
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic.json_schema import JsonDict
from pydantic_core import PydanticCustomError

from kubetrain.api.presets import PRESET_NAMES, PRESETS, ModelDims, Preset, PresetName
from kubetrain.protocol import DEFAULT_PERMANENT_EXIT_CODES, FailureClass

GROUP = "kubetrain.io"
VERSION = "v1alpha1"
API_VERSION: Final = "kubetrain.io/v1alpha1"
KIND: Final = "TrainingJob"
PLURAL = "trainingjobs"

# Names of worker pods are `<job>-worker-<index>` and must stay DNS labels (<= 63).
MAX_JOB_NAME_LENGTH = 50
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

# Environment variable names that carry credentials: they must come from a Secret.
CREDENTIAL_ENV_NAMES = frozenset({
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
    "WANDB_API_KEY", "HF_TOKEN",
})

IntOrString = int | str


def problem(field: str, message: str) -> PydanticCustomError:
    """An error about `field` (a camelCase name or dotted sub-path) of the model being validated.

    The problem formatter appends `field` to the model's location, so users read
    `spec.workers.minReplicas (4) is greater than maxReplicas (2)`.
    """
    return PydanticCustomError("field_problem", "{field}: " + message, {"field": field})


def cel(rule: str, message: str, field_path: str | None = None) -> JsonDict:
    """One CEL rule for the CRD's x-kubernetes-validations."""
    entry: JsonDict = {"rule": rule, "message": message}
    if field_path:
        entry["fieldPath"] = field_path
    return entry


# What `_check_uri` refuses, the API server refuses too, so `kubectl apply` fails at once
# instead of the job failing later; the length bound keeps the rule's CEL cost small.
URI_RULES: JsonDict = {"x-kubetrain-cel": [cel(
    "!self.contains('://') || self.startsWith('s3://') || self.startsWith('file://')",
    "unsupported scheme: use s3://bucket/prefix, file:///path or a plain path")]}
URI_MAX_LENGTH = 2048

DEFAULT_MAX_STEPS = 1000


class ApiModel(BaseModel):
    """Base for every API object: camelCase on the wire, unknown fields rejected."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_default=True,
    )

    def wire(self) -> dict[str, Any]:
        """The object as it appears in a manifest: camelCase keys, unset optionals omitted."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


# --- workers -----------------------------------------------------------------------


class ResourceRequirements(ApiModel):
    """Compute resources of each worker pod, as in a Kubernetes container."""

    requests: dict[str, IntOrString] = Field(
        default_factory=dict,
        description="Minimum resources, e.g. {cpu: 8, memory: 64Gi, nvidia.com/gpu: 8}.",
    )
    limits: dict[str, IntOrString] = Field(
        default_factory=dict,
        description="Maximum resources. GPUs (nvidia.com/gpu) must be set here.",
    )


class SecretKeySelector(ApiModel):
    name: str = Field(description="Name of a Secret in the job's namespace.")
    key: str = Field(description="Key within the Secret.")


class EnvVarSource(ApiModel):
    secret_key_ref: SecretKeySelector | None = Field(
        default=None, description="Takes the value from a key of a Secret."
    )
    config_map_key_ref: SecretKeySelector | None = Field(
        default=None, description="Takes the value from a key of a ConfigMap."
    )
    field_ref: dict[str, str] | None = Field(
        default=None, description="Takes the value from a field of the pod (downward API)."
    )


class EnvVar(ApiModel):
    """An environment variable of the trainer container."""

    # The server refuses a literal credential too, so it is never stored in the spec.
    model_config = ConfigDict(json_schema_extra={"x-kubetrain-cel": [cel(
        "!(self.name.upperAscii() in " + str(sorted(CREDENTIAL_ENV_NAMES)).replace("'", '"')
        + ") || !has(self.value)",
        "is a credential and must not be written into the spec: store it in a Secret and "
        "use valueFrom.secretKeyRef (or spec.storage.credentialsSecret for S3 keys)", ".value"),
    ]})

    name: str = Field(min_length=1, max_length=256, description="Variable name.")
    value: str | None = Field(default=None, description="Literal value.")
    value_from: EnvVarSource | None = Field(
        default=None, description="Where the value comes from, instead of a literal value."
    )

    @model_validator(mode="after")
    def _credentials_come_from_secrets(self) -> EnvVar:
        if self.name.upper() in CREDENTIAL_ENV_NAMES and self.value is not None:
            raise problem(
                "value",
                f"{self.name} is a credential and must not be written into the spec: "
                "store it in a Secret and use valueFrom.secretKeyRef "
                "(or spec.storage.credentialsSecret for S3 keys)",
            )
        return self


class PodTemplate(ApiModel):
    """Overrides applied to every worker pod."""

    labels: dict[str, str] = Field(default_factory=dict, description="Extra pod labels.")
    annotations: dict[str, str] = Field(
        default_factory=dict, description="Extra pod annotations."
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels a worker must be scheduled on."
    )
    tolerations: list[dict[str, Any]] = Field(
        default_factory=list, description="Pod tolerations (Kubernetes Toleration objects)."
    )
    affinity: dict[str, Any] | None = Field(
        default=None, description="Pod affinity (a Kubernetes Affinity object)."
    )
    scheduler_name: str | None = Field(
        default=None, description="Scheduler for the pods, e.g. a gang scheduler such as volcano."
    )
    priority_class_name: str | None = Field(default=None, description="Pod priority class.")
    service_account_name: str | None = Field(
        default=None,
        description="Service account of the pods (for IRSA / workload identity to reach S3).",
    )
    env: list[EnvVar] = Field(
        default_factory=list, max_length=256,  # bounds keep the CEL rule's cost in budget
        description="Extra environment variables of the trainer."
    )
    volumes: list[dict[str, Any]] = Field(
        default_factory=list, description="Extra pod volumes (Kubernetes Volume objects)."
    )
    volume_mounts: list[dict[str, Any]] = Field(
        default_factory=list, description="Mounts of those volumes in the trainer container."
    )


class Workers(ApiModel):
    """The group of worker pods; each runs one torchrun agent."""

    model_config = ConfigDict(json_schema_extra={"x-kubetrain-cel": [
        cel("!has(self.minReplicas) || self.minReplicas <= self.replicas",
            "minReplicas must be less than or equal to replicas", ".minReplicas"),
        cel("!has(self.maxReplicas) || self.replicas <= self.maxReplicas",
            "replicas must be less than or equal to maxReplicas", ".replicas"),
        cel("!has(self.minReplicas) || !has(self.maxReplicas) "
            "|| self.minReplicas <= self.maxReplicas",
            "minReplicas must be less than or equal to maxReplicas", ".minReplicas"),
        cel("self.procsPerWorker == oldSelf.procsPerWorker",
            "procsPerWorker cannot change after creation: create a new job that resumes "
            "from this one's checkpoint", ".procsPerWorker"),
    ]})

    replicas: int = Field(
        default=1, ge=1, le=4096,
        description="Number of worker pods now. Change it (or `kubectl scale`) to rescale "
        "within minReplicas..maxReplicas; training resumes from a checkpoint.",
    )
    min_replicas: int | None = Field(
        default=None, ge=1, le=4096,
        description="Fewest workers training may continue with (defaults to replicas).",
    )
    max_replicas: int | None = Field(
        default=None, ge=1, le=4096,
        description="Most workers the job may scale to (defaults to replicas).",
    )
    procs_per_worker: int = Field(
        default=1, ge=1, le=64,
        description="Training processes per worker pod, normally one per GPU.",
    )
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements, description="Resources of each worker pod."
    )
    template: PodTemplate = Field(
        default_factory=PodTemplate,
        description="Pod overrides: nodeSelector, tolerations, affinity, schedulerName, "
        "priorityClassName, serviceAccountName, env, volumes.",
    )

    @model_validator(mode="after")
    def _replica_bounds(self) -> Workers:
        lo, hi = self.min_replicas, self.max_replicas
        if lo is not None and hi is not None and lo > hi:
            raise problem("minReplicas", f"({lo}) is greater than maxReplicas ({hi}): "
                          "lower minReplicas or raise maxReplicas")
        if lo is not None and lo > self.replicas:
            raise problem("minReplicas", f"({lo}) is greater than replicas ({self.replicas}): "
                          "lower minReplicas or raise replicas")
        if hi is not None and self.replicas > hi:
            raise problem("replicas", f"({self.replicas}) is greater than maxReplicas ({hi}): "
                          "lower replicas or raise maxReplicas")
        return self

    @property
    def min_workers(self) -> int:
        return self.min_replicas if self.min_replicas is not None else self.replicas

    @property
    def max_workers(self) -> int:
        return self.max_replicas if self.max_replicas is not None else self.replicas


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
        description="Start from pretrained weights: the URI of a Hugging Face Llama-format "
        "model folder (config.json with model.safetensors, or sharded safetensors with "
        "model.safetensors.index.json), such as another job's export "
        "(<checkpoint.uri>/export): s3://bucket/prefix, file:///path or a path, read with "
        "spec.storage. The architecture comes from its config.json: leave the dimensions "
        "below unset (one set to a different value is refused, naming both); the preset "
        "then only supplies the training defaults (set optimization.learningRate to "
        "fine-tune). Only plain Llama models load: no rope scaling, no attention or MLP "
        "bias, SiLU activation; and kubetrain's own exports with INL dynamics, which then "
        "set model.dynamics. A checkpoint always wins: the weights are read only when "
        "the job starts with no checkpoint of its own and none in checkpoint.resumeFrom.",
    )
    architecture: Literal["transformer", "ssm"] = Field(
        default="transformer",
        description="transformer: the Llama-style decoder. ssm: a state-space model "
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
        "here must agree with the teacher's (one that differs is refused, naming both).",
    )
    preset: PresetName | Literal["custom"] = Field(
        default="llama-125m",
        description="Architecture preset: " + ", ".join(PRESET_NAMES) + ". Dimensions set "
        "below override the preset's; `custom` builds the model from the dimensions alone.",
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
            _check_uri(value)
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
        if dims.dim % dims.n_heads:
            raise problem("nHeads", f"({dims.n_heads}) must divide dim ({dims.dim})")
        if dims.n_heads % dims.n_kv_heads:
            raise problem("nKvHeads", f"({dims.n_kv_heads}) must divide nHeads ({dims.n_heads})")
        if (dims.dim // dims.n_heads) % 2:
            raise problem("nHeads", f"head size dim/nHeads ({dims.dim // dims.n_heads}) must be "
                          "even for rotary embeddings")
        return self

    def resolve(self) -> ModelDims:
        """The final dimensions: the preset's, overridden by any dimension set here.

        Not for a model with `init`: its dimensions are its config.json's, which only the
        trainer reads (`kubetrain.trainer.pretrained_config.trained_model`).
        """
        overrides = {name: getattr(self, name) for name in ModelDims.model_fields
                     if getattr(self, name) is not None}
        if (preset := self.preset_defaults) is not None:
            return preset.dims.model_copy(update=overrides)
        dim, n_heads = overrides["dim"], overrides["n_heads"]
        return ModelDims(**{
            "n_kv_heads": n_heads, "vocab_size": 32_000, "ffn_dim": _swiglu_hidden(dim),
            "tie_embeddings": False, "rope_theta": 10_000.0, **overrides,
        })

    @property
    def preset_defaults(self) -> Preset | None:
        return PRESETS.get(self.preset)


def _swiglu_hidden(dim: int, multiple_of: int = 256) -> int:
    """Llama's SwiGLU width: 2/3 of 4*dim, rounded up to a multiple."""
    hidden = int(2 * 4 * dim / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


class DataSpec(ApiModel):
    """Where the training data comes from: token shards written by `kubetrain prepare`."""

    model_config = ConfigDict(json_schema_extra={"x-kubetrain-cel": [
        cel("self.seqLen == oldSelf.seqLen",
            "seqLen cannot change after creation", ".seqLen"),
    ]})

    train: str = Field(
        min_length=1, max_length=URI_MAX_LENGTH, json_schema_extra=URI_RULES,
        description="URI of the prepared training shards: s3://bucket/prefix, file:///path "
        "or a path.",
    )
    validation: str | None = Field(
        default=None, max_length=URI_MAX_LENGTH, json_schema_extra=URI_RULES,
        description="URI of prepared validation shards; defaults to the split that "
        "`kubetrain prepare` wrote beside the training shards, if any.",
    )
    tokenizer: str | None = Field(
        default=None, max_length=URI_MAX_LENGTH, json_schema_extra=URI_RULES,
        description="URI of a tokenizer.json; defaults to the one recorded with the shards.",
    )
    seq_len: int = Field(
        default=1024, ge=8, le=131_072, description="Tokens per training sequence."
    )
    shuffle: bool = Field(default=True, description="Shuffle shards and samples each epoch.")
    prefetch_shards: int = Field(
        default=2, ge=1, le=64,
        description="Shards downloaded at once, ahead of the one being read (one more is "
        "queued behind them; at most prefetchShards + 2 shards are held in memory).",
    )

    @field_validator("train", "validation", "tokenizer")
    @classmethod
    def _uri_scheme(cls, value: str | None) -> str | None:
        if value is not None:
            _check_uri(value)
        return value


def _check_uri(value: str) -> None:
    if "://" in value and not value.startswith(("s3://", "file://")):
        scheme = value.split("://", 1)[0]
        raise ValueError(f"unsupported scheme {scheme}://: use s3://bucket/prefix, "
                         "file:///path or a plain path")


class OptimizationSpec(ApiModel):
    """Optimizer, learning-rate schedule and batch size."""

    model_config = ConfigDict(json_schema_extra={"x-kubetrain-cel": [
        cel("!has(self.warmupSteps) || !has(self.maxSteps) || self.warmupSteps < self.maxSteps",
            "warmupSteps must be less than maxSteps", ".warmupSteps"),
        cel("!has(self.maxSteps) || !has(self.epochs)",
            "set either maxSteps or epochs, not both", ".epochs"),
        cel("!has(self.globalBatchTokens) || !has(self.gradientAccumulationSteps)",
            "set either globalBatchTokens or gradientAccumulationSteps, not both",
            ".globalBatchTokens"),
        cel("!has(self.minLrRatio) || self.minLrRatio <= 1.0",
            "minLrRatio is a fraction of learningRate between 0 and 1", ".minLrRatio"),
    ]})

    optimizer: Literal["adamw", "adam", "sgd"] = Field(
        default="adamw", description="Optimizer: adamw (fused on CUDA), adam or sgd."
    )
    learning_rate: float | None = Field(
        default=None, gt=0, le=10,
        description="Peak learning rate; defaults to the model preset's.",
    )
    min_lr_ratio: float = Field(
        default=0.1, ge=0, le=1,
        description="Final learning rate as a fraction of the peak.",
    )
    schedule: Literal["cosine", "linear", "constant", "wsd", "cosine-restarts"] = Field(
        default="cosine",
        description="Learning-rate schedule after linear warmup: cosine, linear, constant, "
        "wsd (warmup-stable-decay) or cosine-restarts.",
    )
    decay_fraction: float = Field(
        default=0.2, gt=0, le=1,
        description="wsd only: fraction of training spent in the final decay.",
    )
    restart_cycles: int = Field(
        default=4, ge=1, description="cosine-restarts only: number of cosine cycles."
    )
    warmup_steps: int | None = Field(
        default=None, ge=0, description="Linear warmup steps; defaults to the preset's (capped "
        "at a tenth of maxSteps).",
    )
    max_steps: int | None = Field(
        default=None, ge=1,
        description=f"Optimizer steps to train for ({DEFAULT_MAX_STEPS} when neither maxSteps "
        "nor epochs is set). Alternative to epochs.",
    )
    epochs: float | None = Field(
        default=None, gt=0, le=1_000_000,
        description="Passes over the training data to train for, instead of maxSteps (a "
        "fraction such as 0.5 is allowed). The trainer converts them to optimizer steps once, "
        "from the tokens in the training shards (sequences of seqLen) and the global batch: "
        "steps = ceil(epochs x tokens per epoch / tokens per step), at least 1. With "
        "globalBatchTokens set, tokens per step is that value, so the step count stays the "
        "same across resumes and rescales. Without it the global batch is microBatchSize x "
        "seqLen x gradientAccumulationSteps x the number of training processes, so a rescale "
        "changes the step count (and the schedule) from the restart on: set "
        "globalBatchTokens to rescale an epoch-based job.",
    )
    micro_batch_size: int = Field(
        default=8, ge=1, description="Sequences per process per forward/backward pass."
    )
    gradient_accumulation_steps: int | None = Field(
        default=None, ge=1, description="Micro-batches accumulated per optimizer step (default 1).",
    )
    global_batch_tokens: int | None = Field(
        default=None, ge=1,
        description="Tokens per optimizer step across all processes; sets gradient "
        "accumulation from the world size. Alternative to gradientAccumulationSteps.",
    )
    weight_decay: float = Field(default=0.1, ge=0, description="Decoupled weight decay.")
    betas: tuple[float, float] = Field(
        default=(0.9, 0.95), description="Adam betas [beta1, beta2].",
        json_schema_extra={"x-kubetrain-cel": [cel(
            "self.all(beta, beta >= 0.0 && beta < 1.0)", "each beta must be in [0, 1)")]},
    )
    eps: float = Field(default=1e-8, gt=0, description="Adam epsilon.")
    momentum: float = Field(default=0.9, ge=0, lt=1, description="sgd only: momentum.")
    grad_clip_norm: float | None = Field(
        default=1.0, gt=0, description="Clip the global gradient norm to this; null disables.",
    )
    seed: int = Field(default=0, ge=0, description="Seed for weights, data order and dropout.")

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        for beta in value:
            if not 0 <= beta < 1:
                raise ValueError(f"each beta must be in [0, 1), got {beta}")
        return value

    @model_validator(mode="after")
    def _batch_and_warmup(self) -> OptimizationSpec:
        if self.max_steps is not None and self.epochs is not None:
            raise problem("epochs", f"({self.epochs}) and maxSteps ({self.max_steps}) are both "
                          "set: set either maxSteps or epochs, not both")
        if (self.warmup_steps is not None and self.max_steps is not None
                and self.warmup_steps >= self.max_steps):
            raise problem("warmupSteps", f"({self.warmup_steps}) must be less than maxSteps "
                          f"({self.max_steps})")
        if self.global_batch_tokens is not None and self.gradient_accumulation_steps is not None:
            raise problem("globalBatchTokens", "set either globalBatchTokens or "
                          "gradientAccumulationSteps, not both")
        return self


    def steps_for(self, *, tokens_per_epoch: int, seq_len: int, world_size: int) -> int:
        """The optimizer steps to train for: maxSteps, or epochs converted to steps.

        `tokens_per_epoch` counts the training tokens one pass over the data trains on;
        the global batch is globalBatchTokens when set (independent of `world_size`),
        else micro-batches of every process (see the `epochs` description).
        """
        if self.epochs is None:
            return self.max_steps if self.max_steps is not None else DEFAULT_MAX_STEPS
        tokens_per_step = self.global_batch_tokens or (
            self.micro_batch_size * seq_len * (self.gradient_accumulation_steps or 1)
            * world_size)
        return max(1, math.ceil(self.epochs * tokens_per_epoch / tokens_per_step))


class DistillationSpec(ApiModel):
    """Knowledge distillation: the student learns from a frozen teacher's soft predictions."""

    teacher: str = Field(
        min_length=1, max_length=URI_MAX_LENGTH, json_schema_extra=URI_RULES,
        description="URI of the teacher: a Hugging Face Llama folder (config.json and "
        "safetensors) or another job's export (<checkpoint uri>/export), whose INL dynamics, "
        "if it has them, the teacher is built with: s3://bucket/prefix, file:///path or a "
        "path. Its vocabulary must be the student's, and its tokenizer.json, when the folder "
        "has one, the one the data was prepared with.",
    )
    temperature: float = Field(
        default=2.0, gt=0, le=1000,
        description="Softmax temperature T of both models' logits in the distillation term; "
        "above 1 it softens the teacher's distribution. The term is scaled by T squared so its "
        "gradients keep their size as T changes.",
    )
    alpha: float = Field(
        default=0.5, ge=0, le=1,
        description="Weight of the distillation term: loss = (1 - alpha) x cross-entropy on "
        "the labels + alpha x T^2 x KL(teacher || student); 0 trains on the labels alone.",
    )

    @field_validator("teacher")
    @classmethod
    def _uri_scheme(cls, value: str) -> str:
        _check_uri(value)
        return value


class EarlyStopping(ApiModel):
    patience: int = Field(
        default=0, ge=0,
        description="Stop after this many evaluations without improvement; 0 disables.",
    )
    min_delta: float = Field(
        default=0.0, ge=0, description="Smallest validation-loss decrease that counts."
    )


class EvaluationSpec(ApiModel):
    """Validation during training."""

    every_steps: int = Field(
        default=200, ge=0, description="Evaluate every N optimizer steps; 0 disables."
    )
    batches: int = Field(
        default=20, ge=1, description="Micro-batches per process in one evaluation."
    )
    early_stopping: EarlyStopping = Field(
        default_factory=EarlyStopping, description="Stop when validation loss stops improving."
    )


TP_NEEDS_SHARDING = ("tensorParallel needs strategy fsdp, hsdp or auto: ddp keeps a whole "
                     "copy of the model on every process")
TP_WITHOUT_FP8 = ("tensorParallel with precision fp8 is not supported (float8 tensor-parallel "
                  "plans are not applied): use precision bf16, or tensorParallel 1")


def tensor_parallel_problems(dims: ModelDims, seq_len: int | None, degree: int,
                             vocabulary: bool = True) -> list[str]:
    """Why a model of `dims` cannot be split `degree` ways by tensor parallelism ([] if it
    can): each process holds an equal part of the heads, the feed-forward width, the
    vocabulary (when `vocabulary`: a preset's is replaced by the tokenizer's) and, under
    sequence parallelism, of every sequence."""
    if degree == 1:
        return []
    sizes = [("model.nHeads", dims.n_heads), ("model.nKvHeads", dims.n_kv_heads),
             ("model.ffnDim", dims.ffn_dim)]
    if vocabulary:
        sizes.append(("model.vocabSize", dims.vocab_size))
    if seq_len is not None:
        sizes.append(("data.seqLen", seq_len))
    return [f"parallelism.tensorParallel ({degree}) must divide {name} ({value}): each "
            "process holds an equal part of it; choose a tensorParallel that divides it"
            for name, value in sizes if value % degree]


class ParallelismSpec(ApiModel):
    """How the model is distributed and computed."""

    model_config = ConfigDict(json_schema_extra={"x-kubetrain-cel": [
        cel("self.strategy == oldSelf.strategy",
            "strategy cannot change after creation", ".strategy"),
        cel("!has(self.tensorParallel) || self.tensorParallel == 1 || !has(self.strategy) "
            "|| self.strategy != 'ddp'", TP_NEEDS_SHARDING, ".tensorParallel"),
        cel("!has(self.tensorParallel) || self.tensorParallel == 1 || !has(self.precision) "
            "|| self.precision != 'fp8'", TP_WITHOUT_FP8, ".tensorParallel"),
    ]})

    strategy: Literal["fsdp", "ddp", "hsdp", "auto"] = Field(
        default="fsdp",
        description="fsdp (FSDP2, every parameter sharded over all processes), ddp "
        "(replicated), hsdp (sharded within a pod, replicated across pods: only gradients "
        "cross the network between nodes; replicas scales the replicate dimension) or auto "
        "(hsdp, fsdp or fsdp with tensor parallelism within a pod, the first whose "
        "memory estimate fits the GPU: docs/training.md).",
    )
    tensor_parallel: int = Field(
        default=1, ge=1, le=64,
        description="Split every transformer block over this many processes of one pod "
        "(tensor parallelism, with sequence parallelism on the norms and the loss computed "
        "over the split vocabulary); it must divide workers.procsPerWorker and composes "
        "with fsdp and hsdp as a 2-D or 3-D mesh. The processes of a group read the same "
        "batches. Not with ddp, fp8, the ssm architecture, INL dynamics or distillation.",
    )
    precision: Literal["bf16", "fp16", "fp32", "fp8"] = Field(
        default="bf16",
        description="Compute precision: bf16 (fp32 master weights and reductions), fp16 "
        "(with a gradient scaler), fp32, or fp8: bf16 with the transformer blocks' linear "
        "layers in float8 (torchao; FSDP2 gathers their weights in float8), on GPUs with "
        "float8 support only (compute capability 8.9 or newer: Ada, Hopper, Blackwell).",
    )
    activation_checkpointing: Literal["none", "selective", "full"] = Field(
        default="none",
        description="Recompute activations in backward to save memory: none, selective "
        "(every other block) or full (every block).",
    )
    compile: bool = Field(default=False, description="torch.compile each transformer block.")


class MemoryCheckpointSpec(ApiModel):
    """The in-memory checkpoint tier: recent state in the pods' memory, beside S3."""

    every_steps: int = Field(
        ge=1, description="Snapshot every N optimizer steps into the pod's memory: each "
        "rank's shard of the model and optimizer, the data position and the RNG. A restart "
        "resumes from the newest snapshot every rank has (its own, else a partner's copy) "
        "before reading S3, losing at most N steps. kubetrain's trainer only.")
    replicas: int = Field(
        default=1, ge=0, le=2,
        description="Copies of each rank's snapshot kept by partner ranks, on other nodes "
        "where the job has them: a pod or node lost restores from its partner's copy. 0 "
        "keeps only the rank's own, which survives a trainer restart but not the pod.")
    max_worker_memory: IntOrString | None = Field(
        default=None,
        description="The most memory the tier may add to each worker pod (a quantity, e.g. "
        "64Gi). The operator adds the tier's size (state shard x 2 versions x (1 + "
        "replicas) x procsPerWorker) to each pod's memory request and limit; a tier that "
        "needs more than this is refused with the numbers.")


class CheckpointSpec(ApiModel):
    """Where and how often training state is saved."""

    model_config = ConfigDict(json_schema_extra={"x-kubetrain-cel": [
        cel("self.uri == oldSelf.uri", "uri cannot change after creation", ".uri"),
        cel("!has(self.exportFrom) || self.exportFrom != 'best' "
            "|| (has(self.keepBest) && self.keepBest)",
            "exportFrom: best needs keepBest: true, so the best checkpoint is kept to export",
            ".exportFrom"),
    ]})

    uri: str = Field(
        min_length=1, max_length=URI_MAX_LENGTH, json_schema_extra=URI_RULES,
        description="Where checkpoints go: s3://bucket/prefix, file:///path or a path. The "
        "job resumes from the newest complete checkpoint found here. With spec.trainer, the "
        "folders your code marks complete are uploaded here and the newest is restored "
        "before it starts.",
    )
    every_steps: int = Field(default=500, ge=1, description="Save every N optimizer steps "
                             "(kubetrain's trainer only).")
    keep_last: int = Field(
        default=3, ge=1, description="Committed checkpoints kept; older ones are deleted.",
    )
    keep_best: bool = Field(
        default=False,
        description="Keep the checkpoint with the lowest validation loss out of keepLast "
        "rotation. An evaluation that beats every earlier one (after step 0) saves a "
        "checkpoint at its step; status.bestCheckpoint names it. Needs evaluation "
        "(evaluation.everySteps > 0 and validation data). kubetrain's trainer only.",
    )
    export_from: Literal["best", "last"] = Field(
        default="last",
        description="What the final export holds: last, the weights at the end of training, "
        "or best, the weights of the best checkpoint (needs keepBest; the last weights when "
        "no evaluation after step 0 has produced one). kubetrain's trainer only.",
    )
    async_: bool = Field(
        default=False, alias="async",
        description="Upload in the background while training continues (kubetrain's "
        "trainer only; own code's folders are always uploaded in the background).",
    )
    resume_from: str | None = Field(
        default=None, max_length=URI_MAX_LENGTH, json_schema_extra=URI_RULES,
        description="Checkpoint URI of another job to start from when this job has none yet.",
    )
    export: bool = Field(
        default=True,
        description="At the end, export the model as safetensors with a Hugging Face config "
        "(kubetrain's trainer only).",
    )
    memory: MemoryCheckpointSpec | None = Field(
        default=None,
        description="Also keep recent state in memory every few steps, copied to a partner "
        "on another node; S3 stays the durable tier at everySteps (kubetrain's trainer "
        "only). See docs/memory-checkpoints.md.",
    )

    @field_validator("uri", "resume_from")
    @classmethod
    def _uri_scheme(cls, value: str | None) -> str | None:
        if value is not None:
            _check_uri(value)
        return value

    @model_validator(mode="after")
    def _best_is_kept_to_export(self) -> CheckpointSpec:
        if self.export_from == "best" and not self.keep_best:
            raise problem("exportFrom", "best needs keepBest: true, so the best checkpoint "
                          "is kept to export: set keepBest or exportFrom: last")
        return self


def step_folder(step: int) -> str:
    """The folder, under spec.checkpoint.uri, of the checkpoint of `step`."""
    return f"step-{step:08d}"


class SecretReference(ApiModel):
    """A Secret holding S3 credentials as AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY keys."""

    name: str = Field(min_length=1, description="Secret name in the job's namespace.")


class StorageSpec(ApiModel):
    """Object storage access. Credentials always come from a Secret, never the spec."""

    endpoint: str | None = Field(
        default=None, description="S3 endpoint URL for non-AWS stores (MinIO, Ceph, R2, GCS)."
    )
    region: str | None = Field(default=None, description="S3 region.")
    credentials_secret: SecretReference | None = Field(
        default=None,
        description="Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and optionally "
        "AWS_SESSION_TOKEN). Omit to use the default chain: IRSA / workload identity or the "
        "node's role.",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_inline_credentials(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in data:
                if re.search(r"(access.?key|secret.?key|password|token|credential)s?$",
                             str(key), re.IGNORECASE) and key != "credentialsSecret":
                    raise problem(str(key), "credentials must never be written into a "
                                  "TrainingJob: store them in a Secret and reference it "
                                  "with spec.storage.credentialsSecret.name")
        return data


class TrackingSpec(ApiModel):
    """Optional experiment trackers; used when the package is installed in the image."""

    tensorboard: bool = Field(
        default=False, description="Write TensorBoard event files next to the checkpoints."
    )
    wandb_project: str | None = Field(
        default=None, description="Weights & Biases project (WANDB_API_KEY from a Secret)."
    )


class MetricsSpec(ApiModel):
    """Prometheus metrics and logging of the trainer."""

    port: int = Field(
        default=9400, ge=1024, le=65535, description="Port of rank 0's /metrics endpoint."
    )
    log_every_steps: int = Field(
        default=10, ge=1, description="Log a progress line and a JSON metrics line every N steps."
    )
    tracking: TrackingSpec = Field(
        default_factory=TrackingSpec, description="TensorBoard / Weights & Biases."
    )


class OutOfMemoryPolicy(ApiModel):
    """What follows a worker running out of memory (OOMKilled or a CUDA out-of-memory error)."""

    action: Literal["Halve", "Fail"] = Field(
        default="Halve",
        description="Halve (the default): restart the group from its latest checkpoint with "
        "the micro-batch halved and gradient accumulation doubled, so the global batch, the "
        "data order and the loss curve stay the same; the spec is not changed (the values "
        "used are in status.effective). Such restarts do not count against maxRestarts; "
        "they are limited to log2(optimization.microBatchSize). Fail: the job fails at the "
        "first out-of-memory failure.",
    )
    min_micro_batch: int = Field(
        default=1, ge=1,
        description="Smallest micro-batch Halve may go to: a job that ran out of memory at "
        "it, or would have to go below it, fails with reason OutOfMemory.",
    )


class StragglerPolicy(ApiModel):
    """When a rank counts as a straggler, and what follows (kubetrain.operator.stragglers)."""

    threshold: float = Field(
        default=1.3, gt=1,
        description="A rank whose compute time per step is more than this many times the "
        "median rank's is slow (a rank's slowness is its compute time over the median; "
        "under tensorParallel, its tensor-parallel group's: the group's smallest rank's "
        "compute over the median group's).",
    )
    window: int = Field(
        default=3, ge=1,
        description="Consecutive judged intervals a rank must be slow in before it is "
        "reported as a straggler. An interval is metrics.logEverySteps steps; the operator "
        "judges the latest one at each scrape, so intervals shorter than its resync are "
        "sampled, not all seen.",
    )
    action: Literal["Report", "Replace"] = Field(
        default="Report",
        description="Report: set the job's Straggler condition and post an event naming the "
        "pod, node and slowness. Replace: that too, then avoid the straggler's node "
        "(status.avoidedNodes, runPolicy.avoidNodesFor) and recreate its pod off it; the "
        "group checkpoints on the pod's SIGTERM and resumes from that checkpoint.",
    )


class PreflightPolicy(ApiModel):
    """The health check every rank runs before the first step of each attempt."""

    enabled: bool = Field(
        default=True,
        description="Before the first step, every rank multiplies matrices on its device "
        "(checked against a reference) and all-reduces over the group (bandwidth measured): "
        "a rank that fails or is too slow gets its node avoided and the group restarts "
        "without it.",
    )
    timeout_seconds: int = Field(
        default=60, ge=1, le=3600,
        description="Deadline of the whole check: a rank that has not reported by then "
        "failed it.",
    )
    min_bandwidth_fraction: float = Field(
        default=0.5, gt=0, le=1,
        description="A rank whose all-reduce bandwidth is under this fraction of the median "
        "rank's fails the check.",
    )


class RunPolicy(ApiModel):
    """How the job is restarted, bounded and cleaned up."""

    max_restarts: int = Field(
        default=5, ge=0, description="Group restarts allowed before the job fails."
    )
    backoff_seconds: int = Field(
        default=10, ge=0, description="First delay before a restart; doubles on each one.",
    )
    max_backoff_seconds: int = Field(
        default=600, ge=0, description="Upper bound of the restart delay."
    )
    permanent_exit_codes: list[int] = Field(
        default_factory=lambda: list(DEFAULT_PERMANENT_EXIT_CODES),
        description="Exit codes that mean a configuration or code error: the job fails "
        "without retrying. Signals, OOM kills, evictions and node loss are always retried.",
    )
    repeated_failure_limit: int = Field(
        default=3, ge=1,
        description="The job fails when the same non-signal exit code (e.g. 1, a Python "
        "exception) ends this many attempts in a row with no training progress in between.",
    )
    pending_deadline_seconds: int | None = Field(
        default=900, ge=1,
        description="A worker still Pending after this long is recreated (and counts as a "
        "restart).",
    )
    progress_deadline_seconds: int | None = Field(
        default=1800, ge=1,
        description="Restart the group when the training step has not advanced for this long "
        "(hang detection); null disables.",
    )
    active_deadline_seconds: int | None = Field(
        default=None, ge=1, description="Fail the job after running this long."
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None, ge=0, description="Delete the finished job (and its pods) after this long."
    )
    suspend: bool = Field(
        default=False,
        description="true: checkpoint, delete the pods and keep the job; false: resume.",
    )
    clean_pod_policy: Literal["None", "Running", "All"] = Field(
        default="Running",
        description="Pods deleted when the job finishes: None, Running (keep failed pods "
        "for their logs) or All.",
    )
    out_of_memory: OutOfMemoryPolicy = Field(
        default_factory=OutOfMemoryPolicy,
        description="After a worker runs out of memory: Halve the micro-batch (default) or "
        "Fail.",
    )
    stragglers: StragglerPolicy = Field(
        default_factory=StragglerPolicy,
        description="Slow-rank detection from each rank's compute time: threshold, window and "
        "action.",
    )
    preflight: PreflightPolicy = Field(
        default_factory=PreflightPolicy,
        description="The health check before each attempt's first step: enabled, "
        "timeoutSeconds, minBandwidthFraction.",
    )
    node_loss_toleration_seconds: int | None = Field(
        default=10, ge=0,
        description="Worker pods tolerate the node.kubernetes.io/unreachable and not-ready "
        "NoExecute taints this long (Kubernetes' default is 300 s), so that the taint "
        "manager evicts them from a lost node about when the operator replaces them (it "
        "does at once when a trainer's lifeline goes silent). A toleration for these keys "
        "in workers.template wins; null adds none.",
    )
    avoid_nodes_for: str = Field(
        default="1h", pattern=r"^([0-9]+h)?([0-9]+m)?([0-9]+s)?$", min_length=2,
        description="How long a node stays avoided by this job's pods after a straggler, a "
        "failed preflight or repeated failures on it (status.avoidedNodes), as 1h, 30m, "
        "90s or 1h30m; 0s avoids no node. The operator never cordons or taints nodes.",
    )

    @property
    def avoid_nodes_seconds(self) -> int:
        """avoidNodesFor in seconds."""
        units = {"h": 3600, "m": 60, "s": 1}
        return sum(int(number) * units[unit]
                   for number, unit in re.findall(r"([0-9]+)([hms])", self.avoid_nodes_for))


# --- own code ----------------------------------------------------------------------

# torchrun's options that kubetrain sets from spec.workers and spec.runPolicy: a command
# that runs torchrun itself must leave them out, or its group would not be the job's.
KUBETRAIN_TORCHRUN_OPTIONS = (
    "--nnodes", "--nproc-per-node", "--nproc_per_node", "--rdzv-backend", "--rdzv_backend",
    "--rdzv-endpoint", "--rdzv_endpoint", "--rdzv-id", "--rdzv_id", "--max-restarts",
    "--max_restarts", "--node-rank", "--node_rank", "--master-addr", "--master_addr",
    "--master-port", "--master_port", "--standalone",
)
# Interpreter switches that change nothing torchrun's workers need; any other is refused.
_PYTHON_SWITCHES = frozenset({"-u", "-B", "-O", "-OO", "-s", "-E", "-I", "-q"})


class TrainerSpec(ApiModel):
    """Your own training code (Kubeflow TrainJob's spec.trainer): each worker pod runs it
    under kubetrain's elastic torchrun launch, with checkpoints synced to
    spec.checkpoint.uri (docs/own-code.md)."""

    image: str = Field(
        min_length=1,
        description="Container image of your code. It needs torch (torchrun) and kubetrain "
        "(`pip install 'kubetrain[own-code]'`), which restores and uploads checkpoints.",
    )
    command: list[str] = Field(
        min_length=1, max_length=256,
        description="What each training process runs, with args appended: a Python script "
        "or module (`python train.py`, `python -m pkg.train`, or `torchrun train.py` "
        "without the options kubetrain sets), or any other program (run with torchrun's "
        "--no-python). torchrun starts procsPerWorker of them per pod, with RANK, "
        "LOCAL_RANK and WORLD_SIZE set.",
    )
    args: list[str] = Field(
        default_factory=list, max_length=1024,
        description="Arguments appended to command.",
    )
    env: list[EnvVar] = Field(
        default_factory=list, max_length=256,  # bounds keep the CEL rule's cost in budget
        description="Environment variables of your code (besides workers.template.env).",
    )

    @model_validator(mode="after")
    def _launchable(self) -> TrainerSpec:
        self.torchrun_arguments()
        return self

    def torchrun_arguments(self) -> list[str]:
        """What follows kubetrain's own options on the torchrun command line.

        `python [switches] train.py ...` and `python -m pkg ...` become torchrun's script
        or module; `torchrun ...` (or `python -m torch.distributed.run ...`) keeps its
        own options, none of those kubetrain sets; any other program runs with
        --no-python. Raises a `problem` naming the command when none of these fits.
        """
        argv = [*self.command, *self.args]
        program = argv[0].rsplit("/", 1)[-1]
        if program == "torchrun":
            return self._without_kubetrain_options(argv[1:])
        if not re.fullmatch(r"python[0-9.]*", program):
            return ["--no-python", *argv]
        rest = argv[1:]
        while rest and rest[0] in _PYTHON_SWITCHES:
            rest = rest[1:]
        if rest[:2] == ["-m", "torch.distributed.run"]:
            return self._without_kubetrain_options(rest[2:])
        if rest[:1] == ["-m"] and len(rest) > 1:
            return rest
        if rest and not rest[0].startswith("-"):
            return rest
        raise problem("command", f"{' '.join(argv[:3])!r} runs Python without a script or "
                      "a module (`-m`) that torchrun can start in each process: give "
                      "`python train.py` or `python -m package.module`")

    @staticmethod
    def _without_kubetrain_options(arguments: list[str]) -> list[str]:
        for argument in arguments:
            name = argument.split("=", 1)[0]
            if name in KUBETRAIN_TORCHRUN_OPTIONS:
                raise problem("command", f"sets torchrun's {name}, which kubetrain sets from "
                              "spec.workers (and runPolicy.maxRestarts) so that every pod "
                              "joins one elastic group: remove it")
        return arguments


# The typed training fields: what kubetrain's trainer reads and own code (spec.trainer)
# has no use for, with what the user's code does instead. Each one is refused with
# spec.trainer unless it is left at its default (the API server fills in a section's
# defaults, so "left out" and "at its default" are the same to it).
TYPED_ONLY: Final[dict[str, str]] = {
    "model": "your code builds its own model",
    "data": "your code reads its own data",
    "optimization": "your code sets its own optimizer, schedule and batch size (read "
    "kubetrain.sdk's micro_batch_size to let out-of-memory restarts halve it)",
    "evaluation": "your code runs its own evaluation",
    "parallelism": "your code applies its own parallelism and precision",
    "distillation": "your code computes its own loss",
}
# Of spec.checkpoint, own code uses uri, keepLast and resumeFrom.
CHECKPOINT_TYPED_ONLY: Final = ("every_steps", "keep_best", "export_from", "async_", "export",
                                "memory")
CHECKPOINT_WHY: Final = ("your code decides when to save (kubetrain uploads each folder it "
                         "marks complete) and exports its own model; of spec.checkpoint only "
                         "uri, keepLast and resumeFrom apply")


def _cel_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_cel_literal(item) for item in value) + "]"
    return repr(value)


def at_default_cel(model: type[BaseModel], path: str,
                   fields: tuple[str, ...] | None = None) -> str:
    """A CEL expression true when every field of `model` at `path` is absent or at its
    default: how the API server tells a section the user left alone from one they set."""
    terms = []
    for name, info in model.model_fields.items():
        if fields is not None and name not in fields:
            continue
        at = f"{path}.{info.alias or name}"
        factory = info.default_factory
        if isinstance(factory, type) and issubclass(factory, BaseModel):
            terms.append(f"(!has({at}) || ({at_default_cel(factory, at)}))")
            continue
        default = info.get_default(call_default_factory=True)
        if default is None:
            terms.append(f"!has({at})")
        elif isinstance(default, float):
            # double(): the server's value is a double already; a test's may be an int.
            terms.append(f"(!has({at}) || double({at}) == {default!r})")
        else:
            terms.append(f"(!has({at}) || {at} == {_cel_literal(default)})")
    return " && ".join(terms)


def changed_fields(value: BaseModel, default: BaseModel,
                   fields: tuple[str, ...] | None = None) -> list[str]:
    """The camelCase paths of `value`'s fields that differ from `default`'s."""
    changed = []
    for name, info in type(value).model_fields.items():
        if fields is not None and name not in fields:
            continue
        mine, theirs = getattr(value, name), getattr(default, name)
        if isinstance(mine, BaseModel) and isinstance(theirs, BaseModel):
            changed += [f"{info.alias or name}.{sub}" for sub in changed_fields(mine, theirs)]
        elif mine != theirs:
            changed.append(info.alias or name)
    return changed


def _own_code_rules() -> list[JsonDict]:
    rules = [
        cel("has(self.trainer) || has(self.data)",
            "set spec.data to train with kubetrain's trainer, or spec.trainer (image, "
            "command) to run your own training code"),
        cel("!has(self.trainer) || !has(self.data)",
            "spec.trainer and spec.data are both set: a job runs either its own code "
            "(spec.trainer) or kubetrain's trainer (spec.data and the typed training "
            "fields): remove one", ".trainer"),
        cel("has(self.trainer) || has(self.image)",
            "spec.image, kubetrain's trainer image, is required (or set spec.trainer to run "
            "your own code in its own image)"),
        cel("!has(self.trainer) || !has(self.image)",
            "spec.image is kubetrain's trainer image; your own code names its image in "
            "spec.trainer.image: remove spec.image", ".image"),
    ]
    sections: dict[str, type[BaseModel]] = {
        "model": ModelSpec, "optimization": OptimizationSpec, "evaluation": EvaluationSpec,
        "parallelism": ParallelismSpec}
    for section, why in TYPED_ONLY.items():
        if section == "data":
            continue  # the rule above
        model = sections.get(section)
        unset = (f"!has(self.{section})" if model is None
                 else f"!has(self.{section}) || ({at_default_cel(model, f'self.{section}')})")
        rules.append(cel(f"!has(self.trainer) || {unset}",
                         f"spec.{section} is read only by kubetrain's trainer; with "
                         f"spec.trainer {why}: remove spec.{section}", f".{section}"))
    rules.append(cel(
        "!has(self.trainer) || "
        + at_default_cel(CheckpointSpec, "self.checkpoint", CHECKPOINT_TYPED_ONLY),
        "spec.checkpoint.everySteps, keepBest, exportFrom, async, export and memory are read "
        f"only by kubetrain's trainer; with spec.trainer {CHECKPOINT_WHY}", ".checkpoint"))
    return rules


# What tensor parallelism does not compose with, beside the parallelism section's own rules:
# (CEL condition that refuses, the field, the message). The models say the same.
_TP = "has(self.parallelism) && has(self.parallelism.tensorParallel) " \
      "&& self.parallelism.tensorParallel > 1"
TENSOR_PARALLEL_REFUSALS: tuple[tuple[str, str, str], ...] = (
    ("(has(self.workers) && has(self.workers.procsPerWorker) ? self.workers.procsPerWorker "
     ": 1) % self.parallelism.tensorParallel != 0", "parallelism.tensorParallel",
     "must divide workers.procsPerWorker: tensor parallelism stays within a pod; set "
     "tensorParallel to a divisor of procsPerWorker"),
    ("has(self.model) && has(self.model.architecture) && self.model.architecture == 'ssm'",
     "parallelism.tensorParallel", "is not supported with the state-space model "
     "(model.architecture: ssm), which has no tensor-parallel plan: use tensorParallel 1 "
     "(fsdp or hsdp shard it)"),
    ("has(self.model) && has(self.model.dynamics) && has(self.model.dynamics.enabled) "
     "&& self.model.dynamics.enabled", "parallelism.tensorParallel",
     "is not supported with INL dynamics (model.dynamics), which have no tensor-parallel "
     "plan: use tensorParallel 1"),
    ("has(self.distillation)", "parallelism.tensorParallel",
     "is not supported with distillation, whose teacher has no tensor-parallel placement: "
     "use tensorParallel 1 (fsdp or hsdp shard the teacher too)"),
)


def _tensor_parallel_rules() -> list[JsonDict]:
    return [cel(f"!({_TP}) || !({refused})", f"tensorParallel {message}", "." + field)
            for refused, field, message in TENSOR_PARALLEL_REFUSALS]


class TrainingJobSpec(ApiModel):
    """What to train, on what, and how."""

    model_config = ConfigDict(json_schema_extra={"x-kubetrain-cel": [
        cel("self.model == oldSelf.model",
            "model cannot change after creation: create a new job with "
            "checkpoint.resumeFrom pointing at this one's checkpoints", ".model"),
        cel("!has(self.checkpoint.keepBest) || !self.checkpoint.keepBest "
            "|| !has(self.evaluation) || !has(self.evaluation.everySteps) "
            "|| self.evaluation.everySteps > 0",
            "keepBest needs evaluation: set evaluation.everySteps above 0",
            ".checkpoint.keepBest"),
        *_own_code_rules(),
        *_tensor_parallel_rules(),
    ]})

    # kubetrain's trainer's image; None only with spec.trainer (see _one_kind).
    image: str | None = Field(
        default=None, min_length=1,
        description="kubetrain's trainer container image (required without spec.trainer; "
        "own code names its image in spec.trainer.image).")
    trainer: TrainerSpec | None = Field(
        default=None,
        description="Run your own training code instead of kubetrain's trainer: image, "
        "command, args, env (as in a Kubeflow TrainJob). The alternative to data and the "
        "other typed training fields (model, optimization, evaluation, parallelism, "
        "distillation, and checkpoint's everySteps, keepBest, exportFrom, async, export), "
        "which are then refused; workers, runPolicy, checkpoint.uri/keepLast/resumeFrom, "
        "storage and metrics apply to both kinds.",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        default=None, description="Pull policy of the trainer image."
    )
    workers: Workers = Field(default_factory=Workers, description="The worker pods.")
    model: ModelSpec = Field(default_factory=ModelSpec, description="The model to train "
                            "(kubetrain's trainer only).")
    if TYPE_CHECKING:
        # Own code (spec.trainer) has no data: None at run time. Every reader of spec.data
        # is on kubetrain's trainer path, which runs only jobs that have it (_one_kind), so
        # the type is what those readers see.
        data: DataSpec
    else:
        data: DataSpec | None = Field(
            default=None, description="Training and validation data (kubetrain's trainer; "
            "required without spec.trainer).")
    optimization: OptimizationSpec = Field(
        default_factory=OptimizationSpec, description="Optimizer, schedule and batch size "
        "(kubetrain's trainer only)."
    )
    evaluation: EvaluationSpec = Field(
        default_factory=EvaluationSpec, description="Validation and early stopping "
        "(kubetrain's trainer only)."
    )
    parallelism: ParallelismSpec = Field(
        default_factory=ParallelismSpec, description="Sharding, precision, checkpointing "
        "(kubetrain's trainer only)."
    )
    checkpoint: CheckpointSpec = Field(description="Checkpoint location and cadence.")
    storage: StorageSpec = Field(
        default_factory=StorageSpec, description="Object storage endpoint and credentials."
    )
    metrics: MetricsSpec = Field(default_factory=MetricsSpec, description="Metrics and logs.")
    distillation: DistillationSpec | None = Field(
        default=None, description="Train from a frozen teacher's predictions as well as the "
        "labels (knowledge distillation); omit to train on the labels alone (kubetrain's "
        "trainer only).",
    )
    run_policy: RunPolicy = Field(
        default_factory=RunPolicy, description="Restarts, deadlines, suspend and cleanup."
    )

    @model_validator(mode="after")
    def _one_kind(self) -> TrainingJobSpec:
        if self.trainer is None:
            if self.data is None:
                raise problem("data", "is required: set spec.data to train with kubetrain's "
                              "trainer, or spec.trainer (image, command) to run your own "
                              "training code")
            if self.image is None:
                raise problem("image", "is required: kubetrain's trainer image (or set "
                              "spec.trainer to run your own code in its own image)")
            return self
        if self.data is not None:
            raise problem("trainer", "and spec.data are both set: a job runs either its own "
                          "code (spec.trainer) or kubetrain's trainer (spec.data and the "
                          "typed training fields): remove one")
        if self.image is not None:
            raise problem("image", "is kubetrain's trainer image; your own code names its "
                          "image in spec.trainer.image: remove spec.image")
        for section, why in TYPED_ONLY.items():
            value = getattr(self, section)
            if value is None:
                continue
            changed = changed_fields(value, type(value)()) if section != "distillation" else []
            if section == "distillation" or changed:
                where = f"{section}.{changed[0]}" if changed else section
                raise problem(where, f"is read only by kubetrain's trainer; with spec.trainer "
                              f"{why}: remove spec.{section}")
        changed = changed_fields(self.checkpoint, CheckpointSpec(uri=self.checkpoint.uri),
                                 CHECKPOINT_TYPED_ONLY)
        if changed:
            raise problem(f"checkpoint.{changed[0]}", f"is read only by kubetrain's trainer; "
                          f"with spec.trainer {CHECKPOINT_WHY}")
        return self

    @property
    def own_code(self) -> bool:
        """Whether the job runs its own code (spec.trainer) rather than kubetrain's trainer."""
        return self.trainer is not None

    @model_validator(mode="after")
    def _tensor_parallel_fits(self) -> TrainingJobSpec:
        degree = self.parallelism.tensor_parallel
        if degree == 1:
            return self
        refused = [
            self.workers.procs_per_worker % degree != 0,
            self.model.architecture == "ssm",
            self.model.dynamics.enabled,
            self.distillation is not None,
        ]
        for refuses, (_, field, message) in zip(refused, TENSOR_PARALLEL_REFUSALS, strict=True):
            if refuses:
                raise problem(field, f"({degree}) {message}")
        for refuses, message in ((self.parallelism.strategy == "ddp", TP_NEEDS_SHARDING),
                                 (self.parallelism.precision == "fp8", TP_WITHOUT_FP8)):
            if refuses:
                raise problem("parallelism.tensorParallel",
                              f"({degree}) {message.removeprefix('tensorParallel ')}")
        if self.model.init is None and not self.model.from_teacher and self.data is not None:
            # A model.init or fromTeacher job's dimensions are its config.json's: the
            # trainer checks those (tensor_parallel.py).
            problems = tensor_parallel_problems(self.model.resolve(), self.data.seq_len,
                                                degree, self.model.vocab_size is not None)
            if problems:
                raise problem("parallelism.tensorParallel",
                              problems[0].removeprefix("parallelism.tensorParallel "))
        return self

    @model_validator(mode="after")
    def _from_teacher_needs_a_teacher(self) -> TrainingJobSpec:
        if self.model.from_teacher and self.distillation is None:
            raise problem("model.fromTeacher", "needs a teacher to size the model from: set "
                          "distillation.teacher, or remove fromTeacher and give the "
                          "dimensions")
        return self

    @model_validator(mode="after")
    def _memory_tier_fits(self) -> TrainingJobSpec:
        memory = self.checkpoint.memory
        if memory is None or memory.max_worker_memory is None or self.trainer is not None:
            return self
        # Torch-free; imported here because it sizes the model from this module's types.
        from kubetrain.trainer.memory_budget import parse_quantity, tier_budget

        try:
            allowed = parse_quantity(memory.max_worker_memory)
        except ValueError as error:
            raise problem("checkpoint.memory.maxWorkerMemory", str(error)) from None
        budget = tier_budget(self)
        if budget is not None and budget.per_worker > allowed:
            raise problem("checkpoint.memory.maxWorkerMemory",
                          f"({memory.max_worker_memory}) is less than the tier needs: "
                          f"{budget.describe()}: lower checkpoint.memory.replicas, run more "
                          "workers (minReplicas) to shard the state further, or raise "
                          "maxWorkerMemory")
        return self

    @model_validator(mode="after")
    def _best_needs_evaluation(self) -> TrainingJobSpec:
        if self.checkpoint.keep_best and not self.evaluation.every_steps:
            raise problem("checkpoint.keepBest", "needs evaluation: set "
                          "evaluation.everySteps above 0")
        return self

    @model_validator(mode="after")
    def _warmup_fits(self) -> TrainingJobSpec:
        if self.optimization.epochs is not None:
            return self  # the steps are known once the trainer has read the data
        max_steps = self.optimization.steps_for(tokens_per_epoch=0, seq_len=1, world_size=1)
        self.check_warmup(max_steps)
        return self

    def check_warmup(self, max_steps: int) -> None:
        """Refuse a warmup as long as training (`max_steps`, resolved from maxSteps or epochs)."""
        warmup = self.warmup_steps(max_steps)
        if warmup < max_steps:
            return
        source = ("from the preset" if self.optimization.warmup_steps is None
                  else "warmupSteps")
        if self.optimization.epochs is None:
            raise problem("optimization.warmupSteps", f"({warmup}, {source}) must be less "
                          f"than maxSteps ({max_steps}): set warmupSteps")
        raise problem("optimization.warmupSteps",
                      f"({warmup}, {source}) must be less than the {max_steps} steps that "
                      f"epochs ({self.optimization.epochs}) make on this data: lower "
                      "warmupSteps or raise epochs")

    # Values with preset-dependent defaults, resolved in one place.
    @property
    def learning_rate(self) -> float:
        if self.optimization.learning_rate is not None:
            return self.optimization.learning_rate
        preset = self.model.preset_defaults
        return preset.learning_rate if preset else 3e-4

    def warmup_steps(self, max_steps: int) -> int:
        """Warmup steps of a run of `max_steps`: the spec's, else the preset's capped at a tenth."""
        if self.optimization.warmup_steps is not None:
            return self.optimization.warmup_steps
        preset = self.model.preset_defaults
        default = preset.warmup_steps if preset else 100
        return min(default, max_steps // 10)

    def gradient_accumulation(self, world_size: int, micro_batch_size: int | None = None) -> int:
        """Micro-batches per optimizer step for `world_size` training processes.

        With `micro_batch_size` (an out-of-memory restart's, a divisor of the spec's, see
        `halved_micro_batch`) the accumulation grows by exactly the factor the micro-batch
        shrank: the global batch is the spec's to the sequence, not re-rounded from
        globalBatchTokens.
        """
        opt = self.optimization
        if opt.global_batch_tokens is None:
            steps = opt.gradient_accumulation_steps or 1
        else:
            per_micro_step = opt.micro_batch_size * self.data.seq_len * world_size
            steps = max(1, round(opt.global_batch_tokens / per_micro_step))
        if micro_batch_size is None:
            return steps
        return steps * (opt.micro_batch_size // micro_batch_size)

    def halved_micro_batch(self, current: int) -> int | None:
        """The micro-batch an out-of-memory restart moves to from `current`; None: none left.

        The largest divisor of the spec's microBatchSize that is at most half of `current`
        and at least runPolicy.outOfMemory.minMicroBatch: a divisor, so that the global
        batch splits into whole micro-batches (8 -> 4 -> 2 -> 1; 6 -> 3 -> 1).
        """
        floor = self.run_policy.out_of_memory.min_micro_batch
        spec = self.optimization.micro_batch_size
        for size in range(current // 2, floor - 1, -1):
            if size >= 1 and spec % size == 0:
                return size
        return None

    def out_of_memory_restart_limit(self) -> int:
        """Out-of-memory restarts allowed: log2 of the spec's micro-batch, rounded down."""
        return self.optimization.micro_batch_size.bit_length() - 1

    def after_out_of_memory(self, current: int, restarts: int) -> tuple[int | None, str]:
        """The micro-batch to restart with after running out of memory at `current`, with
        `restarts` such restarts behind; or None and why not, naming the field. The one
        rule of the operator and of `kubetrain run`."""
        policy = self.run_policy.out_of_memory
        smaller = self.halved_micro_batch(current)
        if policy.action == "Fail":
            return None, "runPolicy.outOfMemory.action is Fail"
        if smaller is None:
            return None, (f"no smaller micro-batch is left (runPolicy.outOfMemory.minMicroBatch:"
                          f" {policy.min_micro_batch}; a smaller one must divide "
                          f"optimization.microBatchSize, {self.optimization.micro_batch_size})")
        if restarts >= self.out_of_memory_restart_limit():
            return None, (f"{restarts} out-of-memory restarts already, the most "
                          "log2(optimization.microBatchSize) allows")
        return smaller, ""


# --- status --------------------------------------------------------------------------

Phase = Literal["Pending", "Running", "Restarting", "Suspended", "Succeeded", "Failed"]


class Condition(ApiModel):
    model_config = ConfigDict(extra="ignore")

    type: str = Field(description="Created, Running, Restarting, Suspended, Succeeded, Failed, "
                      "Straggler, NodesAvoided, MemoryCopiesShareNode, and kstatus's Ready, "
                      "Reconciling and Stalled.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str | None = Field(default=None, description="One-word CamelCase reason.")
    message: str | None = Field(default=None, description="Human-readable detail.")
    last_transition_time: datetime | None = Field(
        default=None, description="When the status last changed."
    )


class WorkersStatus(ApiModel):
    model_config = ConfigDict(extra="ignore")

    desired: int = Field(default=0, description="Workers the job wants now.")
    ready: int = Field(default=0, description="Workers running and ready.")
    selector: str | None = Field(
        default=None, description="Label selector of the worker pods (for the scale subresource)."
    )


class Progress(ApiModel):
    model_config = ConfigDict(extra="ignore")

    step: int = Field(default=0, description="Last completed optimizer step.")
    max_steps: int | None = Field(default=None, description="Steps to train for.")
    epoch: float | None = Field(
        default=None, description="Passes over the training data so far, with the fraction "
        "of the current one (1.5: halfway through the second epoch).")
    loss: float | None = Field(default=None, description="Training loss at that step.")
    ce_loss: float | None = Field(
        default=None, description="Knowledge distillation (spec.distillation): the "
        "cross-entropy on the labels at that step; loss is (1 - alpha) x ceLoss + alpha x "
        "kdLoss.")
    kd_loss: float | None = Field(
        default=None, description="Knowledge distillation: T^2 x KL(teacher || student) at "
        "that step.")
    tokens_per_second: float | None = Field(default=None, description="Throughput of the group.")
    updated_at: datetime | None = Field(default=None, description="When the step last advanced.")
    eta_seconds: int | None = Field(
        default=None, description="Seconds until maxSteps at the recent step time "
        "(restarts and other badput not included).")


class CheckpointLoadSeconds(ApiModel):
    """checkpointLoad split by the tier the resumed checkpoint came from."""

    model_config = ConfigDict(extra="ignore")

    memory: float = Field(default=0.0, description="Restored from the ranks' own in-memory "
                          "snapshots (spec.checkpoint.memory), after an in-place or container "
                          "restart.")
    partner: float = Field(default=0.0, description="Restored from memory with some ranks' "
                           "parts from a partner's copy on another node (a lost pod or node).")
    s3: float = Field(default=0.0, description="Loaded from the durable checkpoints "
                      "(spec.checkpoint.uri).")


class BadputSeconds(ApiModel):
    model_config = ConfigDict(extra="ignore")

    data_wait: float = Field(default=0.0, description="Waiting for training batches.")
    checkpoint_save: float = Field(default=0.0, description="Blocking part of checkpoint saves "
                                   "and the final export.")
    checkpoint_load: float = Field(default=0.0, description="Loading checkpoints on resume.")
    checkpoint_load_by_tier: CheckpointLoadSeconds | None = Field(
        default=None, description="checkpointLoad by the tier each resume loaded from; a "
        "load that found nothing to resume from (a fresh start) is in none, so the tiers sum "
        "to at most checkpointLoad. Absent from trainers that do not report the split.")
    startup: float = Field(default=0.0, description="Process start to the first step: "
                           "rendezvous, model build, compilation.")
    evaluation: float = Field(default=0.0, description="Validation passes.")
    lost_progress: float = Field(default=0.0, description="Step time once spent on steps that "
                                 "a restart made the job redo.")
    downtime: float = Field(default=0.0, description="Between the last step of one attempt and "
                            "the start of the next: replacement, scheduling, backoff.")
    oom: float = Field(default=0.0, description="Lost progress and downtime of attempts that "
                       "ran out of memory (runPolicy.outOfMemory's restarts).")
    straggler: float = Field(default=0.0, description="Time lost while a rank was a "
                             "straggler (runPolicy.stragglers), from the first slow interval "
                             "of its episode: the group's steps and saves over their healthy "
                             "pace, since every rank waits for the slowest.")
    preflight: float = Field(default=0.0, description="The health check before each attempt's "
                             "first step (runPolicy.preflight).")


class GoodputStatus(ApiModel):
    """Where the job's wall time went, reported by its trainer (cumulative across restarts)."""

    model_config = ConfigDict(extra="ignore")

    ratio: float = Field(description="Productive step time over wall time since the job first "
                         "started (0..1).")
    productive_seconds: float = Field(description="Time spent on steps the job keeps.")
    wall_seconds: float = Field(description="Wall time since the job first started, as of the "
                                "trainer's last report.")
    badput_seconds: BadputSeconds = Field(default_factory=BadputSeconds,
                                          description="The rest of the wall time, by cause.")


class CheckpointStatus(ApiModel):
    model_config = ConfigDict(extra="ignore")

    step: int = Field(description="Step of the newest committed checkpoint.")
    uri: str = Field(description="Where it is.")
    time: datetime | None = Field(default=None, description="When it was committed.")


class BestCheckpointStatus(ApiModel):
    model_config = ConfigDict(extra="ignore")

    step: int = Field(description="Step of the checkpoint with the lowest validation loss.")
    validation_loss: float = Field(description="Its validation loss.")
    uri: str = Field(description="Its folder: give it to checkpoint.resumeFrom or "
                     "`kubetrain generate --checkpoint`.")


class WorkerFailure(ApiModel):
    """One worker pod's end, classified (status.lastFailure)."""

    model_config = ConfigDict(extra="ignore")

    class_: FailureClass = Field(
        alias="class",
        description="OOMKilled, CUDAOutOfMemory, Evicted, Preempted, NodeLost, "
        "CollectiveTimeout, GPUError, PreflightFailed, UserError "
        "(runPolicy.permanentExitCodes) or Unknown.",
    )
    pod: str = Field(default="", description="The worker pod.")
    node: str | None = Field(default=None, description="The node it ran on.")
    exit_code: int | None = Field(default=None, description="Its trainer container's exit code.")
    message: str = Field(default="", description="What happened, from the pod's status and the "
                         "trainer's termination message (never environment or credentials).")
    time: datetime | None = Field(default=None, description="When the operator saw it.")


class EffectiveBatch(ApiModel):
    """The batch split the workers use, when the operator changed it from the spec's."""

    model_config = ConfigDict(extra="ignore")

    micro_batch_size: int = Field(description="Sequences per process per forward/backward "
                                  "pass: the spec's, or less after out-of-memory restarts.")
    gradient_accumulation_steps: int = Field(
        description="Micro-batches per optimizer step at the job's replicas: grows as the "
        "micro-batch shrinks, so the global batch is the spec's.")
    out_of_memory_restarts: int = Field(
        default=0, description="Restarts for running out of memory so far (each halved the "
        "micro-batch; not counted in restarts).")
    spec_micro_batch_size: int | None = Field(
        default=None, description="The spec's optimization.microBatchSize these values come "
        "from: when the spec's changes, the workers start again from the new one.")
    reason: str | None = Field(default=None, description="Why the values last changed.")
    time: datetime | None = Field(default=None, description="When they last changed.")


class RestartStatus(ApiModel):
    """The group's latest restart (status.restart): what the operator keeps doing until
    the replacements run."""

    model_config = ConfigDict(extra="ignore")

    reason: str = Field(description="Why the group restarts: WorkerFailed, NodeLost, "
                        "PendingTimeout, ProgressDeadlineExceeded, OutOfMemory, PreflightFailed "
                        "or StragglerReplaced.")
    attempt: int = Field(description="The restart attempt it began (status.restartAttempt, the "
                         "pods' label kubetrain.io/restart-attempt).")
    time: datetime = Field(description="When it began.")
    counted: bool = Field(default=True, description="Counted in runPolicy.maxRestarts, and "
                          "its pods wait out the backoff; out-of-memory and straggler restarts "
                          "are not.")
    whole_group: bool = Field(default=False, description="Whether every worker is recreated "
                              "(worker 0, the rendezvous host, was among the broken; a hang; a "
                              "new micro-batch; a failed preflight) or only the broken ones.")


class FailureStreak(ApiModel):
    model_config = ConfigDict(extra="ignore")

    exit_code: int = Field(description="Exit code that ended the latest attempts.")
    count: int = Field(description="Attempts in a row it ended with no training progress between.")
    step: int = Field(description="Training step when the streak began.")


class RankSlowness(ApiModel):
    """One rank's slowness at the last judged interval, and for how long it has been slow."""

    model_config = ConfigDict(extra="ignore")

    rank: int = Field(description="The rank (torch.distributed) in the current group.")
    pod: str = Field(description="The worker pod the rank runs in.")
    node: str = Field(description="The node that pod runs on.")
    slowness: float = Field(description="The rank's compute time per step over the median "
                            "rank's (1: as fast as the median); under tensorParallel, its "
                            "group's smallest rank's over the median group's, the same for "
                            "every rank of the group.")
    slow_intervals: int = Field(description="Consecutive judged intervals the rank has been "
                                "above runPolicy.stragglers.threshold (a straggler from "
                                "runPolicy.stragglers.window on).")
    straggler: bool = Field(default=False, description="Reported as a straggler: from "
                            "runPolicy.stragglers.window consecutive slow intervals until as "
                            "many consecutive intervals at or under the threshold.")
    normal_intervals: int = Field(default=0, description="Consecutive judged intervals at or "
                                  "under the threshold (a straggler's recovery).")
    compute_seconds_total: float | None = Field(
        default=None, description="The rank's seconds of compute since its process started, "
        "at this judgement: the next one judges the compute time in between.")


class RanksStatus(ApiModel):
    """Every rank's slowness, judged once per logged interval (kubetrain.operator.stragglers)."""

    model_config = ConfigDict(extra="ignore")

    step: int = Field(description="The logged step whose interval was judged last.")
    ranks: list[RankSlowness] = Field(default_factory=list, description="By rank.")


class AvoidedNode(ApiModel):
    """A node this job's pods keep off for a while (runPolicy.avoidNodesFor)."""

    model_config = ConfigDict(extra="ignore")

    node: str = Field(description="The node's name.")
    reason: Literal["Straggler", "PreflightFailed", "RepeatedFailures", "Unreachable"] = Field(
        description="Straggler (runPolicy.stragglers.action Replace), PreflightFailed, "
        "RepeatedFailures (two Unknown, CollectiveTimeout or GPUError failures on it within "
        "an hour), or Unreachable (a trainer's lifeline there went silent: the node or its "
        "network was lost).")
    message: str = Field(default="", description="What was seen on it.")
    time: datetime = Field(description="When the job began to avoid it.")
    expires: datetime = Field(description="When its pods may run there again.")


class NodeFailure(ApiModel):
    """A failure on a node that counts towards avoiding it (status.nodeFailures)."""

    model_config = ConfigDict(extra="ignore")

    node: str = Field(description="The node the failed pod ran on.")
    class_: FailureClass = Field(alias="class", description="Unknown, CollectiveTimeout or "
                                 "GPUError.")
    pod: str = Field(default="", description="The worker pod that failed.")
    time: datetime = Field(description="When the operator saw it.")


class TrainingJobStatus(ApiModel):
    """Observed state, written only by the operator."""

    model_config = ConfigDict(extra="ignore")

    phase: Phase | None = Field(default=None, description="Pending, Running, Restarting, "
                                "Suspended, Succeeded or Failed.")
    conditions: list[Condition] = Field(default_factory=list, description="Detailed conditions.")
    observed_generation: int | None = Field(
        default=None, description="The spec generation this status describes."
    )
    workers: WorkersStatus = Field(default_factory=WorkersStatus, description="Worker counts.")
    restarts: int = Field(default=0, description="Group restarts so far.")
    restart_attempt: int = Field(
        default=0,
        description="Generation of the worker group (label kubetrain.io/restart-attempt).",
    )
    last_restart_time: datetime | None = Field(
        default=None, description="When the group last restarted."
    )
    restart: RestartStatus | None = Field(
        default=None, description="The latest restart: why, whether it counts and waits a "
        "backoff, and whether it recreates the whole group.")
    last_failure: WorkerFailure | None = Field(
        default=None, description="The last worker failure, classified: class, pod, node, "
        "exit code, message and time.")
    failures: dict[str, int] = Field(
        default_factory=dict, description="Worker failures so far by class (see "
        "lastFailure.class).")
    effective: EffectiveBatch | None = Field(
        default=None, description="The micro-batch and gradient accumulation the workers "
        "use: the spec's until an out-of-memory restart halves the micro-batch.")
    progress: Progress = Field(default_factory=Progress, description="Training progress.")
    latest_checkpoint: CheckpointStatus | None = Field(
        default=None, description="Newest committed checkpoint."
    )
    best_checkpoint: BestCheckpointStatus | None = Field(
        default=None, description="The checkpoint with the lowest validation loss "
        "(checkpoint.keepBest).",
    )
    goodput: GoodputStatus | None = Field(
        default=None, description="Where the job's wall time went: goodput and badput by cause."
    )
    start_time: datetime | None = Field(default=None, description="When the job first ran.")
    completion_time: datetime | None = Field(default=None, description="When the job finished.")
    failure_streak: FailureStreak | None = Field(
        default=None,
        description="The same non-signal exit code ending consecutive attempts "
        "(repeatedFailureLimit).",
    )
    ranks: RanksStatus | None = Field(
        default=None, description="Each rank's slowness (compute time over the median "
        "rank's; under tensorParallel, its group's over the median group's), as the "
        "straggler rule judged it last (runPolicy.stragglers).",
    )
    avoided_nodes: list[AvoidedNode] = Field(
        default_factory=list, description="Nodes this job's pods keep off until each one's "
        "expiry: a required node anti-affinity on every pod created meanwhile.",
    )
    node_failures: list[NodeFailure] = Field(
        default_factory=list, description="The last hour's first failure of class Unknown, "
        "CollectiveTimeout or GPUError on each node: a second one there within the hour "
        "avoids the node (reason RepeatedFailures).",
    )
    straggler_replacements: int = Field(
        default=0, description="Straggler pods recreated off their node so far "
        "(runPolicy.stragglers.action Replace; at most runPolicy.maxRestarts, not counted in "
        "restarts).",
    )
    kopf: dict[str, Any] = Field(
        default_factory=dict,
        description="Handler progress of the kopf framework, kept here instead of annotations.",
    )

    @field_validator("last_failure", mode="before")
    @classmethod
    def _failure_from_text(cls, value: Any) -> Any:
        # Operators before failure classes wrote the failure as a sentence.
        if isinstance(value, str):
            return {"class": "Unknown", "message": value}
        return value


# --- the resource ----------------------------------------------------------------------


class ObjectMeta(BaseModel):
    """The parts of Kubernetes metadata kubetrain reads; the rest passes through."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(description="Job name: a DNS label of at most 50 characters.")
    namespace: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    uid: str | None = None
    generation: int | None = None

    @field_validator("name")
    @classmethod
    def _dns_label(cls, value: str) -> str:
        if len(value) > MAX_JOB_NAME_LENGTH or not DNS_LABEL.match(value):
            raise ValueError(
                f"{value!r} is not a valid job name: use at most {MAX_JOB_NAME_LENGTH} lowercase "
                "letters, digits and '-', starting and ending with a letter or digit "
                "(pods are named <job>-worker-<i>)"
            )
        return value


class TrainingJob(ApiModel):
    """A distributed training run: `kubectl apply -f` it, or `kubetrain run` it locally."""

    api_version: Literal["kubetrain.io/v1alpha1"] = Field(
        default=API_VERSION, description="kubetrain.io/v1alpha1"
    )
    kind: Literal["TrainingJob"] = Field(default=KIND, description="TrainingJob")
    metadata: ObjectMeta
    spec: TrainingJobSpec
    status: TrainingJobStatus | None = None

    @property
    def micro_batch_size(self) -> int:
        """The micro-batch the workers use: status.effective's after an out-of-memory
        restart (the operator's ConfigMap and `kubetrain run` pass it on), else the spec's."""
        if self.status is not None and self.status.effective is not None:
            return self.status.effective.micro_batch_size
        return self.spec.optimization.micro_batch_size
