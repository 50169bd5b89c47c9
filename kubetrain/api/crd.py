"""Print the TrainingJob CustomResourceDefinition, generated from the API models.

The CRD in crds/trainingjob.yaml (and the Helm chart's copy) is this command's
output; a test fails when they drift. Pydantic's JSON Schema is turned into a
Kubernetes structural schema: references inlined, optionals without `anyOf`,
int-or-string as `x-kubernetes-int-or-string`, free-form objects as
`x-kubernetes-preserve-unknown-fields`, and each model's CEL rules as
`x-kubernetes-validations`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic_core import core_schema

from kubetrain.api.trainingjob import (
    API_VERSION,
    DNS_LABEL,
    GROUP,
    KIND,
    MAX_JOB_NAME_LENGTH,
    PLURAL,
    VERSION,
    TrainingJobSpec,
    TrainingJobStatus,
)

Schema = dict[str, Any]

# JSON Schema keywords a structural schema does not take (or that only document pydantic).
_DROPPED = {"title", "examples", "$defs"}


def _inline(schema: Any, defs: dict[str, Schema]) -> Any:
    """Replace every `$ref` by the definition it points to, keeping sibling keywords."""
    if isinstance(schema, list):
        return [_inline(item, defs) for item in schema]
    if not isinstance(schema, dict):
        return schema
    if "$ref" in schema:
        target = defs[schema["$ref"].rsplit("/", 1)[-1]]
        siblings = {k: v for k, v in schema.items() if k != "$ref"}
        return _inline({**target, **siblings}, defs)
    return {key: _inline(value, defs) for key, value in schema.items()}


def _is_null(schema: Schema) -> bool:
    return schema.get("type") == "null"


def structural(schema: Schema) -> Schema:
    """Convert one inlined pydantic JSON Schema node into Kubernetes' structural form."""
    node = dict(schema)
    if "anyOf" in node:
        options = [option for option in node.pop("anyOf") if not _is_null(option)]
        types = {option.get("type") for option in options}
        if types == {"integer", "string"}:
            node["x-kubernetes-int-or-string"] = True
        elif types == {"string"} and all("enum" in o or "const" in o for o in options):
            # A union of Literals is one enum.
            node["type"] = "string"
            node["enum"] = [v for o in options for v in o.get("enum", [o.get("const")])]
        elif len(options) == 1:
            # An optional field: Kubernetes expresses "may be absent" by not requiring it.
            merged = {**options[0], **node}
            if merged.get("default", 0) is None:
                del merged["default"]
            return structural(merged)
        else:
            raise ValueError(f"union not expressible in a structural schema: {options}")
    if node.get("default", 0) is None:
        del node["default"]
    if "const" in node:
        node["enum"] = [node.pop("const")]
    for bound, exclusive in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(node.get(bound), int | float) and not isinstance(node[bound], bool):
            node[exclusive] = node.pop(bound)
            node[bound] = True
    if "prefixItems" in node:
        # Fixed-length tuples (Adam betas): same item type, length bounded by min/maxItems.
        items = node.pop("prefixItems")
        node["items"] = items[0]
    rules = node.pop("x-kubetrain-cel", None)
    if rules:
        node["x-kubernetes-validations"] = rules

    extra = node.pop("additionalProperties", None)
    if node.get("type") == "object" and "properties" not in node:
        if isinstance(extra, dict) and extra:
            node["additionalProperties"] = structural(extra)  # a map with typed values
        else:
            node["x-kubernetes-preserve-unknown-fields"] = True  # free-form (affinity, volumes)
    if isinstance(node.get("default"), dict):
        del node["default"]  # object defaults come from the models...
    if _SECTION_DEFAULT in node:
        node["default"] = node.pop(_SECTION_DEFAULT)  # ...and a spec section's from its model
    if isinstance(node.get("default"), tuple):
        node["default"] = list(node["default"])

    result: Schema = {}
    for key, value in node.items():
        if key in _DROPPED:
            continue
        if key == "properties":
            result[key] = {name: structural(prop) for name, prop in value.items()}
        elif key == "items":
            result[key] = structural(value)
        else:
            result[key] = value
    return result


_SECTION_DEFAULT = "x-kubetrain-section-default"


