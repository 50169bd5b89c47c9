"""Alerts, dashboard and scrape targets agree with what kubetrain really exports.

The metric names are never listed here: they come from the trainer's and the
operator's own registries, rendered by prometheus_client and parsed back.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml
from host_tools import require_tool
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kubetrain.api.manifest import parse_job
from kubetrain.operator.children import JOB_LABEL, RENDEZVOUS_PORT, worker_pod
from kubetrain.pod_conventions import LIGHTHOUSE_PORT

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "charts" / "kubetrain" / "dashboards" / "kubetrain.json"
Render = Callable[[dict[str, Any]], list[dict[str, Any]]]

# Sample names each metric type exposes besides its family name (OpenMetrics rules).
_SAMPLE_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "gauge": ("",),
}
# Grafana's variables, replaced by values a Prometheus server would see.
_GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$namespace": ".*", "$trainingjob": ".*"}


def _trainer_registry() -> CollectorRegistry:
    from kubetrain.trainer.metrics import REGISTRY

    return REGISTRY


def _operator_registry() -> CollectorRegistry:
    from kubetrain.operator.metrics import OperatorMetrics

    return OperatorMetrics().registry


def _exported_names(registry: CollectorRegistry) -> set[str]:
    """Every sample name the registry puts on /metrics."""
    names: set[str] = set()
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        # Families with no sample yet (labelled metrics before first use) still expose
        # their names; derive the sample names their type implies.
        suffixes = _SAMPLE_SUFFIXES.get(family.type, ("",))
        names.update(family.name + suffix for suffix in suffixes)
        names.update(sample.name for sample in family.samples)
    return names


@pytest.fixture(scope="module")
def exported_metrics() -> set[str]:
    """The sample names the trainer and the operator export, from their real exposition."""
    return _exported_names(_trainer_registry()) | _exported_names(_operator_registry())


def _metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects, from Prometheus' own grammar."""
    for variable, value in _GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def _dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            # label_values(SELECTOR, label) queries the series of SELECTOR.
            query = variable["query"]["query"]
            queries.append(query.removeprefix("label_values(").rsplit(",", 1)[0])
    return queries


def _alert_rules(render: Render) -> dict[str, Any]:
    """The PrometheusRule's spec: a Prometheus rule file."""
    objects = render({"monitoring": {"prometheusRule": {"enabled": True}}})
    (rule,) = [o for o in objects if o["kind"] == "PrometheusRule"]
    return dict(rule["spec"])


