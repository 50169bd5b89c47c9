"""spec.workers: the worker pods, their resources and the pod template's overrides."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, model_validator

from kubetrain.api.base import ApiModel, IntOrString, cel, problem

# Environment variable names that carry credentials: they must come from a Secret.
CREDENTIAL_ENV_NAMES = frozenset({
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
    "WANDB_API_KEY", "HF_TOKEN",
})


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

