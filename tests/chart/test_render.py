"""The chart renders, lints and validates for every documented variant, and says what is wrong."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml

from kubetrain.operator import command
from kubetrain.version import package_version

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "charts" / "kubetrain"
RELEASE_NAMESPACE = "kubetrain-system"
Render = Callable[[dict[str, Any]], list[dict[str, Any]]]


def _chart_yaml() -> dict[str, Any]:
    return yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())


def _lowest_kubernetes_version() -> str:
    """The lowest version the chart's kubeVersion (">=X.Y.Z-0") admits."""
    constraint = _chart_yaml()["kubeVersion"]
    assert constraint.startswith(">="), f"kubeVersion {constraint!r} should be a lower bound"
    return constraint.removeprefix(">=").removesuffix("-0")


KUBERNETES_VERSIONS = [_lowest_kubernetes_version(), kubernetes_validate.latest_version()]


def test_chart_and_default_images_follow_the_package_version(render: Render) -> None:
    chart = _chart_yaml()
    version = package_version()
    assert chart["version"] == version
    assert chart["appVersion"] == version
    deployment = next(o for o in render({}) if o["kind"] == "Deployment")
    image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == f"ghcr.io/kubetrain/operator:{version}"


def test_chart_lints_cleanly_for_every_variant(
    variant: str, variants: dict[str, dict[str, Any]]
) -> None:
    for kube_version in KUBERNETES_VERSIONS:
        report = helm_python.lint(CHART_DIR, variants[variant], strict=True,
                                  namespace=RELEASE_NAMESPACE, kube_version=f"v{kube_version}")
        problems = [m for m in report["messages"] if m["severity"] >= 2]
        assert not problems and not report["errors"], (kube_version, problems, report["errors"])


@pytest.fixture(scope="module")
def crd_documents(chart: Any) -> list[dict[str, Any]]:
    """The documents of the chart's crds/ folder, parsed once for the module (the
    TrainingJob CRD's YAML takes 0.3 s to parse). Read only: tests must not change them."""
    return [document for crd in chart.crds for document in yaml.safe_load_all(crd["data"])]