def test_dashboard_is_valid_grafana_dashboard_json() -> None:
    """Decoding with Grafana's own dashboard models keeps every field we wrote."""
    from grafana_foundation_sdk.cog import plugins
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import Dashboard

    plugins.register_default_plugins()
    written = json.loads(DASHBOARD.read_text())
    decoded = json.loads(json.dumps(Dashboard.from_json(written), cls=JSONEncoder))

    def dropped(ours: Any, theirs: Any, path: str) -> list[str]:
        if isinstance(ours, dict):
            return [p for key, value in ours.items() for p in (
                dropped(value, theirs[key], f"{path}.{key}") if key in theirs else [
                    f"{path}.{key}"])]
        if isinstance(ours, list):
            assert len(ours) == len(theirs), path
            return [p for i, (a, b) in enumerate(zip(ours, theirs, strict=True))
                    for p in dropped(a, b, f"{path}[{i}]")]
        return [] if ours == theirs else [f"{path} ({ours!r} became {theirs!r})"]

    assert not dropped(written, decoded, "dashboard"), "fields Grafana's schema does not know"
    ids = [panel["id"] for panel in written["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"


def test_dashboard_covers_loss_lr_throughput_mfu_restarts_checkpoint_age_per_job() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    titles = {panel["title"] for panel in dashboard["panels"]}
    assert {"Loss", "Learning rate", "Tokens per second", "MFU", "Restarts",
            "Checkpoint age"} <= titles
    assert "trainingjob" in {v["name"] for v in dashboard["templating"]["list"]}


def test_dashboard_and_alerts_query_only_exported_metrics(
    render: Render, exported_metrics: set[str]
) -> None:
    rules = _alert_rules(render)
    queries = _dashboard_queries() + [r["expr"] for g in rules["groups"] for r in g["rules"]]
    unknown = {name for query in queries for name in _metric_names(query)} - exported_metrics
    assert not unknown, f"queried but exported by neither trainer nor operator: {sorted(unknown)}"


def test_dashboard_configmap_carries_the_dashboard(render: Render) -> None:
    objects = render({"monitoring": {"dashboard": {"enabled": True}}})
    (config_map,) = [o for o in objects if o["kind"] == "ConfigMap"]
    assert json.loads(config_map["data"]["kubetrain.json"]) == json.loads(DASHBOARD.read_text())
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"


# Input series for each alert: the jobs that must fire and one that must not.
# promtool evaluates each alert's own expression (from the rendered chart) on them.
_ALERT_SCENARIOS: dict[str, dict[str, Any]] = {
    "KubetrainLossNaN": {
        "interval": "1m", "eval_time": "2m", "by": "trainingjob",
        "series": {
            'kubetrain_loss{trainingjob="nan"}': "2.5 NaN NaN",
            'kubetrain_loss{trainingjob="inf"}': "2.5 +Inf +Inf",
            'kubetrain_loss{trainingjob="healthy"}': "2.5 2.4 2.3",
        },
        "firing": ["nan", "inf"],
    },
    "KubetrainJobStalled": {
        "interval": "5m", "eval_time": "60m", "by": "trainingjob",
        "series": {
            'kubetrain_last_step_timestamp_seconds{trainingjob="stalled"}': "0x12",
            'kubetrain_step{trainingjob="stalled"}': "100x12",
            'kubetrain_max_steps{trainingjob="stalled"}': "1000x12",
            'kubetrain_last_step_timestamp_seconds{trainingjob="training"}': "0+300x12",
            'kubetrain_step{trainingjob="training"}': "100+50x12",
            'kubetrain_max_steps{trainingjob="training"}': "1000x12",
            'kubetrain_last_step_timestamp_seconds{trainingjob="finished"}': "0x12",
            'kubetrain_step{trainingjob="finished"}': "1000x12",
            'kubetrain_max_steps{trainingjob="finished"}': "1000x12",
        },
        "firing": ["stalled"],
    },
    "KubetrainLowGoodput": {
        # Sampled every 5m for 40m: below the threshold for the whole 30m of `for`.
        "interval": "5m", "eval_time": "40m", "by": "trainingjob",
        "series": {
            'kubetrain_goodput_ratio{trainingjob="wasteful"}': "0.3x8",
            'kubetrain_step{trainingjob="wasteful"}': "100+10x8",
            'kubetrain_max_steps{trainingjob="wasteful"}': "1000x8",
            # Dipped below for 15 minutes only, then recovered.
            'kubetrain_goodput_ratio{trainingjob="recovered"}': "0.3 0.3 0.3 0.9x5",
            'kubetrain_step{trainingjob="recovered"}': "100+10x8",
            'kubetrain_max_steps{trainingjob="recovered"}': "1000x8",
            # Finished: its low goodput no longer concerns anyone running it.
            'kubetrain_goodput_ratio{trainingjob="finished"}': "0.3x8",
            'kubetrain_step{trainingjob="finished"}': "1000x8",
            'kubetrain_max_steps{trainingjob="finished"}': "1000x8",
            'kubetrain_goodput_ratio{trainingjob="healthy"}': "0.95x8",
            'kubetrain_step{trainingjob="healthy"}': "100+10x8",
            'kubetrain_max_steps{trainingjob="healthy"}': "1000x8",
        },
        "firing": ["wasteful"],
    },
    "KubetrainRestartsRising": {
        "interval": "1m", "eval_time": "60m", "by": "reason",
        "series": {
            'kubetrain_operator_group_restarts_total{reason="PodFailed"}': "0+1x60",
            'kubetrain_operator_group_restarts_total{reason="NodeLost"}': "0x60",
        },
        "firing": ["PodFailed"],
    },
    "KubetrainJobFailed": {
        "interval": "1m", "eval_time": "5m", "by": "phase",
        "series": {
            'kubetrain_operator_jobs{phase="Failed"}': "0 0 0 1 1 1",
            'kubetrain_operator_jobs{phase="Running"}': "3 3 3 2 2 2",
        },
        "firing": ["Failed"],
    },
}


def _promtool_unit_test(rules: dict[str, Any]) -> dict[str, Any]:
    tests = []
    for rule in (r for group in rules["groups"] for r in group["rules"]):
        scenario = _ALERT_SCENARIOS[rule["alert"]]
        by = scenario["by"]
        tests.append({
            "interval": scenario["interval"],
            "input_series": [{"series": s, "values": v} for s, v in scenario["series"].items()],
            "promql_expr_test": [{
                "expr": f"count by ({by}) ({rule['expr']})",
                "eval_time": scenario["eval_time"],
                "exp_samples": [{"labels": f'{{{by}="{value}"}}', "value": 1}
                                for value in scenario["firing"]],
            }],
        })
    return {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests}


def test_alert_rules_pass_promtool_and_fire_only_on_the_broken_jobs(
    render: Render, tmp_path: Path
) -> None:
    rules = _alert_rules(render)
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    assert alerts == set(_ALERT_SCENARIOS), "every alert needs a scenario here"
    for rule in (r for g in rules["groups"] for r in g["rules"]):
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]

    promtool = require_tool("promtool", "prometheus")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(_promtool_unit_test(rules)))
    for command in (["check", "rules", "rules.yaml"], ["test", "rules", "tests.yaml"]):
        result = subprocess.run([promtool, *command], cwd=tmp_path, capture_output=True,
                                text=True, timeout=60)
        output = result.stdout + result.stderr
        assert result.returncode == 0, f"promtool {' '.join(command)}:\n{output}"


