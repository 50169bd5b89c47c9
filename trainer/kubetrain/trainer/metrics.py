"""What the trainer reports: Prometheus metrics, the JSONL metrics log, progress lines, trackers.

Only rank 0 reports (a `Reporter` on other ranks does nothing), so every number
here is the group's: the loss is the global mean, tokens per second the whole
group's throughput. The metric names are a contract with the operator (which
reads rank 0's `/metrics` into `status.progress`), the local runner (which reads
the metrics log) and the Helm chart's dashboard and alerts; `REGISTRY` is the
one registry they all come from.

MFU is model FLOPs (`sizing.flops_per_token` times tokens per second) over the peak
dense bf16 FLOP/s of the group's devices, taken from `PEAK_BF16_FLOPS` by device
name. CPUs and unknown accelerators have no meaningful peak: their MFU is
reported as 0. Memory figures come from the CUDA caching allocator and are 0 on CPU.

INL dynamics (`model.dynamics`) adds three gauges and distillation (`distillation`)
two (its loss's cross-entropy and KD terms), exported only by jobs that have them. The
dynamics': the mean equilibrium mu over every block's channels, and the mean beta and
the velocity's RMS over every block, token and channel of each rank's last micro-batch
of the logged step, averaged over ranks (the loop reduces them; see
`loop._dynamics_over_ranks`).

Per-rank timing (rank_timing.py) is the one exception to "the group's numbers": each
rank's compute and collective wait per step, gathered to rank 0 at logged steps and
exported labelled by rank, pod and node, so the operator can tell the rank the others
wait for.
"""

from __future__ import annotations

import io
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from threading import Thread
from typing import IO, Any, Protocol
from wsgiref.simple_server import WSGIServer

import torch
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kubetrain import protocol
from kubetrain.api.trainingjob import DEFAULT_MAX_STEPS, TrainingJobSpec
from kubetrain.pod_conventions import DEFAULT_TERMINATION_LOG, TERMINATION_LOG_ENV
from kubetrain.protocol import FAILURE_INFO, TERMINATION_MESSAGE_LIMIT, failure_line
from kubetrain.trainer.rank_timing import RankTiming

REGISTRY = CollectorRegistry()

STEP = Gauge(protocol.METRIC_STEP, "Last completed optimizer step.", registry=REGISTRY)
MAX_STEPS = Gauge(protocol.METRIC_MAX_STEPS, "Optimizer steps the job trains for (maxSteps, or "
                  "epochs converted to steps).", registry=REGISTRY)
EPOCH = Gauge(protocol.METRIC_EPOCH, "Passes over the training data at the last logged step, with "
              "the fraction of the current one.", registry=REGISTRY)
LOSS = Gauge(protocol.METRIC_LOSS, "Training loss (mean over the group's tokens) at the last "
             "logged step.", registry=REGISTRY)
VALIDATION_LOSS = Gauge("kubetrain_validation_loss", "Validation loss of the last evaluation.",
                        registry=REGISTRY)
LEARNING_RATE = Gauge("kubetrain_learning_rate", "Learning rate of the last step.",
                      registry=REGISTRY)
GRAD_NORM = Gauge("kubetrain_grad_norm", "Global gradient norm before clipping.",
                  registry=REGISTRY)
TOKENS_PER_SECOND = Gauge(protocol.METRIC_TOKENS_PER_SECOND, "Training throughput of the whole "
                          "group over the last log interval.", registry=REGISTRY)
MFU = Gauge("kubetrain_mfu_ratio", "Model FLOPs utilisation (0..1) against the devices' peak "
            "dense bf16 FLOP/s; 0 where the peak is unknown (CPU).", registry=REGISTRY)
STEP_DURATION = Histogram(
    "kubetrain_step_duration_seconds", "Host time of one optimizer step, data wait included "
    "(on a GPU, the time to queue its work: throughput is kubetrain_tokens_per_second).",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120), registry=REGISTRY,
)
DATA_WAIT = Gauge("kubetrain_data_wait_ratio", "Fraction of step time spent waiting for data "
                  "over the last log interval.", registry=REGISTRY)
MEMORY_ALLOCATED = Gauge("kubetrain_memory_allocated_bytes", "Peak device memory allocated by "
                         "tensors on rank 0 (0 on CPU).", registry=REGISTRY)