@pytest.fixture(scope="module")
def crd_schemas(crd_documents: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> openAPIV3Schema of every custom resource the chart defines."""
    schemas = {}
    for document in crd_documents:
        spec = document["spec"]
        for version in spec["versions"]:
            api_version = f"{spec['group']}/{version['name']}"
            schemas[(api_version, spec["names"]["kind"])] = version["schema"]["openAPIV3Schema"]
    return schemas


@pytest.mark.parametrize("kube_version", KUBERNETES_VERSIONS)
def test_every_rendered_object_matches_the_kubernetes_schema(
    crd_schemas: dict[tuple[str, str], dict[str, Any]], rendered: list[dict[str, Any]],
    kube_version: str
) -> None:
    checked = 0
    for obj in rendered:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # prometheus-operator kinds: checked field by field in test_monitoring.py
        schema = crd_schemas.get((obj["apiVersion"], obj["kind"]))
        if schema is not None:
            jsonschema.validate(obj, schema)  # a kind this chart's own CRDs define
        else:
            kubernetes_validate.validate(obj, kube_version, strict=True)
        checked += 1
    assert checked >= 8, "the chart should render its core objects in every variant"


@pytest.mark.parametrize("kube_version", KUBERNETES_VERSIONS)
def test_chart_crds_match_the_kubernetes_schema(
    chart: Any, crd_documents: list[dict[str, Any]], kube_version: str
) -> None:
    assert chart.crds, "charts/kubetrain/crds/ should hold the TrainingJob CRD"
    for document in crd_documents:
        kubernetes_validate.validate(document, kube_version, strict=True)


def test_chart_crd_is_identical_to_the_generated_crd() -> None:
    generated = REPO / "crds" / "trainingjob.yaml"
    packaged = CHART_DIR / "crds" / "trainingjob.yaml"
    assert packaged.read_bytes() == generated.read_bytes(), (
        f"{packaged} differs from {generated}: regenerate both with `kubetrain crd`"
    )


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"rbac": {"mode": "everywhere"}}, "/rbac/mode"),
        ({"rbac": {"mode": "namespaced"}}, "namespaces"),
        ({"rbac": {"mode": "namespaced", "namespaces": []}}, "/rbac/namespaces"),
        ({"replicas": "two"}, "/replicas"),
        ({"image": {"repository": "x", "digest": "latest"}}, "/image/digest"),
        ({"networkPolicy": {"rendezvousPort": 70000}}, "/networkPolicy/rendezvousPort"),
        ({"monitoring": {"serviceMonitor": {"enable": True}}}, "enable"),
    ],
)
def test_a_wrong_value_fails_with_a_message_naming_it(
    render: Render, values: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm_python.HelmError) as failure:
        render(values)
    assert message in str(failure.value)


def test_namespaced_mode_grants_and_watches_only_the_listed_namespaces(
    render: Render, variants: dict[str, dict[str, Any]]
) -> None:
    namespaces = variants["namespaced"]["rbac"]["namespaces"]
    objects = render(variants["namespaced"])
    # Cluster-wide, the operator may only read cluster-scoped objects (nodes, and Kueue's
    # ResourceFlavors).
    (operator_cluster_role,) = [o for o in objects if o["kind"] == "ClusterRole"
                                and o["metadata"]["name"].endswith("-operator")]
    cluster_scoped = {("", "nodes"), ("kueue.x-k8s.io", "resourceflavors")}
    for rule in operator_cluster_role["rules"]:
        assert {(group, resource) for group in rule["apiGroups"]
                for resource in rule["resources"]} <= cluster_scoped, rule
        assert set(rule["verbs"]) <= {"get", "list", "watch"}
    for kind in ("Role", "RoleBinding"):
        assert sorted(o["metadata"]["namespace"] for o in objects if o["kind"] == kind) == sorted(
            namespaces)
    policies = {o["metadata"]["namespace"] for o in objects if o["kind"] == "NetworkPolicy"
                and o["metadata"]["name"].endswith("-workers")}
    assert policies == set(namespaces)
    args = next(o for o in objects if o["kind"] == "Deployment")[
        "spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a.split("=", 1)[1] for a in args if a.startswith("--namespace=")] == namespaces


def test_cluster_mode_watches_every_namespace(render: Render) -> None:
    objects = render({})
    args = next(o for o in objects if o["kind"] == "Deployment")[
        "spec"]["template"]["spec"]["containers"][0]["args"]
    assert not [a for a in args if a.startswith("--namespace")]
    assert {o["kind"] for o in objects} >= {"ClusterRole", "ClusterRoleBinding"}


def test_operator_pod_is_locked_down_and_probed_on_its_health_endpoint(
    rendered: list[dict[str, Any]],
) -> None:
    pod = next(o for o in rendered if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert f"--health-port={ports['health']}" in container["args"]
    assert f"--metrics-port={ports['metrics']}" in container["args"]


def test_operator_args_are_options_of_kubetrain_operator(
    rendered: list[dict[str, Any]],
) -> None:
    """The Deployment passes only options `kubetrain operator` accepts (its image's entrypoint)."""
    (container,) = next(o for o in rendered if o["kind"] == "Deployment")[
        "spec"]["template"]["spec"]["containers"]
    parser = argparse.ArgumentParser(prog="kubetrain operator", exit_on_error=False)
    command.add_arguments(parser)
    unknown = parser.parse_known_args(container["args"])[1]
    assert unknown == [], f"kubetrain operator does not accept {unknown}"


def test_custom_images_are_used_by_digest_with_pull_secrets(
    render: Render, variants: dict[str, dict[str, Any]]
) -> None:
    values = variants["custom-images"]
    pod = next(o for o in render(values) if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    image = values["image"]
    assert pod["containers"][0]["image"] == f"{image['repository']}@{image['digest']}"
    assert pod["imagePullSecrets"] == values["imagePullSecrets"]


def test_aggregated_roles_extend_the_builtin_user_roles(render: Render) -> None:
    roles = {o["metadata"]["name"]: o for o in render({}) if o["kind"] == "ClusterRole"}
    edit, view = roles["kubetrain-edit"], roles["kubetrain-view"]
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    view_verbs = {v for rule in view["rules"] for v in rule["verbs"]}
    assert view_verbs == {"get", "list", "watch"}
    edit_grants = {(r, v) for rule in edit["rules"] for r in rule["resources"]
                   for v in rule["verbs"]}
    assert {("trainingjobs", "create"), ("trainingjobs/scale", "patch")} <= edit_grants


def test_notes_tell_the_user_what_to_do_next(chart: Any) -> None:
    notes = chart.render({}, name="kubetrain", namespace=RELEASE_NAMESPACE)[
        "kubetrain/templates/NOTES.txt"]
    assert "kubectl get tj" in notes
    assert f"ghcr.io/kubetrain/trainer:{package_version()}" in notes
    for doc in ("docs/monitoring.md", "docs/troubleshooting.md"):
        assert doc in notes
        assert (REPO / doc).exists(), f"NOTES.txt points at {doc}, which does not exist"


def test_every_values_key_is_documented() -> None:
    """Each leaf of values.yaml appears, by its dotted path, in docs/install.md."""
    install = (REPO / "docs" / "install.md").read_text()
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())

    def leaves(node: Any, prefix: str) -> list[str]:
        if isinstance(node, dict) and node:
            return [leaf for key, child in node.items()
                    for leaf in leaves(child, f"{prefix}{key}.")]
        return [prefix.rstrip(".")]

    missing = [path for path in leaves(values, "") if f"`{path}`" not in install]
    assert not missing, f"values not documented in docs/install.md: {missing}"


def test_docs_exist_for_every_topic() -> None:
    docs = REPO / "docs"
    for page in ("install.md", "upgrade.md", "uninstall.md", "rbac.md", "monitoring.md",
                 "troubleshooting.md", "gitops.md", "images.md", "scheduling.md"):
        assert (docs / page).stat().st_size > 500, f"docs/{page} is missing or empty"
