"""The generated CRD: committed file, Kubernetes schemas, structural rules, CEL rules."""

from __future__ import annotations

import copy
import functools
import subprocess
import sys
from pathlib import Path
from typing import Any

import celpy
import kubernetes_validate
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kubetrain.api import InvalidManifest, parse_job
from kubetrain.api.crd import custom_resource_definition, open_api_schema, render

REPO = Path(__file__).resolve().parents[2]
OLDEST_KUBERNETES = "1.28.0"  # CEL fieldPath needs 1.28; the chart declares the same floor


def test_committed_crd_matches_what_kubetrain_crd_prints() -> None:
    committed = (REPO / "crds" / "trainingjob.yaml").read_text()
    assert committed == render(), "stale: run `kubetrain crd -o crds/trainingjob.yaml`"


@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, kubernetes_validate.latest_version()])
def test_crd_is_a_valid_custom_resource_definition(version: str) -> None:
    kubernetes_validate.validate(custom_resource_definition(), version, strict=True)


def _walk(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    nodes = [(path, schema)]
    for name, child in schema.get("properties", {}).items():
        nodes += _walk(child, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            nodes += _walk(schema[key], f"{path}[{key}]")
    return nodes


def test_schema_is_structural() -> None:
    """Kubernetes' structural-schema rules, checked node by node."""
    for path, node in _walk(open_api_schema()):
        assert "$ref" not in node and "anyOf" not in node and "oneOf" not in node, path
        assert "allOf" not in node and "not" not in node, path
        free_form = node.get("x-kubernetes-int-or-string") or node.get(
            "x-kubernetes-preserve-unknown-fields")
        assert "type" in node or free_form, f"{path} has no type"
        assert not ("properties" in node and "additionalProperties" in node), path
        assert "nullable" not in node, path
        if isinstance(node.get("exclusiveMinimum"), (int, float)):
            assert isinstance(node["exclusiveMinimum"], bool), path  # OpenAPI v3.0 form


def test_pod_template_free_form_fields_preserve_unknown_fields() -> None:
    spec = open_api_schema()["properties"]["spec"]
    props = spec["properties"]["workers"]["properties"]["template"]["properties"]
    assert props["affinity"]["x-kubernetes-preserve-unknown-fields"] is True
    assert props["tolerations"]["items"]["x-kubernetes-preserve-unknown-fields"] is True
    assert props["volumes"]["items"]["x-kubernetes-preserve-unknown-fields"] is True


def test_scale_subresource_and_printer_columns() -> None:
    version = custom_resource_definition()["spec"]["versions"][0]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.workers.replicas"
    assert "status" in version["subresources"]
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Phase", "Step", "Loss", "Workers", "Goodput", "ETA", "Micro-batch",
                       "Last-failure", "Age"]
    # What an out-of-memory restart changed shows with `kubectl get tj -o wide` only.
    wide = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]
            if c.get("priority") == 1}
    assert wide == {"Micro-batch": ".status.effective.microBatchSize",
                    "Last-failure": ".status.lastFailure.class"}


# --- CEL rules: the API server's checks must agree with the models' ------------------------

@functools.cache
def _rules() -> tuple[tuple[tuple[str, ...], dict[str, str]], ...]:
    """Every CEL rule of the CRD's schema with where it sits (the schema is built once)."""
    found = []

    def visit(node: dict[str, Any], at: tuple[str, ...]) -> None:
        for rule in node.get("x-kubernetes-validations", []):
            found.append((at, rule))
        for name, child in node.get("properties", {}).items():
            visit(child, (*at, name))

    visit(open_api_schema(), ())
    return tuple(found)


_CEL = celpy.Environment()


@functools.cache
def _program(rule: str) -> Any:
    """The rule compiled once: parsing it is most of what an evaluation costs."""
    return _CEL.program(_CEL.compile(rule))


def _lookup(document: dict[str, Any], at: tuple[str, ...]) -> Any:
    for part in at:
        if not isinstance(document, dict) or part not in document:
            return None
        document = document[part]
    return document


