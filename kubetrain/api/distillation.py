"""spec.distillation: training from a frozen teacher's predictions as well as the labels."""

from __future__ import annotations

from pydantic import Field, field_validator

from kubetrain.api.base import URI_MAX_LENGTH, URI_RULES, ApiModel, check_uri


class DistillationSpec(ApiModel):
    """Knowledge distillation: the student learns from a frozen teacher's soft predictions."""

    teacher: str = Field(
        min_length=1, max_length=URI_MAX_LENGTH, json_schema_extra=URI_RULES,
        description="URI of the teacher: a Hugging Face model folder of a family kubetrain "
        "builds (as model.init reads: config.json and safetensors) or another job's export "
        "(<checkpoint uri>/export), whose INL dynamics, if it has them, the teacher is "
        "built with: s3://bucket/prefix, file:///path or a path. Its vocabulary must be the "
        "student's, and its tokenizer.json, when the folder has one, the one the data was "
        "prepared with.",
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
        check_uri(value)
        return value

