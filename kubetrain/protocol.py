"""The protocol between the trainer and what runs it: each name both sides use, once.

A trainer process (`python -m kubetrain.trainer`) ends with one of these exit codes
and, when it failed in a way only it can see, writes one of the trainer's failure
classes into its termination message (`kubetrain.trainer.metrics.record_failure`).
The operator (a pod's container status) and `kubetrain run` (a process's exit status)
read both, and give every failed worker one of `FAILURE_CLASSES`: the names a user
reads in status.lastFailure.class, the events and `kubetrain_worker_failures_total`.

The wire contract besides: the metric names rank 0 serves and the operator reads, the
termination message's lines (a failure, unmarked checkpoints) with their one writer and
reader, and own code's progress reports (Kubeflow Trainer's `trainerStatus`) with their one
parser, which the operator's endpoint and `kubetrain run`'s both call.

Torch-free and free of kubetrain imports, so the trainer, the API models, the
operator, the local runner and the SDK all take their names from here. What to do about a
failure (retry, halve the micro-batch, give up) is not protocol: that is
`kubetrain.restart_rules`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, Literal, get_args

# torchrun's rendezvous backend in every launch kubetrain makes (a worker pod's
# PET_RDZV_BACKEND, `kubetrain run`'s --rdzv-backend): rounds on c10d's store, each
# formed in a few store operations per agent (kubetrain.trainer.rendezvous).
RENDEZVOUS_BACKEND: Final = "kubetrain"

# Set by kubetrain.trainer.launch for the training processes it starts: the pid of their
# torchrun agent, which is not their parent (a fork server is). A trainer that must end its
# pod signals it (kubetrain.trainer.distributed.stop_torchrun_agent).
AGENT_PID_ENV: Final = "KUBETRAIN_AGENT_PID"

# Each training process names itself PREFIX + its rank (/proc/PID/comm, what ps and top
# show): under the launcher they all have the fork server's command line.
RANK_PROCESS_PREFIX: Final = "kt-rank-"
# ... and their fork server, a fork of the agent, names itself this.
FORK_SERVER_NAME: Final = "kt-fork-server"

# --- exit codes of a trainer process ----------------------------------------------------

EXIT_COMPLETE: Final = 0  # training finished (maxSteps or early stopping), exported
EXIT_INVALID_MANIFEST: Final = 2  # the job cannot run as written: permanent by default
EXIT_RESTART: Final = 75  # EX_TEMPFAIL: another rank was signalled; rejoin the new membership
EXIT_OUT_OF_MEMORY: Final = 87  # the device ran out of memory at this micro-batch
EXIT_COLLECTIVE_TIMEOUT: Final = 88  # a collective timed out (a peer hung or vanished)
EXIT_PREFLIGHT_FAILED: Final = 89  # the preflight check failed (kubetrain.trainer.preflight)
EXIT_GPU_ERROR: Final = 90  # the GPU itself failed (kubetrain.trainer.failure_classes.is_gpu_error)
# spec.faultTolerance: no quorum of minReplicaGroups replica groups formed within the quorum
# timeout, or the lighthouse could not be reached (kubetrain.trainer.fault_tolerance)
EXIT_QUORUM_LOST: Final = 91
# 128 + N is "killed by signal N" as shells and container runtimes report it (Python's
# Popen reports -N); 128 itself is no signal.
SIGNAL_EXIT_BASE: Final = 128
EXIT_SIGNALLED: Final = 143  # 128 + SIGTERM: stopped after saving a checkpoint
EXIT_OOM_KILLED: Final = 137  # 128 + SIGKILL, what the kernel's OOM killer leaves
# Exit codes that mean the configuration or code is wrong (runPolicy.permanentExitCodes'
# default): the trainer's invalid manifest, and a shell's "cannot execute" and "not found".
DEFAULT_PERMANENT_EXIT_CODES: Final = (EXIT_INVALID_MANIFEST, 126, 127)


def is_signal_exit(exit_code: int) -> bool:
    """Whether an exit status says the process was killed by a signal rather than exiting."""
    return exit_code < 0 or exit_code > SIGNAL_EXIT_BASE


# --- failure classes --------------------------------------------------------------------

# Every class a failed worker can get, in the order kubetrain.operator.failures decides it.
FailureClass = Literal["OOMKilled", "CUDAOutOfMemory", "Evicted", "Preempted", "NodeLost",
                       "CollectiveTimeout", "GPUError", "PreflightFailed", "QuorumLost",
                       "UserError", "Unknown"]
FAILURE_CLASSES: Final[tuple[str, ...]] = get_args(FailureClass)
# The classes only the trainer can see, written into its termination message: under
# torchrun the worker's exit code is torchrun's, whatever the trainer died of.
TrainerFailureClass = Literal["CUDAOutOfMemory", "CollectiveTimeout", "GPUError",
                              "PreflightFailed", "QuorumLost"]
TRAINER_CLASSES: Final = frozenset(get_args(TrainerFailureClass))
# The trainer's own exit code for each: what a trainer run without torchrun exits with.
TRAINER_EXIT_CODES: Final[dict[str, int]] = {
    "CUDAOutOfMemory": EXIT_OUT_OF_MEMORY,
    "CollectiveTimeout": EXIT_COLLECTIVE_TIMEOUT,
    "PreflightFailed": EXIT_PREFLIGHT_FAILED,
    "GPUError": EXIT_GPU_ERROR,
    "QuorumLost": EXIT_QUORUM_LOST,
}
# Out of memory, in the container (the kernel's OOM killer) or on the device.
OUT_OF_MEMORY_CLASSES: Final = frozenset({"OOMKilled", "CUDAOutOfMemory"})
# Trainer failures a restart in place cannot cure (the same micro-batch, the same GPU, the
# same stalled peer): the worker asks its torchrun agent to stop, and the pod ends.
# (QuorumLost is cured in place: the new processes rejoin the quorum, or resume from the
# checkpoint with the other groups when every group lost it.)
ENDS_THE_POD: Final = frozenset({"CUDAOutOfMemory", "GPUError", "PreflightFailed"})


# --- the lifeline: each pod beats, and says how each of its trainer processes ends -----

# The agent of each worker pod (`kubetrain.trainer.launch`, which runs torchrun) serves the
# pod's lifeline on the metrics port + 1 (`lifeline_port`). To whoever connects (the
# operator) it writes POD_LIFELINE first, then `beat` every LIFELINE_BEAT_SECONDS from a
# thread of its own, and one line for each trainer process of the pod that ends:
# `rank <local rank> end <exit code> <class> <words>` (`rank_line`) when the process said
# how it ends, `rank <local rank> gone` when it ended without a word (kill -9, a crash, the
# kernel's OOM killer: the kernel closed its connection to the agent at once). The agent
# writes BYE when it ends in order; a connection closed without it means the container
# ended (its status says how), one that stays open without a beat that the pod's node or
# its network stopped (kubetrain.trainer.lifeline, kubetrain.operator.lifeline_watch). One
# connection a pod, whatever its processes: 1,000 nodes of 8 GPUs are 1,000 connections
# and 2,000 lines a second, not 8,000 and 16,000 (issue 53).
# Each trainer process tells its agent over the pod's own socket (`lifeline_socket`): first
# `rank <local rank>`, then, as it ends in order, its `end` line (`end_line`).
# Trainer images from before issue 53 serve one lifeline per process instead, on the
# metrics port + 1 + its local rank, writing `beat`s and its own `end` line, then closing
# (no POD_LIFELINE first); the operator still follows those per process.
LIFELINE_BEAT_SECONDS: Final = 0.5
BEAT: Final = b"beat\n"
POD_LIFELINE: Final = b"pod\n"
BYE: Final = b"bye\n"
# The `end` class of a rank that failed only because a peer vanished under a collective: a
# consequence of another rank's failure, which the operator does not count again.
PEER_LOST: Final = "PeerLost"


def lifeline_port(metrics_port: int, local_rank: int = 0) -> int:
    """The port of a worker pod's lifeline: the one after spec.metrics.port (and, in trainer
    images from before issue 53, that of its trainer process of `local_rank`)."""
    return metrics_port + 1 + local_rank


def lifeline_socket(agent_pid: int) -> str:
    """The pod's own socket where its trainer processes reach their agent's lifeline: an
    abstract Unix socket (no file; one network namespace per pod), named by the agent."""
    return f"\0kubetrain-lifeline-{agent_pid}"


def rank_line(local_rank: int, end: bytes | None) -> bytes:
    """The pod lifeline's line for its process of `local_rank` that ended with `end` (an
    `end_line`), or without a word (None)."""
    return f"rank {local_rank} ".encode() + (end if end is not None else b"gone\n")


def parse_rank_line(line: bytes) -> tuple[int, bytes | None] | None:
    """(local rank, its `end` line or None for no word) of a `rank_line`; None for any other
    line."""
    parts = line.split(b" ", 2)
    if len(parts) < 3 or parts[0] != b"rank" or not parts[1].isdigit():
        return None
    said = parts[2].rstrip(b"\n")
    return int(parts[1]), (None if said == b"gone" else said + b"\n")


def end_line(exit_code: int, failure_class: str, words: str = "") -> bytes:
    """A lifeline's last line: how the trainer process ends."""
    text = " ".join(words.split())  # one line
    return f"end {exit_code} {failure_class} {text}".rstrip().encode() + b"\n"


