"""Lifecycle: the steps of a reconcile pass that move a job through its phases.

Pending → Running as workers start; Suspended and back (runPolicy.suspend); scaling
(spec.workers.replicas); the children it needs (Service, ConfigMap, worker pods, and with
spec.faultTolerance the lighthouse);
completion, activeDeadlineSeconds and the clean-up of a finished job (cleanPodPolicy,
ttlSecondsAfterFinished); and a job failed for an invalid spec trying again once its
spec changed. Failures and restarts are not here: see `kubetrain.operator.recovery`.

Each step reads and writes the pass's `ReconcilePass` (`kubetrain.operator.reconcile_pass`),
through its primitives; no Kubernetes, no clock but the pass's `now`.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta

from kubetrain.api.trainingjob import TrainingJob, TrainingJobStatus
from kubetrain.operator import children, scheduling
from kubetrain.operator.actions import CreateObject, DeleteJob, UpdateConfigMap
from kubetrain.operator.facts import WorkerPod
from kubetrain.operator.reconcile_pass import ReconcilePass

# The Failed condition's reason for a spec that does not parse (`reconcile.reject`).
INVALID_SPEC = "InvalidSpec"
# The reason a lost lighthouse is deleted and created again (its event's, its deletion's).
LIGHTHOUSE_LOST = "LighthouseLost"
SUSPENDED = "runPolicy.suspend is true: the workers checkpoint and stop; the job is kept"
RESUMED = "runPolicy.suspend is false: the workers start again from the latest checkpoint"


def retry_invalid_spec(decision: ReconcilePass) -> None:
    """A job failed for an invalid spec gets another chance once its spec changed."""
    status = decision.status
    failed = decision.condition_of("Failed")
    if (status.phase == "Failed" and failed is not None and failed.reason == INVALID_SPEC
            and status.observed_generation != decision.job.metadata.generation):
        status.phase = None
        status.completion_time = None
        decision.condition("Failed", False, "SpecCorrected", "the spec is valid now")


def deadline_passed(limit_seconds: int | None, start: datetime | None, now: datetime) -> bool:
    """Whether a job started at `start` has run for runPolicy.activeDeadlineSeconds."""
    return limit_seconds is not None and start is not None and now >= start + timedelta(
        seconds=limit_seconds)


def rank0_succeeded(pods: Iterable[WorkerPod]) -> bool:
    """Whether worker 0 exited 0: training is complete (the other ranks may still stop)."""
    return any(pod.index == 0 and pod.phase == "Succeeded" and not pod.deleting
               for pod in pods)


def clean_up(decision: ReconcilePass) -> None:
    """Apply cleanPodPolicy to a finished job and expire it after its TTL."""
    policy = decision.job.spec.run_policy
    for pod in decision.live_pods():
        if to_clean_up(pod, decision.status.phase == "Succeeded", policy.clean_pod_policy):
            decision.delete(pod, "JobFinished")
    stop_lighthouse(decision, "JobFinished")
    ttl = policy.ttl_seconds_after_finished
    done = decision.status.completion_time
    if ttl is not None and done is not None and decision.now >= done + timedelta(seconds=ttl):
        decision.actions.append(DeleteJob(f"finished {ttl}s ago (ttlSecondsAfterFinished)"))


def to_clean_up(pod: WorkerPod, succeeded: bool, clean_pod_policy: str) -> bool:
    """Whether a finished job deletes `pod`: cleanPodPolicy Running stops the active ones,
    All every one, None none; a succeeded job always stops those still active (their work
    is done)."""
    if pod.active:
        return succeeded or clean_pod_policy != "None"
    return clean_pod_policy == "All"


def suspend(decision: ReconcilePass) -> None:
    """runPolicy.suspend: delete every pod (each checkpoints on its SIGTERM), keep the job."""
    for pod in decision.live_pods():
        decision.delete(pod, "Suspended")
    stop_lighthouse(decision, "Suspended")
    if decision.status.phase != "Suspended":
        decision.status.phase = "Suspended"
        decision.condition("Suspended", True, "Suspended", SUSPENDED)
        decision.condition("Running", False, "Suspended")
        decision.condition("Restarting", False, "Suspended")
        decision.event("Suspended", SUSPENDED)


def resume(decision: ReconcilePass) -> None:
    """runPolicy.suspend back to false: Pending, until the recreated workers run."""
    decision.status.phase = "Pending"
    decision.condition("Suspended", False, "Resumed", RESUMED)
    decision.event("Resumed", RESUMED)


def job_as_run(job: TrainingJob, status: TrainingJobStatus) -> TrainingJob:
    """The job with the status being decided: what the ConfigMap's snapshot carries."""
    return job.model_copy(update={"status": status})