def test_low_goodput_fires_only_after_thirty_minutes_below_the_chart_threshold(
    render: Render, tmp_path: Path
) -> None:
    """The `for: 30m` of KubetrainLowGoodput, evaluated by promtool as Prometheus would."""
    promtool = require_tool("promtool", "prometheus")
    objects = render({"monitoring": {"prometheusRule": {"enabled": True, "goodputBelow": 0.6}}})
    (rule,) = [o for o in objects if o["kind"] == "PrometheusRule"]
    spec = dict(rule["spec"])
    for alert in (r for group in spec["groups"] for r in group["rules"]):
        alert.pop("annotations")  # when it fires is tested here; its text elsewhere
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(spec))
    running = {"kubetrain_step": "100+10x12", "kubetrain_max_steps": "1000x12"}
    goodput = {
        "wasteful": "0.3x12",  # below from the start
        "slipping": "0.9 0.9 0.9 0.9 0.55x8",  # below from minute 20 on
        "healthy": "0.65x12",  # above the chart's 0.6
    }
    series = [{"series": f'{name}{{trainingjob="{job}"}}', "values": values}
              for job in goodput for name, values in running.items()]
    series += [{"series": f'kubetrain_goodput_ratio{{trainingjob="{job}"}}', "values": values}
               for job, values in goodput.items()]

    def firing(*jobs: str) -> list[dict[str, Any]]:
        return [{"exp_labels": {"severity": "warning", "trainingjob": job}} for job in jobs]

    checks = [(25, firing()), (35, firing("wasteful")), (55, firing("slipping", "wasteful"))]
    tests = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": [{
        "interval": "5m", "input_series": series,
        "alert_rule_test": [{"eval_time": f"{minute}m", "alertname": "KubetrainLowGoodput",
                             "exp_alerts": alerts} for minute, alerts in checks],
    }]}
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests))
    result = subprocess.run([promtool, "test", "rules", "tests.yaml"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def _sample_worker_pod(minimal_manifest: dict[str, Any]) -> dict[str, Any]:
    manifest = {**minimal_manifest, "metadata": {"name": "demo", "namespace": "team-a",
                                                 "uid": "0f6c1e6e"}}
    return worker_pod(parse_job(manifest), 0, 0)


def test_pod_and_service_monitors_target_the_ports_kubetrain_serves(
    render: Render, minimal_manifest: dict[str, Any]
) -> None:
    objects = render({"monitoring": {"serviceMonitor": {"enabled": True},
                                     "podMonitor": {"enabled": True}}})
    (pod_monitor,) = [o for o in objects if o["kind"] == "PodMonitor"]
    (service_monitor,) = [o for o in objects if o["kind"] == "ServiceMonitor"]
    (service,) = [o for o in objects if o["kind"] == "Service"]
    deployment = next(o for o in objects if o["kind"] == "Deployment")

    pod = _sample_worker_pod(minimal_manifest)
    pod_ports = {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    (endpoint,) = pod_monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in pod_ports
    assert pod_monitor["spec"]["selector"]["matchExpressions"] == [
        {"key": JOB_LABEL, "operator": "Exists"}]
    assert JOB_LABEL in pod["metadata"]["labels"]

    (scrape,) = service_monitor["spec"]["endpoints"]
    assert scrape["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert service_monitor["spec"]["selector"]["matchLabels"].items() <= deployment["spec"][
        "template"]["metadata"]["labels"].items()


def test_worker_network_policy_admits_rendezvous_collectives_and_metrics(
    render: Render, minimal_manifest: dict[str, Any]
) -> None:
    pod = _sample_worker_pod(minimal_manifest)
    metrics_port = next(p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]
                        if p["name"] == "metrics")
    policy = next(o for o in render({}) if o["kind"] == "NetworkPolicy"
                  and o["metadata"]["name"].endswith("-workers"))
    between_workers, scrapes, lifelines = policy["spec"]["ingress"]
    ports = {p["port"] for p in between_workers["ports"]}
    assert RENDEZVOUS_PORT in ports
    assert LIGHTHOUSE_PORT in ports, "a job's replica groups reach its lighthouse"
    assert any("endPort" in p for p in between_workers["ports"]), "collective port range"
    assert [p["port"] for p in scrapes["ports"]] == [metrics_port]
    operator_peer = scrapes["from"][0]
    assert operator_peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "operator"
    # The trainers' lifelines (kubetrain.protocol.lifeline_port), from the operator only.
    from kubetrain.protocol import lifeline_port

    [lifeline_ports] = lifelines["ports"]
    assert lifeline_ports["port"] == lifeline_port(metrics_port, 0)
    assert lifeline_ports["endPort"] >= lifeline_port(metrics_port, 7)
    assert lifelines["from"] == [operator_peer]