class _SectionDefaults(GenerateJsonSchema):
    """A spec section that defaults to a model instance gets that instance as its default.

    The API server then stores every section with its fields' defaults filled in, as
    the models fill them, and the CEL rules that keep a field from changing see the
    field even when the manifest left its whole section out (a transition rule is not
    evaluated on an object that did not exist before).
    """

    def default_schema(self, schema: core_schema.WithDefaultSchema) -> JsonSchemaValue:
        json_schema = super().default_schema(schema)
        factory = schema.get("default_factory")
        if isinstance(factory, type) and issubclass(factory, BaseModel):
            # The whole default instance, not `{}`: the server checks a default against
            # the section's CEL rules without filling in the fields' own defaults first.
            json_schema[_SECTION_DEFAULT] = factory().model_dump(
                mode="json", by_alias=True, exclude_none=True)
        return json_schema


def _schema_of(model: type[TrainingJobSpec] | type[TrainingJobStatus]) -> Schema:
    generator = _SectionDefaults if model is TrainingJobSpec else GenerateJsonSchema
    raw = model.model_json_schema(by_alias=True, mode="validation",
                                  schema_generator=generator)
    return structural(_inline(raw, raw.get("$defs", {})))


def open_api_schema() -> Schema:
    """The CRD's `openAPIV3Schema` for TrainingJob."""
    return {
        "type": "object",
        "description": "A distributed training run: a group of torchrun worker pods training "
        "one model, checkpointing to object storage and resuming after any failure.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": _schema_of(TrainingJobSpec),
            "status": _schema_of(TrainingJobStatus),
        },
        "x-kubernetes-validations": [{
            "rule": f"self.metadata.name.size() <= {MAX_JOB_NAME_LENGTH}",
            "message": f"metadata.name must be at most {MAX_JOB_NAME_LENGTH} characters "
            "(worker pods are named <job>-worker-<i>)",
        }, {
            # The server allows dots in names; the job's headless Service does not.
            "rule": f"self.metadata.name.matches('{DNS_LABEL.pattern}')",
            "message": "metadata.name must be a DNS label: lowercase letters, digits and '-', "
            "starting and ending with a letter or digit (no dots: it names the job's Service)",
        }],
    }


def custom_resource_definition() -> dict[str, Any]:
    """The whole TrainingJob CustomResourceDefinition."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{GROUP}",
            "labels": {"app.kubernetes.io/part-of": "kubetrain"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": ["tj"],
                "categories": ["kubetrain"],
            },
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": open_api_schema()},
                "subresources": {
                    "status": {},
                    "scale": {
                        "specReplicasPath": ".spec.workers.replicas",
                        "statusReplicasPath": ".status.workers.ready",
                        "labelSelectorPath": ".status.workers.selector",
                    },
                },
                "additionalPrinterColumns": [
                    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                    {"name": "Step", "type": "integer", "jsonPath": ".status.progress.step"},
                    {"name": "Loss", "type": "number", "jsonPath": ".status.progress.loss"},
                    {"name": "Workers", "type": "integer", "jsonPath": ".status.workers.ready",
                     "description": "Workers running and ready"},
                    {"name": "Goodput", "type": "number", "jsonPath": ".status.goodput.ratio",
                     "description": "Productive step time over wall time (0..1)"},
                    {"name": "ETA", "type": "integer", "jsonPath": ".status.progress.etaSeconds",
                     "description": "Seconds until maxSteps at the recent step time"},
                    # -o wide only (priority 1): what an out-of-memory restart changed.
                    {"name": "Micro-batch", "type": "integer", "priority": 1,
                     "jsonPath": ".status.effective.microBatchSize",
                     "description": "Micro-batch the workers use (status.effective)"},
                    {"name": "Last-failure", "type": "string", "priority": 1,
                     "jsonPath": ".status.lastFailure.class",
                     "description": "Class of the last worker failure"},
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                ],
            }],
        },
    }


def render() -> str:
    """The CRD as the YAML committed in crds/trainingjob.yaml."""
    header = (f"# Generated by `kubetrain crd` from the {API_VERSION} API models "
              "(kubetrain/api/trainingjob.py). Do not edit by hand.\n")
    return header + yaml.safe_dump(custom_resource_definition(), sort_keys=False, width=100)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", help="write to this file instead of standard output")


def run(args: argparse.Namespace) -> int:
    text = render()
    if args.output:
        with open(args.output, "w") as out:
            out.write(text)
    else:
        sys.stdout.write(text)
    return 0