def parse_end_line(line: bytes) -> tuple[int, str, str] | None:
    """(exit code, class, words) of an `end` line; None for any other line."""
    parts = line.decode(errors="replace").strip().split(" ", 3)
    if len(parts) < 3 or parts[0] != "end":
        return None
    try:
        code = int(parts[1])
    except ValueError:
        return None
    return code, parts[2], parts[3] if len(parts) > 3 else ""


# --- the trainer's metrics, as the operator reads them ----------------------------------

# Rank 0 serves these on spec.metrics.port (/metrics) and leaves their last values in its
# termination message (kubetrain.trainer.metrics); the operator reads both with one parser
# (kubetrain.operator.pod_facts.metrics_sample). Counters' samples end in `_total`.
METRIC_PREFIX: Final = "kubetrain_"
METRIC_STEP: Final = "kubetrain_step"
METRIC_MAX_STEPS: Final = "kubetrain_max_steps"
METRIC_EPOCH: Final = "kubetrain_epoch"
METRIC_LOSS: Final = "kubetrain_loss"
METRIC_CE_LOSS: Final = "kubetrain_ce_loss"
METRIC_KD_LOSS: Final = "kubetrain_kd_loss"
METRIC_TOKENS_PER_SECOND: Final = "kubetrain_tokens_per_second"
METRIC_LAST_STEP_TIME: Final = "kubetrain_last_step_timestamp_seconds"
METRIC_CHECKPOINT_STEP: Final = "kubetrain_latest_checkpoint_step"
METRIC_CHECKPOINT_TIME: Final = "kubetrain_latest_checkpoint_timestamp_seconds"
METRIC_BEST_CHECKPOINT_STEP: Final = "kubetrain_best_checkpoint_step"
METRIC_BEST_CHECKPOINT_VALIDATION_LOSS: Final = "kubetrain_best_checkpoint_validation_loss"
METRIC_STEP_TIME: Final = "kubetrain_step_time_seconds"
METRIC_WALL_TIME: Final = "kubetrain_wall_time_seconds"  # a counter, label `cause`
METRIC_CHECKPOINT_LOAD_TIME: Final = "kubetrain_checkpoint_load_seconds"  # label `tier`
# Each rank's timing over the last logged interval, gathered to rank 0 (labels rank,
# pod_name, node): what the straggler rule judges (kubetrain.operator.stragglers).
METRIC_RANK_COMPUTE: Final = "kubetrain_rank_compute_seconds"
METRIC_RANK_COMPUTE_TOTAL: Final = "kubetrain_rank_compute_time_seconds_total"
METRIC_RANK_WAIT: Final = "kubetrain_rank_wait_seconds"
METRIC_RANK_TIMING_STEP: Final = "kubetrain_rank_timing_step"
# spec.faultTolerance: the replica groups in the last step's quorum, and the samples passed
# over (absent groups' shares, uncommitted steps) since this group started.
METRIC_REPLICA_GROUPS: Final = "kubetrain_replica_groups_participating"
METRIC_SKIPPED_SAMPLES: Final = "kubetrain_replica_skipped_samples"