def cel_violations(new: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
    """Messages of every CEL rule the API server would fail for this create (or update)."""
    failed = []
    for at, rule in _rules():
        value = _lookup(new, at)
        if value is None:
            continue
        is_transition = "oldSelf" in rule["rule"]
        old_value = _lookup(old, at) if old is not None else None
        if is_transition and old_value is None:
            continue  # transition rules only run on updates where the old value exists
        activation = {"self": celpy.json_to_cel(value)}
        if is_transition:
            activation["oldSelf"] = celpy.json_to_cel(old_value)
        if not _program(rule["rule"]).evaluate(activation):
            failed.append(rule["message"])
    return failed


def models_refusal(document: dict[str, Any]) -> str | None:
    """What the models say against a manifest, every problem in one line; None: accepted."""
    try:
        parse_job(document)
    except InvalidManifest as refused:
        return " ".join(str(problem) for problem in refused.problems)
    return None


def with_sections(manifest: dict[str, Any], **sections: dict[str, Any]) -> dict[str, Any]:
    """A copy of `manifest` with each spec section given updated by its values."""
    document = copy.deepcopy(manifest)
    for section, values in sections.items():
        document["spec"].setdefault(section, {}).update(values)
    return document


def validate_command(document: dict[str, Any], folder: Path) -> subprocess.CompletedProcess[str]:
    """`kubetrain validate` of `document`, written as a manifest into `folder`."""
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(document))
    return subprocess.run([sys.executable, "-m", "kubetrain", "validate", str(path)],
                          capture_output=True, text=True, timeout=120)


