"""spec.checkpoint: where and how often training state is saved, and the in-memory tier."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from kubetrain.api.base import (
    URI_MAX_LENGTH,
    URI_RULES,
    ApiModel,
    IntOrString,
    cel,
    check_uri,
    problem,
)


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
            check_uri(value)
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

