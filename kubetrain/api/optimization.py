"""spec.optimization: optimizer, learning-rate schedule, batch size and training length."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from kubetrain.api.base import ApiModel, cel, problem

DEFAULT_MAX_STEPS = 1000


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

