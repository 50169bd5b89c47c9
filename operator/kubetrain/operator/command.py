"""Run the TrainingJob operator (kopf): keep each job's worker pods, status and progress current.

Watches TrainingJobs in all namespaces, or in those given with --namespace, and
their pods. Serves its Prometheus metrics on --metrics-port (/metrics) and a
liveness probe on --health-port (/healthz). Several replicas elect a leader
through the Lease `kubetrain-operator` in --lease-namespace: only the leader acts,
the others keep watching and take over when it stops; --standalone skips that.
Serves the status endpoint (HTTPS) on --status-port, where the pods of own-code jobs
(spec.trainer) report their progress as to Kubeflow Trainer's; its CA and key live in
the Secret kubetrain-status-endpoint of --status-namespace.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import threading
from pathlib import Path
from typing import Any

from kubetrain import pod_conventions
from kubetrain.operator.config import OperatorConfig

# Allocations between collections of the youngest generation (Python's default: 700).
GC_FIRST_GENERATION = 20_000

DEFAULT_STATUS_PORT = 8443
# The operator pod's IP (the chart sets it from the downward API): where the status
# Service's EndpointSlice points while this replica acts.
POD_IP_ENV = "KUBETRAIN_POD_IP"

# The namespace a pod's service account belongs to: where an in-cluster operator keeps its Lease.
_POD_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def _default_lease_namespace() -> str:
    try:
        return _POD_NAMESPACE_FILE.read_text().strip()
    except OSError:
        return "default"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", action="append", default=[], metavar="NS",
                        help="watch this namespace (repeatable; default: all namespaces)")
    parser.add_argument("--metrics-port", type=int, default=9090,
                        help="port of the operator's /metrics (default: 9090)")
    parser.add_argument("--health-port", type=int, default=8080,
                        help="port of the liveness probe /healthz (default: 8080)")
    parser.add_argument("--standalone", action="store_true",
                        help="act without leader election (a single replica, or local "
                        "development)")
    parser.add_argument("--lease-namespace", default=_default_lease_namespace(),
                        help="namespace of the leader-election Lease (default: the pod's own "
                        "namespace in a cluster, else default)")
    parser.add_argument("--resync-seconds", type=float, default=10.0,
                        help="how often each job is re-checked and rank 0's metrics scraped "
                        "(default: 10)")
    parser.add_argument("--status-port", type=int, default=DEFAULT_STATUS_PORT,
                        help="port of the status endpoint (HTTPS) that own-code jobs' pods "
                        f"report to (default: {DEFAULT_STATUS_PORT})")
    parser.add_argument("--status-namespace", default=_default_lease_namespace(),
                        help="namespace of the status endpoint's key Secret and Service "
                        "(default: the pod's own namespace in a cluster, else default)")
    parser.add_argument("--status-service", default="",
                        help="the selector-less Service in --status-namespace that job pods "
                        "dial: the acting replica points its EndpointSlice at its own pod IP "
                        f"(${POD_IP_ENV})")
    parser.add_argument("--status-host", default="",
                        help="the host job pods dial instead (default: "
                        "<status-service>.<status-namespace>.svc)")
    parser.add_argument("--verbose", action="store_true", help="log debug messages")


def config_from(args: argparse.Namespace) -> OperatorConfig:
    return OperatorConfig(
        namespaces=tuple(args.namespace),
        resync_seconds=args.resync_seconds,
        standalone=args.standalone,
        lease_namespace=args.lease_namespace,
        metrics_port=args.metrics_port,
        health_port=args.health_port,
        status_port=args.status_port,
        status_host=args.status_host,
        status_namespace=args.status_namespace,
        status_service=args.status_service,
        pod_ip=os.environ.get(POD_IP_ENV, ""),
    )


def serve(config: OperatorConfig, stop_flag: threading.Event | None = None,
          ready_flag: threading.Event | None = None) -> None:
    """Run the operator until `stop_flag` is set (or forever); blocks the calling thread."""
    import kopf
    from kubernetes import client
    from kubernetes import config as kube_config
    from prometheus_client import start_http_server

    from kubetrain.operator.handlers import USER_AGENT, TrainingJobController

    configuration = client.Configuration()
    try:
        kube_config.load_incluster_config(client_configuration=configuration)
    except kube_config.ConfigException:
        # KUBECONFIG is read now, not when the client library was imported.
        kube_config.load_kube_config(os.environ.get("KUBECONFIG"),
                                     client_configuration=configuration)
    # Creates and deletes fan out over kopf's worker threads: one connection each.
    configuration.connection_pool_maxsize = 32
    api = client.ApiClient(configuration)
    # The identity says which replica made a request (audit logs, tests of leader election).
    api.user_agent = f"{USER_AGENT}/{config.identity}"

    status = None
    if config.status_port is not None:
        from kubetrain.operator.trainer_status_setup import start_status_reporting

        status = start_status_reporting(api, config.status_namespace, config.status_dial_host(),
                                        config.status_port)
    controller = TrainingJobController(config, api, status)
    registry = kopf.OperatorRegistry()
    controller.register(registry)
    kopf.on.login(registry=registry)(_login)

    settings = kopf.OperatorSettings()
    # Indexes and event handlers keep no kopf state; were progress kept, it would go to
    # status.kopf, never to annotations or finalizers GitOps tools would diff.
    settings.persistence.progress_storage = kopf.StatusProgressStorage(name="kopf")
    settings.persistence.diffbase_storage = _no_diff_base()
    # kopf posts its own log lines as events on the job: only its warnings, not its chatter.
    settings.posting.level = logging.WARNING
    settings.execution.max_workers = 32
    # The watched resources are fixed (TrainingJobs, Pods, Nodes): no need to observe
    # CustomResourceDefinitions and namespaces at run time, which would take a cluster-wide
    # list/watch on CRDs that the chart's least-privilege RBAC does not grant.
    settings.scanning.disabled = True
    # Only the children's events, selected by the API server: kopf filters labels itself,
    # after every pod, service and config map of the cluster has been sent, decoded and
    # run through its machinery.
    for plural in ("pods", "services", "configmaps"):
        settings.watching.label_selectors["v1", plural] = pod_conventions.JOB_LABEL

    metrics_server, metrics_thread = start_http_server(
        config.metrics_port, registry=controller.metrics.registry)
    election_stop = threading.Event()
    election = None
    if controller.election is not None:
        election = threading.Thread(target=controller.election.run, args=(election_stop,),
                                    name="leader-election", daemon=True)
        election.start()
    try:
        # kopf runs standalone: the Lease, not kopf peering, decides which replica acts.
        asyncio.run(kopf.operator(
            registry=registry,
            settings=settings,
            standalone=True,
            clusterwide=not config.namespaces,
            namespaces=config.namespaces,
            liveness_endpoint=f"http://0.0.0.0:{config.health_port}/healthz",
            stop_flag=stop_flag,
            ready_flag=ready_flag,
        ))
    finally:
        election_stop.set()
        if election is not None:
            election.join()
        metrics_server.shutdown()
        metrics_thread.join()
        if status is not None:
            status.stop()
        api.close()


def _tune_garbage_collector() -> None:
    """Keep Python's cycle collector from rescanning what only grows.

    What the operator imports (kopf, the Kubernetes client's thousands of model
    classes, pydantic) lives as long as the process: frozen, no collection scans it
    again. And the indexes hold every watched object, so each full collection walks
    them all: at 500 jobs, a quarter of the operator's CPU went to collections, most
    of it to ten full ones. A larger first generation means fewer collections of every
    generation; the cycles kopf and asyncio leave behind are still collected.

    The command does this for its own process; `serve` alone (tests run it in theirs)
    leaves the collector as it was.
    """
    import kopf  # noqa: F401  (imported here to be frozen with the rest)

    from kubetrain.operator import handlers  # noqa: F401

    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_FIRST_GENERATION, *gc.get_threshold()[1:])


def _no_diff_base() -> Any:
    """A kopf diff base that keeps nothing: the operator has no on.create/on.update handlers.

    kopf builds the diff base of every watched object at every watch event all the
    same (a deep copy of the object), a large part of its cost per event; with nothing
    to diff, that copy is waste.
    """
    import kopf

    class NoDiffBase(kopf.DiffBaseStorage):
        def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
            return kopf.BodyEssence()

        def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
            return None

        def store(self, *, body: kopf.Body, patch: kopf.Patch,
                  essence: kopf.BodyEssence) -> None:
            pass

    return NoDiffBase()


def _login(**kwargs: Any) -> Any:
    """kopf's credentials: the pod's service account in a cluster, else the kubeconfig."""
    import kopf

    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        # kopf logs "Handler ... succeeded" at INFO for every watch event: a line per
        # event, which at scale is most of the log and a measurable part of the CPU.
        # Its warnings and errors (a failing handler, a lost watch) stay.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    _tune_garbage_collector()
    serve(config_from(args))
    return 0