def ensure_service_and_config(decision: ReconcilePass) -> None:
    """Create the Service and ConfigMap when missing; rewrite the ConfigMap when its
    snapshot's micro-batch or generation is not the job's."""
    job, observed = decision.job, decision.observed
    as_run = job_as_run(job, decision.status)
    if not observed.service:
        decision.actions.append(CreateObject(children.service(job)))
    generation = job.metadata.generation
    held = observed.config_generation
    held_micro = observed.config_micro_batch or job.spec.optimization.micro_batch_size
    if held is None:
        decision.actions.append(CreateObject(children.config_map(as_run)))
    elif held_micro != as_run.micro_batch_size:
        # An out-of-memory restart's new micro-batch, not yet written (the write failed).
        decision.actions.append(UpdateConfigMap(children.config_map(as_run)))
    elif generation is not None and held != generation:
        # Running workers keep the config they started with; restarts read the new one.
        decision.actions.append(UpdateConfigMap(children.config_map(as_run)))
        decision.event("ConfigUpdated",
                       f"{children.config_map_name(decision.name)} holds the spec of "
                       f"generation {generation} now; workers read it when they next start")


def ensure_lighthouse(decision: ReconcilePass) -> None:
    """spec.faultTolerance: create the lighthouse's Service and Pod when missing, before any
    worker; delete a pod that ended (Failed or Succeeded: evicted, say; the kubelet restarts
    a crashed one in place) or whose node is lost, to create it again once it is gone."""
    job, observed = decision.job, decision.observed
    if job.spec.fault_tolerance is None:
        return
    if not observed.lighthouse_service:
        decision.actions.append(CreateObject(children.lighthouse_service(job)))
    pod = observed.lighthouse
    if pod is None:
        decision.actions.append(CreateObject(children.lighthouse_pod(job)))
    elif not pod.deleting and (pod.phase in ("Failed", "Succeeded") or pod.node_lost):
        decision.delete(pod, LIGHTHOUSE_LOST)
        what = "lost its node" if pod.node_lost else f"ended ({pod.phase})"
        decision.event(LIGHTHOUSE_LOST, f"{pod.name} {what}: it is created again once gone; "
                       "meanwhile the replica groups wait for a quorum", warning=True)


def stop_lighthouse(decision: ReconcilePass, reason: str) -> None:
    """Delete the lighthouse of a job whose workers are all gone for good or for a while
    (finished, suspended): it only ever keeps their quorum."""
    pod = decision.observed.lighthouse
    if pod is not None and not pod.deleting and pod.name not in decision.deleted:
        decision.delete(pod, reason)


def scale(decision: ReconcilePass, previous_desired: int) -> None:
    """Delete the workers past spec.workers.replicas; an event when the count changed."""
    for pod in decision.live_pods():
        if pod.index >= decision.replicas:
            decision.delete(pod, "ScaledDown")
    if previous_desired and previous_desired != decision.replicas:
        decision.event("Scaled", f"workers {previous_desired} -> {decision.replicas}; "
                       "training resumes from a checkpoint in the new group")


def create_missing(decision: ReconcilePass) -> None:
    """Create the worker pods missing from indices 0..replicas-1, under the current restart
    attempt (the Created condition and event the first time)."""
    status = decision.status
    # A pod still being deleted keeps its name: its replacement waits until it is gone.
    present = {pod.index for pod in decision.observed.pods}
    missing = [index for index in range(decision.replicas) if index not in present]
    as_run = job_as_run(decision.job, status)  # with status.avoidedNodes as decided in this pass
    for index in missing:
        pod = children.worker_pod(as_run, index, status.restart_attempt)
        scheduling.shape_pod(decision, pod, index)  # its group, queue and topology
        decision.actions.append(CreateObject(pod))
    if missing and decision.condition_since("Created") is None:
        message = (f"created service {decision.name}, config map "
                   f"{children.config_map_name(decision.name)} and {len(missing)} worker pods")
        decision.condition("Created", True, "ChildrenCreated", message)
        decision.event("Created", message)


def update_phase(decision: ReconcilePass) -> None:
    """Running once worker 0 and enough workers run; Pending when a running group lost
    members without a failure."""
    status = decision.status
    running = [pod for pod in decision.live_pods()
               if pod.phase == "Running" and pod.index < decision.replicas]
    rank0 = any(pod.index == 0 for pod in running)
    # A first start may begin with minReplicas; a restart is over once every replacement runs.
    restarting = status.phase == "Restarting"
    # Pods held back by avoidance wait: the group runs elastic without them.
    needed = (decision.replicas if restarting and not decision.held_back
              else decision.job.spec.workers.min_workers)
    if rank0 and len(running) >= needed:
        if status.phase != "Running":
            status.phase = "Running"
            status.start_time = status.start_time or decision.now
            message = f"{len(running)} of {decision.replicas} workers running"
            decision.condition("Running", True, "WorkersRunning", message)
            decision.condition("Restarting", False, "WorkersRunning")
            decision.event("Running", message)
    elif status.phase in (None, "Running"):
        # Lost members without a failure (e.g. a pod deleted by hand) re-form as Pending.
        status.phase = "Pending"
        decision.condition("Running", False, "WaitingForWorkers")