MEMORY_RESERVED = Gauge("kubetrain_memory_reserved_bytes", "Peak device memory reserved by the "
                        "caching allocator on rank 0 (0 on CPU).", registry=REGISTRY)
LAST_STEP_TIME = Gauge(protocol.METRIC_LAST_STEP_TIME, "Unix time the last step "
                       "finished: a stall shows as this not moving.", registry=REGISTRY)
RESTARTS = Gauge("kubetrain_restarts", "Times torchrun restarted this worker group "
                 "(TORCHELASTIC_RESTART_COUNT).", registry=REGISTRY)
CHECKPOINT_STEP = Gauge(protocol.METRIC_CHECKPOINT_STEP, "Step of the newest committed "
                        "checkpoint.", registry=REGISTRY)
CHECKPOINT_TIME = Gauge(protocol.METRIC_CHECKPOINT_TIME, "Unix time the newest "
                        "checkpoint was committed.", registry=REGISTRY)
BEST_CHECKPOINT_STEP = Gauge(protocol.METRIC_BEST_CHECKPOINT_STEP, "Step of the checkpoint "
                             "with the lowest validation loss (checkpoint.keepBest); 0: none "
                             "yet.", registry=REGISTRY)
BEST_CHECKPOINT_VALIDATION_LOSS = Gauge(protocol.METRIC_BEST_CHECKPOINT_VALIDATION_LOSS,
                                        "Validation loss of that checkpoint.", registry=REGISTRY)
TOKENS = Counter("kubetrain_tokens", "Tokens trained on by the group since this process "
                 "started.", registry=REGISTRY)
STEP_TIME = Gauge(protocol.METRIC_STEP_TIME, "Mean wall time of one step over the last "
                  "log interval (the operator's ETA).", registry=REGISTRY)
# Goodput (goodput.py): cumulative over the job's restarts, so after a restart the counter
# starts again from the checkpoint's totals (a counter reset, which rate() handles).
WALL_TIME = Counter(protocol.METRIC_WALL_TIME, "Wall time since the job first started, "
                    "by where it went: cause=\"productive\" is goodput, the others badput.",
                    ["cause"], registry=REGISTRY)
CHECKPOINT_LOAD_TIME = Counter(protocol.METRIC_CHECKPOINT_LOAD_TIME, "Wall time's "
                               "cause=\"checkpoint_load\" by the tier the resumed checkpoint "
                               "came from: memory (the ranks' own in-memory snapshots), "
                               "partner (some parts from a partner's copy), s3.", ["tier"],
                               registry=REGISTRY)
GOODPUT = Gauge("kubetrain_goodput_ratio", "Productive step time over wall time since the job "
                "first started (0..1), restarts included.", registry=REGISTRY)



@dataclass(frozen=True)
class DynamicsReport:
    """The INL dynamics' state at a logged step, reduced over blocks and ranks."""

    equilibrium_mean: float  # mean mu
    beta_mean: float
    velocity_rms: float


class _JobGauges(Collector):
    """Gauges that only some jobs have: no series at all until such a job logs a step, so
    other jobs' /metrics carry neither a misleading 0 nor a stale value."""

    def __init__(self, help: dict[str, str]) -> None:
        self.help = help
        self.values: tuple[float, ...] | None = None  # one per gauge, in help's order

    def describe(self) -> list[GaugeMetricFamily]:
        return []

    def collect(self) -> list[GaugeMetricFamily]:
        if self.values is None:
            return []
        return [GaugeMetricFamily(name, text, value=value)
                for (name, text), value in zip(self.help.items(), self.values, strict=True)]