def counter_sample(counter: str) -> str:
    """The name of a counter's sample in the exposition (prometheus_client adds `_total`)."""
    return f"{counter}_total"


# --- the termination message: why a worker ended ----------------------------------------

# A failed trainer's first line (any rank): its class, words, micro-batch and, for a failed
# preflight, the nodes at fault (kubetrain.trainer.metrics.record_failure).
FAILURE_INFO: Final = "kubetrain_worker_failure_info"
# The own-code entry's line naming the checkpoint folders it found but did not upload,
# because nobody marked them complete (kubetrain.trainer.own_code).
UNMARKED_CHECKPOINTS_INFO: Final = "kubetrain_unmarked_checkpoints_info"
TERMINATION_MESSAGE_LIMIT: Final = 4096  # bytes the kubelet keeps
FAILURE_MESSAGE_CHARACTERS: Final = 1500  # of the trainer's words, in its failure line


@dataclass(frozen=True)
class TrainerFailure:
    """What a trainer that failed said about it in its termination message."""

    failure_class: str
    message: str = ""
    micro_batch_size: int | None = None
    # PreflightFailed: the nodes (Kubernetes node names) whose ranks failed the check, and
    # when some failing rank's node is unknown to the trainer (it never reported), the
    # nodes of the ranks that did report: the failing ones are the group's other nodes.
    nodes: tuple[str, ...] = ()
    reported_nodes: tuple[str, ...] = ()


