"""Why a worker pod ended: its failure class, from what the API and the trainer report.

Pure: a `WorkerPod` (the facts `kubetrain.operator.facts` read from the pod's
status, the node it was bound to and its trainer's termination message) becomes the
facts the class is decided from, and `kubetrain.restart_rules.failure_class` decides it
in the same order as for `kubetrain run`'s nodes: a class, the one a user reads in
status.lastFailure.class, the events and the metric `kubetrain_worker_failures_total{class}`.
What the operator does about a class is `kubetrain.operator.reconcile`'s: the two
out-of-memory classes halve the micro-batch, PreflightFailed avoids the nodes it names and
restarts the group, and Unknown, CollectiveTimeout and GPUError repeated on one node avoid
that node (kubetrain.operator.avoidance); the rest keep the restart policy they had.

The classes, in the order they are decided:
- NodeLost: the pod's node is gone or unreachable, or the taint manager deleted it;
- Preempted: the scheduler preempted it, or its node shut down under it (a spot
  reclaim, graceful node shutdown);
- Evicted: the kubelet evicted it (node pressure) or the Eviction API did (a drain);
- OOMKilled: the container's reason, or exit 137 with an out-of-memory reason or
  message on the pod (some runtimes leave the container reason Error);
- CUDAOutOfMemory, CollectiveTimeout, GPUError, PreflightFailed, QuorumLost: what the
  trainer wrote
  into its termination message before exiting (`kubetrain_worker_failure_info{class=...}`),
  since none shows in the pod's status: torchrun exits 1 whatever its worker died of;
- UserError: an exit code in runPolicy.permanentExitCodes;
- Unknown: anything else (a Python exception, a signal from outside).
"""

from __future__ import annotations

from collections.abc import Collection

from kubetrain import restart_rules
from kubetrain.operator.facts import WorkerPod
from kubetrain.protocol import EXIT_OOM_KILLED

# DisruptionTarget condition reasons (Kubernetes 1.26+) and pod reasons, by class.
_PREEMPTED = frozenset({"PreemptionByScheduler", "PreemptionByKubeScheduler", "Preempting",
                        "Shutdown", "NodeShutdown", "Terminated"})
_EVICTED = frozenset({"Evicted", "EvictionByEvictionAPI", "TerminationByKubelet"})
_NODE_LOST = frozenset({"NodeLost", "DeletionByTaintManager", "DeletionByPodGC"})


def classify(pod: WorkerPod, permanent_exit_codes: Collection[int]) -> str:
    """The failure class of a pod that failed or lost its node (see the module docstring)."""
    reasons = {pod.reason, pod.disruption, pod.pod_reason}
    return restart_rules.failure_class(
        exit_code=pod.exit_code, permanent_exit_codes=permanent_exit_codes,
        node_lost=pod.node_lost or bool(reasons & _NODE_LOST),
        preempted=bool(reasons & _PREEMPTED), evicted=bool(reasons & _EVICTED),
        oom_killed="OOMKilled" in reasons or (
            pod.exit_code == EXIT_OOM_KILLED and "oom" in (pod.pod_message or "").lower()),
        trainer_class=pod.trainer_failure.failure_class if pod.trainer_failure else None)


def describe(pod: WorkerPod, failure_class: str) -> str:
    """One line about the failure: what the pod's status says, then what the trainer said."""
    if pod.node_lost:
        what = f"{pod.name} lost its node"
    elif pod.exit_code is None:
        what = f"{pod.name} failed ({pod.disruption or pod.reason or 'no exit code'})"
    else:
        why = f" ({pod.reason})" if pod.reason and pod.reason != "Error" else ""
        what = f"{pod.name} exited with code {pod.exit_code}{why}"
    trainer = pod.trainer_failure
    if trainer is not None and trainer.failure_class == failure_class and trainer.message:
        what += f": {trainer.message}"
    return what
