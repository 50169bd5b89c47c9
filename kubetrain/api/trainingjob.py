"""The TrainingJob API (kubetrain.io/v1alpha1) as pydantic models.

The single source of truth for the resource: the operator, the trainer, the local
runner and the CLI all read a job through these models, and the CRD in
crds/trainingjob.yaml is generated from them (kubetrain.api.crd). Field
descriptions become `kubectl explain` text. Torch-free by design.

Cross-field rules live twice on purpose: as pydantic validators here (for
`kubetrain validate`, the trainer and the runner) and as CEL rules on the CRD
(`cel=` in each model's json_schema_extra) so the API server rejects the same
manifests; tests check the two agree.

Each spec section is a module of its own (workers, model, data, optimization, evaluation,
distillation, parallelism, fault_tolerance, checkpoint, storage, metrics, run_policy,
own_code; status; base holds ApiModel and the helpers). This module holds the resource,
its spec's cross-section rules, and re-exports every section's public names, so
`from kubetrain.api.trainingjob import X` works for all of them.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.json_schema import JsonDict

from kubetrain.api.base import (
    URI_MAX_LENGTH,
    URI_RULES,
    ApiModel,
    IntOrString,
    cel,
    check_uri,
    problem,
)
from kubetrain.api.checkpoint import CheckpointSpec, MemoryCheckpointSpec, step_folder
from kubetrain.api.data import DataSpec
from kubetrain.api.distillation import DistillationSpec
from kubetrain.api.evaluation import EarlyStopping, EvaluationSpec
from kubetrain.api.fault_tolerance import (
    FaultToleranceSpec,
    fault_tolerance_refusals,
    fault_tolerance_rules,
)
from kubetrain.api.metrics import MetricsSpec, TrackingSpec
from kubetrain.api.model import DynamicsSpec, ModelSpec
from kubetrain.api.optimization import DEFAULT_MAX_STEPS, OptimizationSpec
from kubetrain.api.own_code import (
    CHECKPOINT_TYPED_ONLY,
    CHECKPOINT_WHY,
    KUBETRAIN_TORCHRUN_OPTIONS,
    TYPED_ONLY,
    TrainerSpec,
    at_default_cel,
    changed_fields,
    own_code_rules,
)
from kubetrain.api.parallelism import (
    TP_NEEDS_SHARDING,
    TP_WITHOUT_FP8,
    ParallelismSpec,
    tensor_parallel_problems,
)
from kubetrain.api.presets import PRESET_NAMES, PRESETS, ModelDims, Preset, PresetName
from kubetrain.api.run_policy import (
    OutOfMemoryPolicy,
    PreflightPolicy,
    RunPolicy,
    StragglerPolicy,
)
from kubetrain.api.scheduling import (
    KUEUE_QUEUE_LABEL,
    MANAGED_BY_PATTERN,
    VOLCANO_NEEDS_ITS_SCHEDULER,
    VOLCANO_SCHEDULER,
    KueueStatus,
    SchedulingSpec,
    SchedulingStatus,
    TopologyRequest,
    check_managed_by,
    managed_elsewhere,
    scheduling_rules,
)
from kubetrain.api.status import (
    FINISHED,
    AvoidedNode,
    BadputSeconds,
    BestCheckpointStatus,
    CheckpointLoadSeconds,
    CheckpointStatus,
    Condition,
    EffectiveBatch,
    FailureStreak,
    GoodputStatus,
    NodeFailure,
    Phase,
    Progress,
    RankSlowness,
    RanksStatus,
    ReplicaGroupsStatus,
    RestartStatus,
    TrainingJobStatus,
    WorkerFailure,
    WorkersStatus,
)
from kubetrain.api.storage import SecretReference, StorageSpec
from kubetrain.api.workers import (
    CREDENTIAL_ENV_NAMES,
    EnvVar,
    EnvVarSource,
    PodTemplate,
    ResourceRequirements,
    SecretKeySelector,
    Workers,
)
from kubetrain.memory_budget import parse_quantity, tier_budget

GROUP = "kubetrain.io"
VERSION = "v1alpha1"
API_VERSION: Final = "kubetrain.io/v1alpha1"
KIND: Final = "TrainingJob"
PLURAL = "trainingjobs"

# Names of worker pods are `<job>-worker-<index>` and must stay DNS labels (<= 63).
MAX_JOB_NAME_LENGTH = 50
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

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
        *own_code_rules(),
        *_tensor_parallel_rules(),
        *scheduling_rules(),
        *fault_tolerance_rules(),
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
    fault_tolerance: FaultToleranceSpec | None = Field(
        default=None,
        description="Per-step fault tolerance (torchft): the workers split into replicaGroups "
        "groups of whole pods that replicate one another, so when a group fails the others "
        "keep training and it heals from a live peer when it comes back; omit it for "
        "whole-job restarts from a checkpoint. The operator runs torchft's lighthouse and "
        "one torchrun group per replica group, as `kubetrain run` does on one machine: "
        "docs/fault-tolerance.md.",
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
    scheduling: SchedulingSpec = Field(
        default_factory=SchedulingSpec, description="Gang placement (all workers or none), a "
        "Kueue queue and a topology level: docs/scheduling.md.",
    )
    managed_by: str | None = Field(
        default=None, max_length=63, pattern=MANAGED_BY_PATTERN,
        description="The controller that runs this job; absent or kubetrain.io/operator: "
        "kubetrain's operator. Any other value (MultiKueue's kueue.x-k8s.io/multikueue) makes "
        "the operator leave the job alone: no pods, no status writes. Immutable, as Job's.",
    )

    @field_validator("managed_by", mode="before")
    @classmethod
    def _a_controller_name(cls, managed_by: object) -> object:
        return check_managed_by(managed_by)

    @model_validator(mode="after")
    def _volcano_on_its_scheduler(self) -> TrainingJobSpec:
        scheduler = self.workers.template.scheduler_name
        if self.scheduling.gang == "Volcano" and scheduler not in (None, VOLCANO_SCHEDULER):
            raise problem("scheduling.gang", f"Volcano with workers.template.schedulerName "
                          f"{scheduler}: {VOLCANO_NEEDS_ITS_SCHEDULER.split(': ', 1)[1]}")
        return self

    @property
    def managed_elsewhere(self) -> bool:
        """Whether another controller (spec.managedBy) runs the job: the operator leaves it."""
        return managed_elsewhere(self.managed_by)

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
    def _fault_tolerance_fits(self) -> TrainingJobSpec:
        if self.fault_tolerance is None:
            return self
        workers = self.workers
        refusals = fault_tolerance_refusals(self.fault_tolerance, workers.replicas,
                                            workers.min_replicas, workers.max_replicas,
                                            self.parallelism.strategy)
        if refusals:
            raise problem(*refusals[0])
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

    @model_validator(mode="after")
    def _one_queue(self) -> TrainingJob:
        labelled = self.metadata.labels.get(KUEUE_QUEUE_LABEL)
        queue = self.spec.scheduling.queue
        if labelled and queue and labelled != queue:
            raise problem("spec.scheduling.queue", f"({queue}) and the label "
                          f"{KUEUE_QUEUE_LABEL} ({labelled}) name different Kueue queues: "
                          "keep spec.scheduling.queue and remove the label, or make them "
                          "the same")
        return self

    @property
    def micro_batch_size(self) -> int:
        """The micro-batch the workers use: status.effective's after an out-of-memory
        restart (the operator's ConfigMap and `kubetrain run` pass it on), else the spec's."""
        if self.status is not None and self.status.effective is not None:
            return self.status.effective.micro_batch_size
        return self.spec.optimization.micro_batch_size


__all__ = [
    "API_VERSION",
    "CHECKPOINT_TYPED_ONLY",
    "CHECKPOINT_WHY",
    "CREDENTIAL_ENV_NAMES",
    "DEFAULT_MAX_STEPS",
    "DNS_LABEL",
    "FINISHED",
    "GROUP",
    "KIND",
    "KUBETRAIN_TORCHRUN_OPTIONS",
    "KUEUE_QUEUE_LABEL",
    "MAX_JOB_NAME_LENGTH",
    "PLURAL",
    "PRESETS",
    "PRESET_NAMES",
    "TENSOR_PARALLEL_REFUSALS",
    "TP_NEEDS_SHARDING",
    "TP_WITHOUT_FP8",
    "TYPED_ONLY",
    "URI_MAX_LENGTH",
    "URI_RULES",
    "VERSION",
    "ApiModel",
    "AvoidedNode",
    "BadputSeconds",
    "BestCheckpointStatus",
    "CheckpointLoadSeconds",
    "CheckpointSpec",
    "CheckpointStatus",
    "Condition",
    "DataSpec",
    "DistillationSpec",
    "DynamicsSpec",
    "EarlyStopping",
    "EffectiveBatch",
    "EnvVar",
    "EnvVarSource",
    "EvaluationSpec",
    "FailureStreak",
    "FaultToleranceSpec",
    "GoodputStatus",
    "IntOrString",
    "KueueStatus",
    "MemoryCheckpointSpec",
    "MetricsSpec",
    "ModelDims",
    "ModelSpec",
    "NodeFailure",
    "ObjectMeta",
    "OptimizationSpec",
    "OutOfMemoryPolicy",
    "ParallelismSpec",
    "Phase",
    "PodTemplate",
    "PreflightPolicy",
    "Preset",
    "PresetName",
    "Progress",
    "RankSlowness",
    "RanksStatus",
    "ReplicaGroupsStatus",
    "ResourceRequirements",
    "RestartStatus",
    "RunPolicy",
    "SchedulingSpec",
    "SchedulingStatus",
    "SecretKeySelector",
    "SecretReference",
    "StorageSpec",
    "StragglerPolicy",
    "TopologyRequest",
    "TrackingSpec",
    "TrainerSpec",
    "TrainingJob",
    "TrainingJobSpec",
    "TrainingJobStatus",
    "WorkerFailure",
    "Workers",
    "WorkersStatus",
    "at_default_cel",
    "cel",
    "changed_fields",
    "check_uri",
    "managed_elsewhere",
    "problem",
    "step_folder",
    "tensor_parallel_problems",
]