def label_value(value: str) -> str:
    """A Prometheus label value, escaped (backslash, quote, newline)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def failure_line(failure_class: str, message: str, micro_batch_size: int,
                 nodes: Sequence[str] = (), reported_nodes: Sequence[str] = ()) -> str:
    """The termination message's failure line: `nodes` and `reported_nodes` as the labels of
    those names, each left out when empty."""
    return (f'{FAILURE_INFO}{{class="{label_value(failure_class)}",'
            f'message="{label_value(message[:FAILURE_MESSAGE_CHARACTERS])}",'
            f'micro_batch_size="{micro_batch_size}"'
            + (f',nodes="{label_value(",".join(nodes))}"' if nodes else "")
            + (f',reported_nodes="{label_value(",".join(reported_nodes))}"'
               if reported_nodes else "") + "} 1")


def unmarked_checkpoints_line(folders: Sequence[str]) -> str:
    """The own-code entry's line naming the folders it did not upload."""
    return f'{UNMARKED_CHECKPOINTS_INFO}{{folders="{",".join(folders)}"}} {len(folders)}'


def _names(listed: str) -> tuple[str, ...]:
    """A label's comma-separated names."""
    return tuple(name.strip() for name in listed.split(",") if name.strip())


def _info_samples(termination_message: str | None, name: str) -> list[dict[str, str]]:
    """The labels of each `name` sample in a termination message (the exposition format)."""
    if not termination_message or name not in termination_message:
        return []
    # Both readers have prometheus_client (the operator's and the trainer's extras); the
    # core's base install never reads a termination message.
    from prometheus_client.parser import text_string_to_metric_families

    try:
        families = list(text_string_to_metric_families(termination_message))
    except ValueError:
        return []
    return [dict(sample.labels) for family in families for sample in family.samples
            if sample.name == name]


