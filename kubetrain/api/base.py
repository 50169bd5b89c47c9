"""The base of every TrainingJob API model, and the helpers each spec section's module uses.

`ApiModel` (camelCase on the wire, unknown fields refused), `problem` (an error that names
its field), `cel` (one CRD validation rule) and the URI checks shared by every field that
holds a URI. Torch-free; imports nothing from the other API modules.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel
from pydantic.json_schema import JsonDict
from pydantic_core import PydanticCustomError

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


# What `check_uri` refuses, the API server refuses too, so `kubectl apply` fails at once
# instead of the job failing later; the length bound keeps the rule's CEL cost small.
URI_RULES: JsonDict = {"x-kubetrain-cel": [cel(
    "!self.contains('://') || self.startsWith('s3://') || self.startsWith('file://')",
    "unsupported scheme: use s3://bucket/prefix, file:///path or a plain path")]}
URI_MAX_LENGTH = 2048


def check_uri(value: str) -> None:
    """Refuse a URI of a scheme kubetrain cannot read (what URI_RULES refuses on the server)."""
    if "://" in value and not value.startswith(("s3://", "file://")):
        scheme = value.split("://", 1)[0]
        raise ValueError(f"unsupported scheme {scheme}://: use s3://bucket/prefix, "
                         "file:///path or a plain path")


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
