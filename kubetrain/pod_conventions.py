"""What a worker is to both runners: its names and labels, the manifest its trainer reads,
the program it runs, torchrun's settings and the variables it is given.

The operator builds worker pods from these (`kubetrain.operator.children`,
`kubetrain.operator.worker_env`, `kubetrain.operator.own_code_container`), `kubetrain run`
builds its simulated nodes from them (`kubetrain.local.launch`), `kubetrain logs` finds a
job's pods by the labels, and the trainer reads the variables. One definition each, so a
pod and a simulated node differ only where a runner must: pure, torch-free and free of the
Kubernetes client.
"""

from __future__ import annotations

from typing import Any, Final

import yaml

from kubetrain.api.trainingjob import API_VERSION, KIND, TrainingJob
from kubetrain.protocol import RENDEZVOUS_BACKEND

# --- names and labels of a job's worker pods --------------------------------------------

JOB_LABEL: Final = "kubetrain.io/job-name"
INDEX_LABEL: Final = "kubetrain.io/worker-index"
ATTEMPT_LABEL: Final = "kubetrain.io/restart-attempt"
# On a job's pods and Services that are not its workers' (the lighthouse's): what they are.
# They carry the job's label too, so that the operator's watch, which selects that label,
# sees them; the workers are the job's pods with a worker index (`worker_selector`).
COMPONENT_LABEL: Final = "kubetrain.io/component"
LIGHTHOUSE_COMPONENT: Final = "lighthouse"
TRAINER_CONTAINER: Final = "trainer"


def pod_name(job_name: str, index: int) -> str:
    """`<job>-worker-<index>`: stable across restarts so the rendezvous host keeps its DNS name."""
    return f"{job_name}-worker-{index}"


def worker_selector(job_name: str) -> str:
    """Label selector of the job's worker pods (status.workers.selector, for `kubectl scale`):
    the job's pods that have a worker index, which its lighthouse has not."""
    return f"{JOB_LABEL}={job_name},{INDEX_LABEL}"


def worker_label_selector(job_name: str) -> dict[str, Any]:
    """`worker_selector` as a Kubernetes LabelSelector (a spread's or an affinity's)."""
    return {"matchLabels": {JOB_LABEL: job_name},
            "matchExpressions": [{"key": INDEX_LABEL, "operator": "Exists"}]}


# --- what a worker runs -------------------------------------------------------------------

# kubetrain's trainer: torchrun with its options, whose restarts in place skip the imports.
TRAINER_LAUNCH_MODULE: Final = "kubetrain.trainer.launch"
# Own code (spec.trainer): kubetrain's entry around torchrun and the user's command, which
# restores the newest checkpoint first and uploads the folders the code marks complete.
OWN_CODE_ENTRY_MODULE: Final = "kubetrain.trainer.own_code"


def job_snapshot(job: TrainingJob) -> str:
    """The manifest the trainer reads (a pod's /etc/kubetrain/job.yaml, a local run's
    runs/NAME/job.yaml): the spec, and of the status only `effective` (the micro-batch an
    out-of-memory restart chose), never the spec changed."""
    meta: dict[str, Any] = {"name": job.metadata.name}
    if job.metadata.namespace:
        meta["namespace"] = job.metadata.namespace
    document: dict[str, Any] = {"apiVersion": API_VERSION, "kind": KIND, "metadata": meta,
                                "spec": job.spec.wire()}
    if job.status is not None and job.status.effective is not None:
        document["status"] = {"effective": job.status.effective.wire()}
    # libyaml's emitter: the pure-Python one costs milliseconds per job at every create.
    return yaml.dump(document, Dumper=yaml.CSafeDumper, sort_keys=False)


def torchrun_settings(job: TrainingJob, *, endpoint: str, run_id: str, max_nodes: int,
                      max_restarts: int) -> dict[str, str]:
    """torchrun's options that kubetrain sets, by option name, in order: a pod passes each
    as PET_<NAME> (dashes as underscores, upper case), `kubetrain run` as --<name>.

    With spec.faultTolerance the torchrun group is one replica group, whose pods are fixed
    (`pods_per_group`): nnodes is that size, whatever `max_nodes` says, and `endpoint` and
    `run_id` must be the group's (`group_leader`, `group_run_id`).

    Elastic between minReplicas and `max_nodes` nodes of procsPerWorker processes, meeting
    at `endpoint` through the `kubetrain` rendezvous (rounds on c10d's store, each formed in
    a few store operations per agent); `run_id` tells one group's rendezvous from another's;
    `max_restarts` is torchrun's own budget of restarts in place. What differs between the
    runners is the caller's: a pod's group may grow to maxReplicas and meets at worker 0
    under the job's uid, with maxRestarts; a local run never grows past replicas, meets on
    loopback, and restarts only as a whole.
    """
    workers = job.spec.workers
    tolerance = job.spec.fault_tolerance
    if tolerance is None:
        nnodes = f"{workers.min_workers}:{max_nodes}"
    else:
        group = tolerance.pods_per_group(workers.replicas)
        nnodes = f"{group}:{group}"
    return {
        "nnodes": nnodes,
        "nproc-per-node": str(workers.procs_per_worker),
        "rdzv-backend": RENDEZVOUS_BACKEND,
        "rdzv-endpoint": endpoint,
        "rdzv-id": run_id,
        "max-restarts": str(max_restarts),
    }


