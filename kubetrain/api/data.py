"""spec.data: the prepared token shards, validation split and tokenizer."""

from __future__ import annotations

from pydantic import ConfigDict, Field, field_validator

from kubetrain.api.base import URI_MAX_LENGTH, URI_RULES, ApiModel, cel, check_uri


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
            check_uri(value)
        return value

