"""spec.metrics: the trainer's Prometheus port, log cadence and experiment trackers."""

from __future__ import annotations

from pydantic import Field

from kubetrain.api.base import ApiModel


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