DYNAMICS = _JobGauges({
    "kubetrain_dynamics_equilibrium_mean": "INL dynamics: mean of the learned equilibrium "
    "mu over every block's channels.",
    "kubetrain_dynamics_beta_mean": "INL dynamics: mean restoring gain beta over every "
    "block, token and channel of the last logged step's last micro-batch (0..betaMax).",
    "kubetrain_dynamics_velocity_rms": "INL dynamics: root mean square of the velocity "
    "over every block, token and channel of the last logged step's last micro-batch.",
})
DISTILLATION = _JobGauges({
    protocol.METRIC_CE_LOSS: "Knowledge distillation (spec.distillation): the cross-entropy on "
    "the labels at the last logged step.",
    protocol.METRIC_KD_LOSS: "Knowledge distillation: T^2 x KL(teacher || student) at the last "
    "logged step; kubetrain_loss is (1 - alpha) x ce + alpha x kd.",
})
# spec.faultTolerance (fault_tolerance.py): the quorum this group last stepped in.
REPLICA_GROUPS = _JobGauges({
    protocol.METRIC_REPLICA_GROUPS: "Replica groups in the last step's quorum "
    "(spec.faultTolerance).",
    protocol.METRIC_SKIPPED_SAMPLES: "Samples passed over since this group started: the "
    "slots of groups absent from a step's quorum, and steps that did not commit "
    "(spec.faultTolerance).",
})
REGISTRY.register(DYNAMICS)
REGISTRY.register(DISTILLATION)
REGISTRY.register(REPLICA_GROUPS)

RANK_COMPUTE = protocol.METRIC_RANK_COMPUTE
RANK_COMPUTE_TOTAL = protocol.METRIC_RANK_COMPUTE_TOTAL
RANK_WAIT = protocol.METRIC_RANK_WAIT
RANK_TIMING_STEP = protocol.METRIC_RANK_TIMING_STEP


class _RankTimings(Collector):
    """Each rank's compute and wait per step over the last log interval, by rank, pod and node.

    The whole set is replaced at each logged step: after a rescale, ranks that no longer
    exist (or moved to another pod) leave /metrics instead of keeping a stale series.
    """

    def __init__(self) -> None:
        self.ranks: tuple[RankTiming, ...] = ()
        self.step = 0  # the logged step whose interval they describe

    def describe(self) -> list[GaugeMetricFamily]:
        return []

    def collect(self) -> list[GaugeMetricFamily | CounterMetricFamily]:
        if not self.ranks:
            return []
        # Not `pod`: Prometheus' scrape puts its own `pod` label on every series.
        labels = ["rank", "pod_name", "node"]
        compute = GaugeMetricFamily(
            RANK_COMPUTE, "Mean seconds per step each rank spent computing (not waiting in "
            "collectives) over the last log interval.", labels=labels)
        wait = GaugeMetricFamily(
            RANK_WAIT, "Mean seconds per step each rank spent waiting in collectives (for "
            "the other ranks) over the last log interval.", labels=labels)
        total = CounterMetricFamily(
            RANK_COMPUTE_TOTAL.removesuffix("_total"), "Seconds each rank spent computing "
            "since its process started, as of the last logged step: a reader that samples "
            "now and then judges the compute time between its samples, every step of it.",
            labels=labels)
        for timing in self.ranks:
            values = [str(timing.rank), timing.pod, timing.node]
            compute.add_metric(values, timing.compute_seconds)
            wait.add_metric(values, timing.wait_seconds)
            total.add_metric(values, timing.compute_seconds_total)
        # Tells a reader (the operator's straggler rule) one interval from the next.
        step = GaugeMetricFamily(RANK_TIMING_STEP, "The logged step whose interval the "
                                 "per-rank timings describe.", value=self.step)
        return [compute, wait, total, step]


RANK_TIMINGS = _RankTimings()
REGISTRY.register(RANK_TIMINGS)

# Peak dense bf16 FLOP/s per device, matched against torch.cuda.get_device_name() in order.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
)


def peak_flops(device: torch.device) -> float:
    """Peak dense bf16 FLOP/s of one `device`; 0.0 when unknown (every CPU)."""
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in name), 0.0)


@dataclass(frozen=True)
class StepReport:
    """One logged step, already reduced over the group."""

    step: int
    epoch: float
    loss: float
    learning_rate: float
    grad_norm: float
    tokens_per_second: float
    mfu: float
    step_time: float
    data_wait_ratio: float
    dynamics: DynamicsReport | None = None  # jobs with model.dynamics only
    # Knowledge distillation only: the loss's two terms (loss = (1 - alpha) ce + alpha kd).
    ce_loss: float | None = None
    kd_loss: float | None = None
    ranks: tuple[RankTiming, ...] = ()  # every rank's compute and wait, by rank