def pet_variable(option: str) -> str:
    """The variable a pod sets torchrun's `option` with: `nproc-per-node` -> PET_NPROC_PER_NODE."""
    return "PET_" + option.replace("-", "_").upper()


# --- the variables the runners give a worker ----------------------------------------------

# The pod's and node's names (the downward API in a pod): the trainer labels each rank's
# timing with them, and the operator names a straggler's pod and node from that.
POD_NAME_ENV: Final = "KUBETRAIN_POD_NAME"
NODE_NAME_ENV: Final = "KUBETRAIN_NODE_NAME"
# Where the trainer leaves its termination message: a pod's terminationMessagePath unless
# this names another file (each of `kubetrain run`'s nodes has its own).
TERMINATION_LOG_ENV: Final = "KUBETRAIN_TERMINATION_LOG"
DEFAULT_TERMINATION_LOG: Final = "/dev/termination-log"
# When `kubetrain run` launched the attempt (unix seconds): the trainer's goodput ledger
# counts start-up from there, torchrun's own start included.
ATTEMPT_STARTED_ENV: Final = "KUBETRAIN_ATTEMPT_STARTED_AT"
# What torchrun gives own code's processes to save after SIGTERM (its default is 30 s), and
# what the own-code entry then has left to upload the last checkpoint.
SHUTDOWN_TIMEOUT_ENV: Final = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
FINAL_SYNC_SECONDS_ENV: Final = "KUBETRAIN_FINAL_SYNC_SECONDS"


# --- spec.faultTolerance's replica groups -------------------------------------------------

# Which replica group a worker's torchrun group is (0-based), and where torchft's lighthouse
# listens (`http://host:port`, torchft's own variable).
REPLICA_GROUP_ENV: Final = "KUBETRAIN_REPLICA_GROUP"
LIGHTHOUSE_ENV: Final = "TORCHFT_LIGHTHOUSE"
LIGHTHOUSE_PROGRAM: Final = "torchft_lighthouse"  # torchft's Rust lighthouse, in its wheel
LIGHTHOUSE_PORT: Final = 29510  # torchft's default


def lighthouse_command(job: TrainingJob, *, bind: str = f"[::]:{LIGHTHOUSE_PORT}") -> list[str]:
    """The lighthouse of a job with spec.faultTolerance, listening on `bind`.

    A group silent for heartbeatTimeoutMilliseconds drops out of the quorum. One that
    heartbeats but has not asked for the next quorum is waited for as long as a collective
    may take (collectiveTimeoutMilliseconds, or the heartbeat timeout if longer), then left
    out of that quorum: such a group is most likely still in the last step's all-reduce,
    waiting out a peer that vanished without a reset (a lost node), and it holds the job's
    newest state. Groups that came back meanwhile wait for it and heal from it; left out,
    they would form a quorum of their own from the checkpoint, and it would heal from them
    (a majority lost at once). The wait costs the others only when a group stalls with its
    heartbeat alive (a hung trainer), once. Below minReplicaGroups no quorum forms and the
    groups wait (then fail) together.
    """
    tolerance = job.spec.fault_tolerance
    assert tolerance is not None, "only a job with spec.faultTolerance has a lighthouse"
    heartbeat = tolerance.heartbeat_timeout_milliseconds
    join = max(heartbeat, tolerance.collective_timeout_milliseconds)
    return [LIGHTHOUSE_PROGRAM, "--bind", bind,
            "--min_replicas", str(tolerance.min_replica_groups),
            "--heartbeat_timeout_ms", str(heartbeat), "--join_timeout_ms", str(join)]


def lighthouse_name(job_name: str) -> str:
    """`<job>-lighthouse`: the lighthouse's Pod and its Service."""
    return f"{job_name}-lighthouse"


def replica_group_of(job: TrainingJob, index: int) -> int | None:
    """The replica group of worker `index` (0-based: pods 0..n-1 are group 0, where n is
    `pods_per_group`); None for a job without spec.faultTolerance."""
    tolerance = job.spec.fault_tolerance
    if tolerance is None:
        return None
    return index // tolerance.pods_per_group(job.spec.workers.replicas)


def group_leader(job: TrainingJob, index: int) -> int:
    """The first worker of worker `index`'s torchrun group, whose pod hosts its rendezvous:
    its replica group's first with spec.faultTolerance, else worker 0."""
    group = replica_group_of(job, index)
    if group is None:
        return 0
    assert job.spec.fault_tolerance is not None
    return group * job.spec.fault_tolerance.pods_per_group(job.spec.workers.replicas)


def group_run_id(job: TrainingJob, index: int, job_run_id: str) -> str:
    """The rendezvous id of worker `index`'s torchrun group: the job's (`job_run_id`), or
    with spec.faultTolerance `<job_run_id>-group-<g>`, so that each replica group forms
    its own rendezvous and a returning group never joins a live one's."""
    group = replica_group_of(job, index)
    return job_run_id if group is None else f"{job_run_id}-group-{group}"


def replica_group_env(job: TrainingJob, index: int, lighthouse_url: str) -> dict[str, str]:
    """What the trainer of worker `index` is told of its replica group: REPLICA_GROUP_ENV
    and LIGHTHOUSE_ENV (`lighthouse_url`, `http://host:port`); none without
    spec.faultTolerance."""
    group = replica_group_of(job, index)
    if group is None:
        return {}
    return {REPLICA_GROUP_ENV: str(group), LIGHTHOUSE_ENV: lighthouse_url}