def trainer_failure(termination_message: str | None) -> TrainerFailure | None:
    """The failure line of a trainer's termination message, if it wrote one."""
    for labels in _info_samples(termination_message, FAILURE_INFO):
        if "class" in labels:
            micro = labels.get("micro_batch_size", "")
            return TrainerFailure(labels["class"], labels.get("message", ""),
                                  int(micro) if micro.isdigit() else None,
                                  _names(labels.get("nodes", "")),
                                  _names(labels.get("reported_nodes", "")))
    return None


def unmarked_checkpoints(termination_message: str | None) -> tuple[str, ...]:
    """The folders an own-code pod's entry names as never marked complete, if any."""
    for labels in _info_samples(termination_message, UNMARKED_CHECKPOINTS_INFO):
        return _names(labels.get("folders", ""))
    return ()


# --- own code's progress reports: Kubeflow Trainer's trainerStatus ----------------------

# The variables a reporter reads (Kubeflow Trainer's names): the endpoint's whole URL, the
# path of its CA certificate (https only) and of the job's bearer token.
SERVER_URL_ENV: Final = "KUBEFLOW_TRAINER_SERVER_URL"
CA_CERT_ENV: Final = "KUBEFLOW_TRAINER_SERVER_CA_CERT"
TOKEN_ENV: Final = "KUBEFLOW_TRAINER_SERVER_TOKEN"
# The metrics of a report that say the progress: transformers' KubeflowCallback's names,
# which kubetrain.sdk.report sends too (with `tokens`).
REPORT_STEP: Final = "current_step"
REPORT_TOTAL_STEPS: Final = "total_steps"
REPORT_LOSS: Final = "loss"
REPORT_LEARNING_RATE: Final = "learning_rate"
REPORT_EPOCH: Final = "current_epoch"
REPORT_TOKENS: Final = "tokens"
REPORT_TOKENS_PER_SECOND: Final = "tokens_per_second"
# Posted by kubetrain's own-code entry once it restored a checkpoint, before the command
# starts: the step this attempt resumes from. A report with it carries no progress.
REPORT_RESUMED_STEP: Final = "resumed_step"
# Kubeflow's bounds: the body, at most 256 metrics, names and values 1-64 characters, int32.
MAX_REPORT_BYTES: Final = 64 * 1024
MAX_METRICS: Final = 256
MAX_METRIC_TEXT: Final = 64
MAX_INT32: Final = 2**31 - 1


class Refused(Exception):
    """A request an endpoint answers with a 4xx: its HTTP status, reason and headers."""

    def __init__(self, status: int, reason: str, headers: Mapping[str, str] | None = None
                 ) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.headers = dict(headers or {})


@dataclass(frozen=True)
class Report:
    """One progress report, as a job's pod sent it.

    `step` and `total_steps` come from the metrics `current_step` and `total_steps`;
    `loss` may be NaN or infinite (a diverged run still reports its step). `reported_at`
    is the pod's `lastUpdatedTime`, on its own clock (None: the report had none);
    `received_at` is the receiver's. `resumed_step` is the checkpoint's step an attempt
    resumed from, in the report kubetrain's entry posts before the command starts (and in
    none other). The receiver sets the rest (`StatusReports.record`): `redone_until`, the
    furthest step an earlier attempt of the job reported, which this attempt trains again
    (None: no step went back yet); and for each report of an attempt whose resume was
    reported, `resumed_step` and `first_step`, the first step the attempt reported.
    """

    step: int | None
    total_steps: int | None
    loss: float | None
    learning_rate: float | None
    epoch: float | None
    progress_percent: int | None
    remaining_seconds: int | None
    metrics: Mapping[str, str]
    reported_at: datetime | None
    received_at: datetime
    redone_until: int | None = None
    resumed_step: int | None = None
    first_step: int | None = None


def _invalid(reason: str) -> Refused:
    return Refused(422, reason)


def _integer(status: Mapping[str, Any], name: str, high: int) -> int | None:
    value = status.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
        raise _invalid(f"trainerStatus.{name} must be an integer from 0 to {high}, "
                       f"got {value!r}")
    return value