def _append_on_a_new_line(path: Path) -> IO[str]:
    """`path` opened to append lines, line-buffered for the readers that tail it. A run that
    ended mid-line (a full disk, a lost node) left a torn last line: the first record of
    this run starts on a line of its own, so readers lose only the torn one."""
    log = path.open("a+b")
    size = log.seek(0, os.SEEK_END)
    if size:
        log.seek(size - 1)
        if log.read(1) != b"\n":
            log.write(b"\n")  # append mode: written at the end, wherever the reads were
    return io.TextIOWrapper(log, encoding="utf-8", line_buffering=True)


class Reporter:
    """Rank 0's outlet for every figure of the run; a silent no-op on other ranks."""

    def __init__(self, spec: TrainingJobSpec, *, enabled: bool, metrics_log: Path,
                 job_name: str, serve: bool = True, max_steps: int | None = None) -> None:
        self.enabled = enabled
        # The trainer passes the steps it resolved (epochs become steps once it reads the data).
        self.max_steps = (max_steps if max_steps is not None
                          else spec.optimization.max_steps or DEFAULT_MAX_STEPS)
        self._log: IO[str] | None = None
        self._server: tuple[WSGIServer, Thread] | None = None
        self._trackers: list[_Tracker] = []
        if not enabled:
            return
        metrics_log.parent.mkdir(parents=True, exist_ok=True)
        self._log = _append_on_a_new_line(metrics_log)
        # `*_created` series carry only the process start time, which the restarts and
        # last-step gauges already tell; without them /metrics has exactly the documented names.
        disable_created_metrics()
        if serve:
            try:
                self._server = start_http_server(spec.metrics.port, registry=REGISTRY)
            except OSError as error:
                raise OSError(f"cannot serve /metrics on spec.metrics.port "
                              f"{spec.metrics.port}: {error.strerror}; pick a free port") from None
        MAX_STEPS.set(self.max_steps)
        # A job without dynamics or a teacher exports no such series.
        DYNAMICS.values = DISTILLATION.values = None
        RANK_TIMINGS.ranks = ()  # this attempt's membership only
        RESTARTS.set(int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
        self._trackers = _open_trackers(spec, job_name)

    # --- events -------------------------------------------------------------------------

    def started(self, step: int, world_size: int, output_loss: str = "", why: str = "") -> None:
        """The loop begins; `output_loss` names the loss implementation chosen (loss.py)."""
        if not self.enabled:
            return
        STEP.set(step)
        self._event("start", step=step, max_steps=self.max_steps, world_size=world_size,
                    output_loss=output_loss)
        self._print(f"training from step {step} to {self.max_steps} with {world_size} processes")
        if output_loss:
            self._print(f"output projection and loss: {output_loss} ({why})")

    def resumed(self, step: int, uri: str, world_size: int,
                redone_through: int | None = None) -> None:
        """Training goes on from the checkpoint of `step`. `redone_through` is the step of
        the earlier attempt's last heartbeat past it: goodput books the steps up to it as
        lost progress (`oom` after an out-of-memory restart) and the time after it as
        downtime (goodput.py)."""
        self._event("resumed", step=step, uri=uri, world_size=world_size,
                    redone_through=redone_through)
        self._print(f"resumed from {uri} at step {step} with {world_size} processes")
        # On a line of its own: the line above keeps the shape that readers of the log match.
        if redone_through is not None and redone_through > step:
            self._print(f"steps {step + 1}-{redone_through} are trained again (after the "
                        f"checkpoint, before the restart)")

    def healed(self, step: int, groups: int) -> None:
        """A replica group came back (or fell behind) and took a live group's state, that
        of `step`, from one of the `groups` that trained on meanwhile (spec.faultTolerance)."""
        self._event("healed", step=step, groups=groups)
        self._print(f"healed from a live replica group at step {step} ({groups} live "
                    f"group{'s' if groups != 1 else ''} in the quorum): no checkpoint read")

    def quorum(self, step: int, groups: int, of: int, skipped_samples: int) -> None:
        """The groups in a step's quorum changed (spec.faultTolerance)."""
        REPLICA_GROUPS.values = (groups, skipped_samples)
        self._event("quorum", step=step, groups=groups, of=of,
                    skipped_samples=skipped_samples)
        self._print(f"step {step}: {groups} of {of} replica groups in the quorum "
                    f"({skipped_samples} samples passed over so far)")

    def initialised(self, uri: str) -> None:
        self._event("initialised", uri=uri)
        self._print(f"initialised from the pretrained weights at {uri}")

    def stepped(self, step: int, tokens: int, step_time: float) -> None:
        """Every step: the cheap, always-current figures (step, time, tokens)."""
        if not self.enabled:
            return
        STEP.set(step)
        LAST_STEP_TIME.set(time.time())
        STEP_DURATION.observe(step_time)
        TOKENS.inc(tokens)

    def logged(self, report: StepReport, device: torch.device) -> None:
        """Every `logEverySteps`: loss, throughput and the rest, everywhere they go."""
        if not self.enabled:
            return
        LOSS.set(report.loss)
        EPOCH.set(report.epoch)
        LEARNING_RATE.set(report.learning_rate)
        GRAD_NORM.set(report.grad_norm)
        TOKENS_PER_SECOND.set(report.tokens_per_second)
        MFU.set(report.mfu)
        DATA_WAIT.set(report.data_wait_ratio)
        STEP_TIME.set(report.step_time)
        distillation: dict[str, float] = {}
        if report.ce_loss is not None and report.kd_loss is not None:
            distillation = {"ce_loss": report.ce_loss, "kd_loss": report.kd_loss}
            DISTILLATION.values = (report.ce_loss, report.kd_loss)
        if report.ranks:
            RANK_TIMINGS.ranks, RANK_TIMINGS.step = report.ranks, report.step
        if device.type == "cuda":
            MEMORY_ALLOCATED.set(torch.cuda.max_memory_allocated(device))
            MEMORY_RESERVED.set(torch.cuda.max_memory_reserved(device))
        dynamics: dict[str, float] = {}
        if report.dynamics is not None:
            DYNAMICS.values = (report.dynamics.equilibrium_mean, report.dynamics.beta_mean,
                               report.dynamics.velocity_rms)
            dynamics = {"dynamics_mu_mean": report.dynamics.equilibrium_mean,
                        "dynamics_beta_mean": report.dynamics.beta_mean,
                        "dynamics_velocity_rms": report.dynamics.velocity_rms}
        self._event("step", step=report.step, max_steps=self.max_steps,
                    epoch=round(report.epoch, 4), loss=report.loss, **distillation,
                    lr=report.learning_rate, grad_norm=report.grad_norm,
                    tokens_per_second=report.tokens_per_second, mfu=report.mfu,
                    step_time=report.step_time, data_wait_ratio=report.data_wait_ratio,
                    **dynamics, ranks=[
                        {"rank": timing.rank, "pod_name": timing.pod, "node": timing.node,
                         "compute_seconds": timing.compute_seconds,
                         "wait_seconds": timing.wait_seconds} for timing in report.ranks])
        self._print(
            f"step {report.step}/{self.max_steps} | epoch {report.epoch:.2f} | "
            f"loss {report.loss:.4f} | "
            + "".join(f"{name.removesuffix('_loss')} {value:.4f} | "
                      for name, value in distillation.items())
            + f"lr {report.learning_rate:.2e} | grad {report.grad_norm:.3f} | "
            f"{report.tokens_per_second:,.0f} tok/s | mfu {report.mfu:.1%} | "
            f"{report.step_time * 1000:.0f} ms/step | data wait {report.data_wait_ratio:.1%}"
            + (f" | mu {report.dynamics.equilibrium_mean:.3g} beta "
               f"{report.dynamics.beta_mean:.3f} v rms {report.dynamics.velocity_rms:.3g}"
               if report.dynamics is not None else "")
        )
        for tracker in self._trackers:
            tracker.log(report.step, {"loss": report.loss, **distillation,
                                      "lr": report.learning_rate,
                                      "grad_norm": report.grad_norm,
                                      "tokens_per_second": report.tokens_per_second,
                                      "mfu": report.mfu, **dynamics})

    def evaluated(self, step: int, val_loss: float) -> None:
        if not self.enabled:
            return
        perplexity = math.exp(min(val_loss, 700.0))  # exp overflows a float beyond ~709
        VALIDATION_LOSS.set(val_loss)
        self._event("eval", step=step, val_loss=val_loss, perplexity=perplexity)
        self._print(f"eval at step {step} | val loss {val_loss:.4f} | perplexity {perplexity:.2f}")
        for tracker in self._trackers:
            tracker.log(step, {"val_loss": val_loss, "perplexity": perplexity})

    def checkpointed(self, step: int, uri: str, committed_at: float, *,
                     val_loss: float | None = None, best: bool = False) -> None:
        """A committed checkpoint (called from the checkpointer's thread for async saves);
        `best`: the one with the lowest validation loss so far, kept (keepBest)."""
        if not self.enabled:
            return
        CHECKPOINT_STEP.set(step)
        CHECKPOINT_TIME.set(committed_at)
        self._event("checkpoint", step=step, uri=uri, val_loss=val_loss, best=best)
        if best and val_loss is not None:
            self.kept_best(step, val_loss)
            self._print(f"step {step}: best checkpoint so far (val loss {val_loss:.4f}) at {uri}")

    def kept_best(self, step: int, val_loss: float) -> None:
        """The best checkpoint (keepBest): committed now, or found again on resuming."""
        if not self.enabled:
            return
        BEST_CHECKPOINT_STEP.set(step)
        BEST_CHECKPOINT_VALIDATION_LOSS.set(val_loss)

    def accounted(self, step: int, seconds: dict[str, float],
                  load_tiers: dict[str, float] | None = None) -> None:
        """The goodput ledger's totals by cause (cumulative since the job first started),
        and `load_tiers`, checkpoint_load's seconds by the tier it loaded from."""
        if not self.enabled:
            return
        for cause, total in seconds.items():
            # The counter is process-wide: add what the ledger booked since the last call.
            shown = REGISTRY.get_sample_value(protocol.counter_sample(protocol.METRIC_WALL_TIME),
                                              {"cause": cause}) or 0.0
            WALL_TIME.labels(cause).inc(max(0.0, total - shown))
        for tier, total in (load_tiers or {}).items():
            shown = REGISTRY.get_sample_value(
                protocol.counter_sample(protocol.METRIC_CHECKPOINT_LOAD_TIME),
                                              {"tier": tier}) or 0.0
            CHECKPOINT_LOAD_TIME.labels(tier).inc(max(0.0, total - shown))
        wall = sum(seconds.values())
        ratio = seconds.get("productive", 0.0) / wall if wall > 0 else 1.0
        GOODPUT.set(ratio)
        extra = {} if load_tiers is None else {"checkpoint_load_tiers": load_tiers}
        self._event("goodput", step=step, ratio=ratio, seconds=seconds, **extra)

    def finished(self, step: int, reason: str, best_val_loss: float | None,
                 export_uri: str | None, export_step: int | None = None,
                 export_format: str | None = None) -> None:
        """The run ended; `export_step` is the step whose weights were exported and
        `export_format` what reads them (`export.export_format`)."""
        self._event("finished", step=step, reason=reason, best_val_loss=best_val_loss,
                    export_uri=export_uri, export_step=export_step,
                    export_format=export_format)
        self._print(f"finished at step {step}: {reason}")

    def close(self) -> None:
        """Leave the termination message, stop serving /metrics, close the log and trackers."""
        if self.enabled:
            write_termination_message()
        if self._server is not None:
            server, thread = self._server
            server.shutdown()
            server.server_close()
            thread.join()
            self._server = None
        for tracker in self._trackers:
            tracker.close()
        self._trackers = []
        if self._log is not None:
            self._log.close()
            self._log = None

    # --- outlets ------------------------------------------------------------------------

    def _event(self, event: str, **fields: Any) -> None:
        if self._log is not None:
            self._log.write(json.dumps({"event": event, **fields, "time": time.time()}) + "\n")

    def _print(self, line: str) -> None:
        if self.enabled:
            print(line, file=sys.stdout, flush=True)


def termination_log() -> Path:
    """The container's terminationMessagePath: Kubernetes' default unless the env names one."""
    return Path(os.environ.get(TERMINATION_LOG_ENV, DEFAULT_TERMINATION_LOG))


# The line a failed trainer puts first in its termination message (any rank, not only 0),
# in the protocol's format: the operator and `kubetrain run` read its class
# (kubetrain.protocol.trainer_failure).
_failure_line: str | None = None


def record_failure(failure_class: str, message: str, micro_batch_size: int,
                   nodes: Sequence[str] = (), reported_nodes: Sequence[str] = ()) -> None:
    """Put why this process failed first in the termination message (any rank).

    `nodes` names the nodes at fault (a failed preflight's failing ranks'), as the label
    `nodes="node-a,node-b"`; `reported_nodes` (label `reported_nodes`) the nodes that
    passed their part, given when some failing rank's node is unknown. The line has
    neither label without them.

    Kept in the process too, so that rank 0's gauges, written when its reporter closes,
    keep the line ahead of them. Written only where the termination log exists (a pod,
    or a `kubetrain run` node).
    """
    global _failure_line
    _failure_line = failure_line(failure_class, message, micro_batch_size, nodes,
                                 reported_nodes)
    path = termination_log()
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines()
            if line and not line.startswith(FAILURE_INFO)]
    _write_lines(path, [_failure_line, *kept])