def _with(manifest: dict[str, Any], section: str, values: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(manifest)
    doc["spec"].setdefault(section, {}).update({k: v for k, v in values.items() if v is not None})
    return doc


def _models_accept(document: dict[str, Any]) -> bool:
    try:
        parse_job(document)
        return True
    except InvalidManifest:
        return False


counts = st.one_of(st.none(), st.integers(min_value=1, max_value=12))


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # copied, never mutated
@given(replicas=st.integers(min_value=1, max_value=12), low=counts, high=counts)
def test_cel_replica_rules_agree_with_the_models(
    minimal_manifest: dict[str, Any], replicas: int, low: int | None, high: int | None
) -> None:
    document = _with(minimal_manifest, "workers",
                     {"replicas": replicas, "minReplicas": low, "maxReplicas": high})
    assert (not cel_violations(document)) == _models_accept(document)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # copied, never mutated
@given(warmup=st.one_of(st.none(), st.integers(0, 300)),
       max_steps=st.one_of(st.none(), st.integers(1, 300)),
       epochs=st.one_of(st.none(), st.floats(0.01, 100)),
       tokens=st.one_of(st.none(), st.integers(1, 10**6)),
       accumulation=st.one_of(st.none(), st.integers(1, 8)))
def test_cel_optimization_rules_agree_with_the_models(
    minimal_manifest: dict[str, Any], warmup: int | None, max_steps: int | None,
    epochs: float | None, tokens: int | None, accumulation: int | None,
) -> None:
    document = _with(minimal_manifest, "optimization", {
        # An explicit warmup, so the models' preset-derived default plays no part.
        "warmupSteps": warmup if warmup is not None else 0, "maxSteps": max_steps,
        "epochs": epochs, "globalBatchTokens": tokens, "gradientAccumulationSteps": accumulation,
    })
    assert (not cel_violations(document)) == _models_accept(document)


@pytest.mark.parametrize(("checkpoint", "evaluation"), [
    ({"keepBest": True}, {"everySteps": 0}), ({"keepBest": True}, {"everySteps": 10}),
    ({"keepBest": True}, None), ({"keepBest": False}, {"everySteps": 0}),
    ({"exportFrom": "best"}, None), ({"exportFrom": "best", "keepBest": True}, None),
    ({"exportFrom": "last"}, {"everySteps": 0}),
])
def test_cel_best_checkpoint_rules_agree_with_the_models(
        minimal_manifest: dict[str, Any], checkpoint: dict[str, Any],
        evaluation: dict[str, Any] | None) -> None:
    document = _with(minimal_manifest, "checkpoint", checkpoint)
    if evaluation is not None:
        document = _with(document, "evaluation", evaluation)
    assert (not cel_violations(document)) == _models_accept(document)


def _stored(manifest: dict[str, Any]) -> dict[str, Any]:
    """The object as the API server stores it: schema defaults applied."""
    return parse_job(manifest).model_dump(by_alias=True, exclude_none=True, mode="json")


@pytest.mark.parametrize(("section", "change"), [
    ("model", {"preset": "llama-350m"}),
    ("checkpoint", {"uri": "s3://elsewhere/ckpt"}),
    ("data", {"seqLen": 4096}),
    ("parallelism", {"strategy": "ddp"}),
    ("workers", {"procsPerWorker": 4}),
])
def test_fields_that_must_not_change_are_rejected_on_update(
    minimal_manifest: dict[str, Any], section: str, change: dict[str, Any]
) -> None:
    old = _stored(minimal_manifest)
    new = copy.deepcopy(old)
    new["spec"][section].update(change)
    assert cel_violations(new, old), f"changing spec.{section} was allowed"


def test_scaling_and_suspending_are_allowed_updates(minimal_manifest: dict[str, Any]) -> None:
    minimal_manifest["spec"]["workers"] = {"replicas": 2, "minReplicas": 1, "maxReplicas": 4}
    old = _stored(minimal_manifest)
    new = copy.deepcopy(old)
    new["spec"]["workers"]["replicas"] = 4
    new["spec"]["runPolicy"] = {"suspend": True}
    assert cel_violations(new, old) == []


def test_long_job_names_are_rejected_by_cel_and_models(minimal_manifest: dict[str, Any]) -> None:
    document = copy.deepcopy(minimal_manifest)
    document["metadata"]["name"] = "a" * 51
    assert cel_violations(document)
    assert not _models_accept(document)


def test_crd_yaml_parses_as_one_document() -> None:
    assert len(list(yaml.safe_load_all(render()))) == 1


def test_every_field_has_kubectl_explain_text() -> None:
    missing = [path for path, node in _walk(open_api_schema()["properties"]["spec"], "spec")
               + _walk(open_api_schema()["properties"]["status"], "status")
               if path.count(".") and "[" not in path.rsplit(".", 1)[-1]
               and "description" not in node]
    assert missing == []


@pytest.mark.parametrize("init", [
    "s3://models/llama", "file:///models/llama", "models/llama", "gs://models/llama",
    "https://huggingface.co/meta-llama/Llama-3.2-1B",
])
def test_cel_model_init_scheme_rule_agrees_with_the_models(
        minimal_manifest: dict[str, Any], init: str) -> None:
    # preset custom without dimensions: with init, config.json supplies them.
    document = _with(minimal_manifest, "model", {"init": init, "preset": "custom"})
    accepted = _models_accept(document)
    assert (not cel_violations(document)) == accepted
    assert accepted == (init.startswith(("s3://", "file://")) or "://" not in init)


@pytest.mark.parametrize(("distillation", "field"), [
    ({"teacher": "s3://models/teacher"}, None),
    ({"teacher": "file:///models/teacher", "temperature": 0.5, "alpha": 0}, None),
    ({"teacher": "/models/teacher", "temperature": 4, "alpha": 1}, None),
    ({"teacher": "https://huggingface.co/x"}, "teacher"),
    ({"teacher": "gs://models/teacher"}, "teacher"),
    ({"teacher": ""}, "teacher"),
    ({"teacher": "s3://m/t", "temperature": 0}, "temperature"),
    ({"teacher": "s3://m/t", "temperature": -1.0}, "temperature"),
    ({"teacher": "s3://m/t", "alpha": 1.5}, "alpha"),
    ({"teacher": "s3://m/t", "alpha": -0.1}, "alpha"),
    ({"temperature": 2.0}, "teacher"),
])
def test_distillation_rules_agree_between_the_server_and_the_models(
        minimal_manifest: dict[str, Any], distillation: dict[str, Any], field: str | None) -> None:
    """temperature > 0, 0 <= alpha <= 1, a teacher URI of a supported scheme: refused alike by
    the CRD (schema bounds and CEL) and by the models, which name the field."""
    from kubetrain.validate import schema_problems

    document = _with(minimal_manifest, "distillation", distillation)
    server_accepts = not cel_violations(document) and not list(schema_problems(document))
    assert server_accepts == _models_accept(document) == (field is None)
    if field is not None:
        with pytest.raises(InvalidManifest) as refused:
            parse_job(document)
        assert any(f"spec.distillation.{field}" in str(p) for p in refused.value.problems)


# --- own code (spec.trainer): one kind of job or the other, on the server and in the models --

def _own_code(minimal_manifest: dict[str, Any]) -> dict[str, Any]:
    document = copy.deepcopy(minimal_manifest)
    spec = document["spec"]
    for typed in ("image", "model", "data"):
        del spec[typed]
    spec["trainer"] = {"image": "ghcr.io/me/train:1", "command": ["python", "train.py"]}
    return document


def test_an_own_code_job_passes_the_server_as_written_and_as_stored(
        minimal_manifest: dict[str, Any]) -> None:
    """The server fills in every section's defaults before its rules run: an own-code job's
    defaulted model, optimization, evaluation and parallelism must not count as set."""
    from kubetrain.validate import schema_problems

    document = _own_code(minimal_manifest)
    stored = _stored(document)
    assert stored["spec"]["model"]["preset"]  # the defaults really are there
    for version in (document, stored):
        assert cel_violations(version) == [] and list(schema_problems(version)) == []
    assert cel_violations(stored, stored) == []  # and an update that changes nothing


@pytest.mark.parametrize(("change", "named"), [
    ({"data": {"train": "s3://datasets/corpus/train"}}, "spec.trainer and spec.data"),
    ({"image": "ghcr.io/kubetrain/trainer:0.1.0"}, "spec.image"),
    ({"model": {"preset": "tiny"}}, "spec.model"),
    ({"model": {"dynamics": {"enabled": True}}}, "spec.model"),
    ({"optimization": {"maxSteps": 10}}, "spec.optimization"),
    ({"optimization": {"betas": [0.9, 0.99]}}, "spec.optimization"),
    ({"optimization": {"minLrRatio": 0.5}}, "spec.optimization"),
    ({"evaluation": {"earlyStopping": {"patience": 2}}}, "spec.evaluation"),
    ({"parallelism": {"compile": True}}, "spec.parallelism"),
    ({"distillation": {"teacher": "s3://models/teacher"}}, "spec.distillation"),
    ({"checkpoint": {"uri": "s3://checkpoints/demo", "everySteps": 100}}, "everySteps"),
    ({"checkpoint": {"uri": "s3://checkpoints/demo", "async": True}}, "everySteps"),
])
def test_typed_training_fields_are_refused_with_own_code_by_server_and_models(
        minimal_manifest: dict[str, Any], change: dict[str, Any], named: str) -> None:
    document = _own_code(minimal_manifest)
    document["spec"].update(change)
    failed = cel_violations(document)
    assert len(failed) == 1 and named in failed[0], failed
    assert "kubetrain's trainer" in failed[0]  # the why
    assert not _models_accept(document)


@pytest.mark.parametrize("change", [
    {"model": {"preset": "llama-125m", "normEps": 1e-05}},  # written at their defaults
    {"optimization": {"betas": [0.9, 0.95], "minLrRatio": 0.1}},
    {"checkpoint": {"uri": "s3://checkpoints/demo", "keepLast": 1,
                    "resumeFrom": "s3://checkpoints/other"}},
    {"workers": {"replicas": 2, "minReplicas": 1, "maxReplicas": 4, "procsPerWorker": 8}},
    {"runPolicy": {"maxRestarts": 2, "suspend": True}, "metrics": {"port": 9500}},
])
def test_fields_of_both_kinds_are_accepted_with_own_code(
        minimal_manifest: dict[str, Any], change: dict[str, Any]) -> None:
    document = _own_code(minimal_manifest)
    document["spec"].update(change)
    assert cel_violations(document) == []
    assert _models_accept(document)


def test_a_job_with_neither_kind_is_refused_naming_both(
        minimal_manifest: dict[str, Any]) -> None:
    document = copy.deepcopy(minimal_manifest)
    del document["spec"]["data"]
    (failed,) = cel_violations(document)
    assert "spec.data" in failed and "spec.trainer" in failed
    with pytest.raises(InvalidManifest) as refused:
        parse_job(document)
    assert "spec.data: is required" in str(refused.value) and "spec.trainer" in str(refused.value)
    del document["spec"]["image"], document["spec"]["model"]
    document["spec"]["trainer"] = {"image": "me/train:1", "command": ["train"]}
    assert cel_violations(document) == [] and _models_accept(document)  # own code needs no image
