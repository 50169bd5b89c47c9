"""The TrainingJob CRD as a real kube-apiserver sees it: schema, CEL, defaults, immutability.

`kubetrain validate` checks manifests with the API models and the CRD's schema; the
API server checks them with the schema and the CEL rules. Here both judge the same
hypothesis-generated invalid manifests (the generator of
tests/api/test_manifest_validation.py) and must agree: the server refuses every one,
its message naming the field. A manifest only the models can refuse would reach the
operator, which marks its job Failed with reason InvalidSpec (shown against the
emulator in tests/operator); none is left in the generated set, and
`MODELS_ONLY` would list any that appear, with the reason.
"""

from __future__ import annotations

import copy
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from kubernetes import client

from kubetrain.api import parse_job
from kubetrain.validate import check_document

sys.path.insert(0, str(Path(__file__).parents[1] / "api"))
from test_manifest_validation import SECTION_PROBLEMS, _delete, _set, mutations

pytestmark = pytest.mark.real_server

REPO = Path(__file__).resolve().parents[2]
GROUP, VERSION, PLURAL = "kubetrain.io", "v1alpha1", "trainingjobs"
NAMESPACE = "crd-checks"  # no operator watches it in this module's tests
# (field path, why the server cannot refuse it). Empty: every generated invalid manifest
# is refused by the server too.
MODELS_ONLY: dict[str, str] = {}
# Each field a CEL rule makes immutable, and another valid value for it.
IMMUTABLE_CHANGES = {
    "spec.workers.procsPerWorker": 2,
    "spec.data.seqLen": 256,
    "spec.parallelism.strategy": "ddp",
    "spec.checkpoint.uri": "s3://checkpoints/elsewhere",
    "spec.model": {"preset": "llama-125m"},
}

agreement: Counter[str] = Counter()


@pytest.fixture(scope="module")
def jobs(control_plane: Any) -> client.CustomObjectsApi:
    control_plane.kubectl("create", "namespace", NAMESPACE, check=False)
    return client.CustomObjectsApi(control_plane.api_client())


def server_refusal(jobs: client.CustomObjectsApi, document: dict[str, Any]) -> str | None:
    """The server's message if it refuses to create `document` (dry run, strict fields)."""
    try:
        jobs.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, document,
                                             dry_run="All", field_validation="Strict")
    except client.ApiException as error:
        assert error.status in (400, 422), error.body
        return str(json.loads(error.body)["message"])
    return None


def test_crd_applies_server_side_and_is_established_without_warnings(
        control_plane: Any) -> None:
    # The server refuses a CRD whose CEL rules exceed the cost budget, so being
    # Established also means every rule is within it.
    applied = control_plane.kubectl("apply", "--server-side", "-f",
                                    str(REPO / "crds" / "trainingjob.yaml"))
    assert "Warning" not in applied.stderr, applied.stderr
    crd = json.loads(control_plane.kubectl(
        "get", "crd", "trainingjobs.kubetrain.io", "-o", "json").stdout)
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions["Established"] == "True" and conditions["NamesAccepted"] == "True"
    assert conditions.get("NonStructuralSchema") is None
    assert crd["status"]["acceptedNames"]["shortNames"] == ["tj"]


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # copied, never mutated
@given(mutation=mutations())
def test_the_server_refuses_every_invalid_manifest_the_models_refuse(
        jobs: client.CustomObjectsApi, minimal_manifest: dict[str, Any],
        mutation: tuple[str, str, Any]) -> None:
    kind, path, value = mutation
    document = copy.deepcopy(minimal_manifest)
    document["metadata"]["namespace"] = NAMESPACE
    _delete(document, path) if kind == "delete" else _set(document, path, value)
    named = SECTION_PROBLEMS.get(path, path) if isinstance(value, dict) else path

    models = [str(problem) for problem in check_document(document)]
    message = server_refusal(jobs, document)
    assert models, f"the models accept {path}={value!r}"
    if message is None:
        agreement["models only"] += 1
        assert path in MODELS_ONLY, f"the server accepts {path}={value!r}; the models say {models}"
    else:
        agreement["both refuse"] += 1
        assert named in message, f"the server's message does not name {named}: {message}"


def test_agreement_figures(control_plane: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """Prints what the previous test measured (it runs first: tests run in file order)."""
    total = sum(agreement.values())
    with capsys.disabled():
        print(f"\ninvalid manifests sent to the API server and to the models: {total}; "
              f"refused by both: {agreement['both refuse']}; "
              f"by the models only: {agreement['models only']} (listed: {sorted(MODELS_ONLY)})")
    assert total >= 300


def _immutable_fields(schema: dict[str, Any], path: str = "spec") -> set[str]:
    """Field paths whose CEL rules compare with oldSelf (transition rules)."""
    found = set()
    for rule in schema.get("x-kubernetes-validations", []):
        if "oldSelf" in rule["rule"]:
            field = rule["rule"].split("==")[0].strip().removeprefix("self.")
            found.add(path if field == "self" else f"{path}.{field}")
    for name, child in schema.get("properties", {}).items():
        found |= _immutable_fields(child, f"{path}.{name}")
    return found


def test_fields_that_must_not_change_are_refused_on_update(
        jobs: client.CustomObjectsApi, minimal_manifest: dict[str, Any]) -> None:
    crd = yaml.safe_load((REPO / "crds" / "trainingjob.yaml").read_text())
    spec_schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert _immutable_fields(spec_schema) == set(IMMUTABLE_CHANGES)

    manifest = copy.deepcopy(minimal_manifest)
    manifest["metadata"].update(name="immutable", namespace=NAMESPACE)
    jobs.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, manifest)
    for path, value in IMMUTABLE_CHANGES.items():
        patch: dict[str, Any] = {}
        _set(patch, path, value)
        with pytest.raises(client.ApiException) as refused:
            jobs.patch_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, "immutable",
                                                patch)
        assert refused.value.status == 422
        assert path.rsplit(".", 1)[0] in json.loads(refused.value.body)["message"], path
    # A mutable field still changes.
    jobs.patch_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, "immutable",
                                        {"spec": {"optimization": {"learningRate": 0.001}}})


def _leaves(node: Any, path: str = "") -> dict[str, Any]:
    if not isinstance(node, dict):
        return {path: node}
    leaves: dict[str, Any] = {}
    for key, value in node.items():
        leaves |= _leaves(value, f"{path}.{key}" if path else key)
    return leaves


def test_server_side_defaults_equal_the_models_defaults(
        jobs: client.CustomObjectsApi, minimal_manifest: dict[str, Any]) -> None:
    manifest = copy.deepcopy(minimal_manifest)
    manifest["metadata"].update(name="defaults", namespace=NAMESPACE)
    stored = jobs.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, manifest)
    server = _leaves(stored["spec"])
    models = _leaves(parse_job(manifest).wire()["spec"])
    defaulted = set(server) - set(_leaves(manifest["spec"]))
    # Every section the manifest left out was filled in, down to its fields.
    sections = {path.split(".")[0] for path in defaulted}
    assert sections >= {"workers", "model", "optimization", "evaluation", "parallelism",
                        "checkpoint", "data", "metrics", "runPolicy"}, sections
    differing = {path: (server[path], models.get(path)) for path in defaulted
                 if server[path] != models.get(path)}
    assert not differing, f"server default != model default: {differing}"