def _write_lines(path: Path, lines: list[str]) -> None:
    """Whole lines, in order, up to the kubelet's 4 KiB."""
    chosen, size = [], 0
    for line in lines:
        size += len(line.encode()) + 1
        if size > TERMINATION_MESSAGE_LIMIT:
            break
        chosen.append(line)
    path.write_text("\n".join(chosen) + "\n")


def write_termination_message() -> None:
    """Rank 0's last gauges, as /metrics lines, where the kubelet copies them into the pod.

    When the trainer exits, /metrics goes with it: a run that ends between two of the
    operator's scrapes would leave status.progress and latestCheckpoint short of the
    last step and the last checkpoint. The kubelet puts this file (4 KiB at most) into
    the container's terminated state, where the operator reads it with the same parser.
    Written only where the file exists: in a pod the kubelet creates it.
    """
    path = termination_log()
    if not path.is_file():
        return
    from prometheus_client import generate_latest

    # Another rank of the pod may have failed first: its line stays ahead of the gauges.
    lines = [_failure_line] if _failure_line else [
        line for line in path.read_text().splitlines() if line.startswith(FAILURE_INFO)][:1]
    for line in generate_latest(REGISTRY).decode().splitlines():
        # Gauges and counters only: a histogram's buckets would not fit.
        name = line.split("{")[0].split()[0] if line.strip() else ""
        if line.startswith(protocol.METRIC_PREFIX) and not name.endswith(
                ("_bucket", "_sum", "_count", "_created")):
            lines.append(line)
    _write_lines(path, lines)


