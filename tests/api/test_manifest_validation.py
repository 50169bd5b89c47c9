"""Manifests: valid ones load with sensible defaults; every invalid one names its field."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kubetrain.api import InvalidManifest, load_job, parse_job
from kubetrain.api.manifest import load_documents
from kubetrain.validate import check_document, schema_problems

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def test_minimal_manifest_gets_working_defaults(minimal_manifest: dict[str, Any]) -> None:
    job = parse_job(minimal_manifest)
    spec = job.spec
    assert spec.workers.replicas == 1 and spec.workers.min_workers == 1
    assert spec.parallelism.strategy == "fsdp" and spec.parallelism.precision == "bf16"
    max_steps = spec.optimization.steps_for(tokens_per_epoch=0, seq_len=1, world_size=1)
    assert spec.learning_rate > 0 and 0 <= spec.warmup_steps(max_steps) < max_steps
    assert spec.model.resolve().dim > 0
    assert job.wire()["spec"]["checkpoint"]["async"] is False  # the Python keyword's alias


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid_for_the_models_and_the_crd_schema(path: Path) -> None:
    job = load_job(path)
    document = job.model_dump(by_alias=True, exclude_none=True, mode="json")
    assert list(schema_problems(document)) == []
    raw = next(d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == "TrainingJob")
    assert list(schema_problems(raw)) == []


def test_global_batch_tokens_sets_gradient_accumulation(minimal_manifest: dict[str, Any]) -> None:
    minimal_manifest["spec"]["data"]["seqLen"] = 128
    minimal_manifest["spec"]["optimization"] = {"microBatchSize": 4, "globalBatchTokens": 4096}
    spec = parse_job(minimal_manifest).spec
    assert spec.gradient_accumulation(world_size=2) == 4096 // (4 * 128 * 2)
    assert spec.gradient_accumulation(world_size=8) == 1


def test_epochs_become_steps_from_the_data_and_the_global_batch_tokens(
        minimal_manifest: dict[str, Any]) -> None:
    minimal_manifest["spec"]["data"]["seqLen"] = 128
    minimal_manifest["spec"]["optimization"] = {
        "epochs": 2.5, "microBatchSize": 4, "globalBatchTokens": 4096, "warmupSteps": 0}
    opt = parse_job(minimal_manifest).spec.optimization
    tokens_per_epoch = 100 * 4096 + 1  # a token more than 100 steps' worth
    steps = {world: opt.steps_for(tokens_per_epoch=tokens_per_epoch, seq_len=128,
                                  world_size=world) for world in (1, 2, 8)}
    # 250 steps and a little: the part step counts, and the world size plays no part.
    assert set(steps.values()) == {251}


def test_epochs_without_global_batch_tokens_count_every_process(
        minimal_manifest: dict[str, Any]) -> None:
    minimal_manifest["spec"]["data"]["seqLen"] = 128
    minimal_manifest["spec"]["optimization"] = {
        "epochs": 1, "microBatchSize": 4, "gradientAccumulationSteps": 2, "warmupSteps": 0}
    opt = parse_job(minimal_manifest).spec.optimization
    tokens_per_epoch = 4 * 128 * 2 * 40
    assert opt.steps_for(tokens_per_epoch=tokens_per_epoch, seq_len=128, world_size=1) == 40
    assert opt.steps_for(tokens_per_epoch=tokens_per_epoch, seq_len=128, world_size=4) == 10


def test_max_steps_and_epochs_are_exclusive_and_warmup_is_checked_against_epochs(
        minimal_manifest: dict[str, Any]) -> None:
    minimal_manifest["spec"]["optimization"] = {"epochs": 3, "maxSteps": 100}
    with pytest.raises(InvalidManifest, match=r"spec\.optimization\.epochs.*not both"):
        parse_job(minimal_manifest)
    minimal_manifest["spec"]["optimization"] = {"epochs": 1, "warmupSteps": 50}
    spec = parse_job(minimal_manifest).spec  # the steps are not known before the data is read
    with pytest.raises(ValueError, match=r"warmupSteps.*\(50, warmupSteps\).*20 steps.*epochs"):
        spec.check_warmup(20)
    spec.check_warmup(51)


# --- invalid manifests -----------------------------------------------------------------

def _set(document: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    node = document
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def _delete(document: dict[str, Any], path: str) -> None:
    *parents, leaf = path.split(".")
    node = document
    for part in parents:
        node = node[part]
    del node[leaf]


# (field path, a value of the wrong type)
WRONG_TYPES = [
    ("spec.workers.replicas", "four"), ("spec.workers.procsPerWorker", [1]),
    ("spec.optimization.maxSteps", "many"), ("spec.optimization.learningRate", "fast"),
    ("spec.parallelism.compile", {"yes": 1}), ("spec.data.seqLen", 1.5),
    ("spec.checkpoint.everySteps", "often"), ("spec.metrics.port", "http"),
    ("spec.runPolicy.suspend", "maybe"), ("spec.workers.template.nodeSelector", ["gpu"]),
    ("spec.image", 42), ("spec.data.train", ["a", "b"]),
]
# (field path, an out-of-range value)
OUT_OF_RANGE = [
    ("spec.workers.replicas", 0), ("spec.workers.procsPerWorker", -1),
    ("spec.optimization.maxSteps", 0), ("spec.optimization.learningRate", -1.0),
    ("spec.optimization.minLrRatio", 1.5), ("spec.data.seqLen", 2),
    ("spec.metrics.port", 80), ("spec.checkpoint.keepLast", 0),
    ("spec.runPolicy.maxRestarts", -3), ("spec.optimization.weightDecay", -0.1),
]
ENUMS = [
    ("spec.parallelism.strategy", "zero3"), ("spec.parallelism.precision", "int4"),
    ("spec.parallelism.activationCheckpointing", "some"), ("spec.model.preset", "gpt-5"),
    ("spec.optimization.schedule", "exponential"), ("spec.runPolicy.cleanPodPolicy", "Some"),
]
REQUIRED = ["spec.image", "spec.data", "spec.data.train", "spec.checkpoint",
            "spec.checkpoint.uri", "metadata.name"]
SECTIONS = ["spec", "spec.workers", "spec.model", "spec.data", "spec.optimization",
            "spec.parallelism", "spec.checkpoint", "spec.runPolicy", "spec.metrics"]
INLINE_CREDENTIALS = [
    ("spec.storage.accessKeyId", "AKIA..."), ("spec.storage.secretAccessKey", "s3cr3t"),
    ("spec.storage.sessionToken", "tok"), ("spec.storage.password", "hunter2"),
]


def mutations() -> st.SearchStrategy[tuple[str, str, Any]]:
    """(kind, field path that must be named, value) for one invalid change."""
    unknown = st.tuples(st.sampled_from(SECTIONS),
                        st.from_regex(r"[a-z][A-Za-z]{2,12}", fullmatch=True)).map(
        lambda t: ("unknown", f"{t[0]}.x{t[1]}", 1))
    return st.one_of(
        st.sampled_from(WRONG_TYPES).map(lambda t: ("set", *t)),
        st.sampled_from(OUT_OF_RANGE).map(lambda t: ("set", *t)),
        st.sampled_from(ENUMS).map(lambda t: ("set", *t)),
        st.sampled_from(REQUIRED).map(lambda p: ("delete", p, None)),
        st.sampled_from(INLINE_CREDENTIALS).map(lambda t: ("set", *t)),
        unknown.map(lambda t: ("set", t[1], t[2])),
        st.tuples(st.integers(2, 50), st.integers(1, 49)).filter(lambda t: t[0] > t[1]).map(
            lambda t: ("set", "spec.workers", {"replicas": t[1], "minReplicas": t[0],
                                               "maxReplicas": t[0]})),
        st.just(("set", "spec.checkpoint.exportFrom", "best")),  # without keepBest
        st.tuples(st.integers(1, 10**6), st.floats(0.01, 100)).map(
            lambda t: ("set", "spec.optimization", {"maxSteps": t[0], "epochs": t[1]})),
    )


# The field a whole-section mutation of mutations() must be refused at.
SECTION_PROBLEMS = {"spec.workers": "spec.workers.minReplicas",
                    "spec.optimization": "spec.optimization.epochs"}


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # copied, never mutated
@given(mutation=mutations())
def test_every_invalid_manifest_is_rejected_naming_its_field(
    minimal_manifest: dict[str, Any], mutation: tuple[str, str, Any]
) -> None:
    kind, path, value = mutation
    document = copy.deepcopy(minimal_manifest)
    if kind == "delete":
        _delete(document, path)
    else:
        _set(document, path, value)

    with pytest.raises(InvalidManifest) as raised:
        parse_job(document)
    named = [str(p) for p in raised.value.problems]
    expected = SECTION_PROBLEMS.get(path, path) if isinstance(value, dict) else path
    assert any(expected in problem for problem in named), (expected, named)
    # The CLI's full check (models and CRD schema) reports it too, without raising.
    assert check_document(document)


def test_inline_credentials_are_refused_with_a_pointer_to_secrets(
    minimal_manifest: dict[str, Any],
) -> None:
    minimal_manifest["spec"]["storage"] = {"secretAccessKey": "wJalrXUtnFEMI"}
    with pytest.raises(InvalidManifest) as raised:
        parse_job(minimal_manifest)
    message = str(raised.value)
    assert "spec.storage.secretAccessKey" in message and "credentialsSecret" in message
    assert "wJalrXUtnFEMI" not in message  # the value itself is never echoed


def test_credential_env_vars_must_come_from_secrets(minimal_manifest: dict[str, Any]) -> None:
    env = [{"name": "AWS_SECRET_ACCESS_KEY", "value": "wJalrXUtnFEMI"}]
    minimal_manifest["spec"]["workers"] = {"template": {"env": env}}
    with pytest.raises(InvalidManifest) as raised:
        parse_job(minimal_manifest)
    assert "spec.workers.template.env[0].value" in str(raised.value)
    assert "wJalrXUtnFEMI" not in str(raised.value)
    env[0] = {"name": "AWS_SECRET_ACCESS_KEY",
              "valueFrom": {"secretKeyRef": {"name": "s3", "key": "secret"}}}
    parse_job(minimal_manifest)


@settings(max_examples=200, deadline=None)
@given(document=st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(
        st.sampled_from(["spec", "workers", "replicas", "image", "data", "train", "metadata",
                         "name", "kind", "apiVersion", "model", "checkpoint", "uri"]),
        children, max_size=4),
    max_leaves=20))
def test_arbitrary_documents_never_raise_anything_but_invalid_manifest(document: Any) -> None:
    try:
        parse_job(document)
    except InvalidManifest as invalid:
        assert invalid.problems
    check_document(document)


def test_min_greater_than_max_reads_like_a_sentence(minimal_manifest: dict[str, Any]) -> None:
    minimal_manifest["spec"]["workers"] = {"replicas": 2, "minReplicas": 4, "maxReplicas": 2}
    with pytest.raises(InvalidManifest) as raised:
        parse_job(minimal_manifest)
    assert "spec.workers.minReplicas (4) is greater than maxReplicas (2)" in str(raised.value)


def test_exponent_floats_read_as_numbers_as_kubernetes_reads_them(
        tmp_path: Path, minimal_manifest: dict[str, Any]) -> None:
    # PyYAML alone reads `3e-4` as a string; kubectl prints small floats that way too.
    text = yaml.safe_dump(minimal_manifest) + "  optimization: {learningRate: 3e-4}\n" \
        + "  model: {preset: tiny, normEps: 1e-05}\n"
    text = text.replace("  model:\n    preset: tiny\n", "")
    path = tmp_path / "job.yaml"
    path.write_text(text)
    (document,) = load_documents(path)
    assert document["spec"]["optimization"]["learningRate"] == 3e-4
    assert check_document(document) == []
    assert load_job(path).spec.model.norm_eps == 1e-05
