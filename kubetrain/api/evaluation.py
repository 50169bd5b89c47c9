"""spec.evaluation: validation during training and early stopping."""

from __future__ import annotations

from pydantic import Field

from kubetrain.api.base import ApiModel


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