def _metrics(status: Mapping[str, Any]) -> dict[str, str]:
    items = status.get("metrics")
    if items is None:
        return {}
    if not isinstance(items, list):
        raise _invalid("trainerStatus.metrics must be a list of {name, value} objects")
    if len(items) > MAX_METRICS:
        raise _invalid(f"trainerStatus.metrics has {len(items)} entries, "
                       f"at most {MAX_METRICS} are allowed")
    metrics: dict[str, str] = {}
    for index, item in enumerate(items):
        where = f"trainerStatus.metrics[{index}]"
        if not isinstance(item, dict):
            raise _invalid(f"{where} must be an object with string fields name and value")
        for key in ("name", "value"):
            text = item.get(key)
            if not isinstance(text, str) or not 1 <= len(text) <= MAX_METRIC_TEXT:
                raise _invalid(f"{where}.{key} must be a string of 1 to {MAX_METRIC_TEXT} "
                               f"characters, got {text!r:.80}")
        metrics[item["name"]] = item["value"]
    return metrics


def _metric_integer(metrics: Mapping[str, str], name: str) -> int | None:
    text = metrics.get(name)
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        raise _invalid(f"metric {name} must be a whole number, got {text!r}") from None
    if not 0 <= value <= MAX_INT32:
        raise _invalid(f"metric {name} must be from 0 to {MAX_INT32}, got {value}")
    return value


def metric_number(metrics: Mapping[str, str], name: str) -> float | None:
    """A report's metric `name` as a number (None: absent). Raises `Refused` (422)."""
    text = metrics.get(name)
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        raise _invalid(f"metric {name} must be a number, got {text!r}") from None


def _timestamp(status: Mapping[str, Any]) -> datetime | None:
    text = status.get("lastUpdatedTime")
    if text is None:
        return None
    if not isinstance(text, str):
        raise _invalid(LAST_UPDATED_REQUIRED)
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise _invalid(f"trainerStatus.lastUpdatedTime is not an RFC 3339 time: "
                       f"{text!r:.80}") from None
    if moment.tzinfo is None:
        raise _invalid(f"trainerStatus.lastUpdatedTime must name its time zone "
                       f"(Z or +00:00): {text!r}")
    return moment.astimezone(UTC)


LAST_UPDATED_REQUIRED: Final = ("trainerStatus.lastUpdatedTime is required: an RFC 3339 time "
                                "such as 2026-01-23T10:30:45Z")


def parse_report(body: bytes, received_at: datetime) -> Report | None:
    """The `Report` in a request body, read as Kubeflow's schema says; None for a body
    without `trainerStatus`, which Kubeflow accepts and ignores. Raises `Refused` (400 or
    422) with the reason. The one reading of a report: the operator's endpoint and
    `kubetrain run`'s both call it (the operator also requires lastUpdatedTime)."""
    try:
        document = json.loads(body)
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError is a ValueError
        raise Refused(400, f"the body is not JSON: {error}"[:300]) from None
    if not isinstance(document, dict):
        raise Refused(400, 'the body must be a JSON object: {"trainerStatus": {...}}')
    status = document.get("trainerStatus")
    if status is None:
        return None
    if not isinstance(status, dict):
        raise _invalid("trainerStatus must be an object")
    metrics = _metrics(status)
    epoch = metric_number(metrics, REPORT_EPOCH)
    return Report(
        step=_metric_integer(metrics, REPORT_STEP),
        total_steps=_metric_integer(metrics, REPORT_TOTAL_STEPS),
        loss=metric_number(metrics, REPORT_LOSS),
        learning_rate=metric_number(metrics, REPORT_LEARNING_RATE),
        epoch=epoch if epoch is not None else metric_number(metrics, "epoch"),
        progress_percent=_integer(status, "progressPercentage", 100),
        remaining_seconds=_integer(status, "estimatedRemainingSeconds", MAX_INT32),
        metrics=metrics,
        reported_at=_timestamp(status),
        received_at=received_at,
        resumed_step=_metric_integer(metrics, REPORT_RESUMED_STEP),
    )