class _Tracker(Protocol):
    """An experiment tracker that takes scalar dictionaries per step."""

    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class _TensorBoard:
    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, project: str, job_name: str, config: dict[str, Any]) -> None:
        import wandb  # optional; not in the base image

        self.run = wandb.init(project=project, name=job_name, config=config, resume="allow")

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


def _open_trackers(spec: TrainingJobSpec, job_name: str) -> list[_Tracker]:
    """The trackers the spec asks for whose package is installed; says so for the others."""
    tracking = spec.metrics.tracking
    trackers: list[_Tracker] = []
    if tracking.tensorboard:
        # Next to local checkpoints; in the working directory when they go to object storage.
        uri = spec.checkpoint.uri
        base = Path(uri.removeprefix("file://")) if "://" not in uri or uri.startswith(
            "file://") else Path.cwd()
        try:
            trackers.append(_TensorBoard(base / "tensorboard"))
        except ImportError:
            print("spec.metrics.tracking.tensorboard is true, but the tensorboard package is "
                  "not installed in this image: add `pip install tensorboard` to it. Training "
                  "goes on; metrics still reach Prometheus and the metrics log.", file=sys.stderr)
    if tracking.wandb_project:
        try:
            trackers.append(_WandB(tracking.wandb_project, job_name, spec.wire()))
        except ImportError:
            print("spec.metrics.tracking.wandbProject is set, but the wandb package is not "
                  "installed in this image: add `pip install wandb` to it. Training goes on; "
                  "metrics still reach Prometheus and the metrics log.", file=sys.stderr)
    return trackers
