"""The training loop and the `Trainer` API that runs it.

`Trainer(job).fit()` is what every worker pod runs (through `python -m
kubetrain.trainer`) and what a notebook calls: under torchrun it joins the
group; alone it trains as a group of one. Setup (`_build`) assembles the parts
each module owns - data (data.py), model (model.py), parallelism
(parallelize.py), optimizer and schedule (optim.py), checkpoints
(checkpoint.py), metrics (metrics.py) - and `_train` is the loop itself,
readable top to bottom, as torchtitan's `train` reads:

    stop agreed? → fetch micro-batches → forward/backward with accumulation
    → clip → optimizer step → LR schedule → metrics → maybe eval (early stopping)
    → maybe checkpoint

Its parts: `_resume` (the checkpoint, or the weights a job starts from), `_train_step`
(one optimizer step, torchtitan's `train_step`), `_log_interval` (the reduced metrics
of a logged interval) and `_finish` (the final checkpoint, the export). Rooms of their own:
what the loop measures (meters.py), validation (evaluation.py) and which failure class
an exception is (failure_classes.py).

Throughput: tokens/s, MFU and step time are measured over the wall time from
one logged step to the next, read after synchronising the device. On a GPU the
host only enqueues work, so timing each step on the host would count enqueue
time, not compute; the synchronisation is paid once per logged interval, not
per step. Intervals are contiguous from the first step on, so they add up to
the loop's wall time: evaluation and a checkpoint's blocking part count too,
as torchtitan counts them - the figure is what the job achieves.

Goodput: the ledger (goodput.py) is charged where one kind of time ends and the
next begins - after setup, loading, each step's data fetch and step, evaluation
and checkpoint saves - so every second of the attempt lands in exactly one cause;
`_account` exports the totals and writes the heartbeat at each logged step.

Loss normalisation: every micro-batch is full (the dataset packs sequences, no
padding), so each rank divides its summed token losses by its tokens per step;
gradient averaging over ranks then yields the mean over the global token count,
independent of how the global batch is split into ranks and micro-steps. With
`spec.distillation` (distill.py) each micro-batch first goes through the frozen
teacher, and the student's loss is (1 - alpha) CE + alpha T^2 KL, normalised the same
way; its two terms are logged beside it. Evaluation is the student's cross-entropy.

Stopping: SIGTERM/SIGINT only set a flag; at each step boundary the flag is
all-reduced, every rank saves the same checkpoint and `fit` returns exit code
143 on the signalled ranks and 75 ("restart me into the new membership") on the
others. A finished run (maxSteps or early stopping) saves, exports and returns 0.

Preflight: before joining the group each rank checks its device, and once the group
is formed, an all-reduce and each rank's links to its neighbours, and under a 2-D or 3-D
mesh an all-reduce over each dimension's group (preflight.py, `runPolicy.preflight`);
rank 0 prints the result and goodput books the time as `preflight`.

Failing: a device out of memory (torch.OutOfMemoryError), a GPU that failed
(`failure_classes.is_gpu_error`), a collective that timed out or a failed preflight is
written into the termination message with its class, the micro-batch and (out of memory on
CUDA) `kubetrain estimate`'s advice, and `fit` returns 87, 90, 88 or 89 at once
(`failure_classes.FAILURES`, one table from the error to its class, reason and exit code),
without the collective goodbyes its peers may never answer. For out of memory, a GPU error
and a failed preflight, a restart in place would meet the same micro-batch, the same GPU or the same
stalled peer, so the worker first asks its torchrun agent to stop
(`distributed.stop_torchrun_agent`) and the pod ends. The operator (or `kubetrain run`)
reads the class and, for out of memory, restarts the group with half the micro-batch:
the micro-batch the trainer uses is the job's `micro_batch_size` (status.effective's,
from the ConfigMap), with the accumulation grown to keep the spec's global batch.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from kubetrain.api.manifest import load_job
from kubetrain.api.trainingjob import ModelDims, TrainingJob, TrainingJobSpec
from kubetrain.protocol import (  # the exit codes and classes the operator reads
    ENDS_THE_POD,
    EXIT_COMPLETE,
    EXIT_RESTART,
    EXIT_SIGNALLED,
    PEER_LOST,
    TrainerFailureClass,
)
from kubetrain.trainer.architecture import build_model
from kubetrain.trainer.checkpoint import (
    Checkpointer,
    CheckpointInfo,
    ModelState,
    ModelWeights,
    RandomState,
)
from kubetrain.trainer.data import TokenDataset, build_datasets
from kubetrain.trainer.distill import Teacher, load_teacher
from kubetrain.trainer.distributed import (
    STORE_TIMEOUT,
    StopRequest,
    World,
    attempt_store,
    init_world,
    local_device,
    shutdown_world,
    stop_torchrun_agent,
)
from kubetrain.trainer.evaluation import evaluate
from kubetrain.trainer.export import export_format, export_model
from kubetrain.trainer.failure_classes import (
    FAILURES,
    failure_of,
    is_out_of_memory,
    is_peer_lost,
    out_of_memory_advice,
)
from kubetrain.trainer.fault_tolerance import ReplicaGroups, data_slot
from kubetrain.trainer.goodput import (
    CHECKPOINT_SAVE,
    DATA_WAIT,
    DEGRADED,
    EVALUATION,
    LOST_PROGRESS,
    PREFLIGHT,
    PRODUCTIVE,
    STARTUP,
    STRAGGLER,
    GoodputLedger,
    Heartbeat,
    attempt_started_at,
)
from kubetrain.trainer.lifeline import Lifeline
from kubetrain.trainer.loss import select_output_loss
from kubetrain.trainer.memory_checkpoint import MemoryCheckpoints, load_tier, open_memory_tier
from kubetrain.trainer.mesh import build_mesh, preflight_dimensions
from kubetrain.trainer.meters import (
    StepMeter,
    StepResult,
    dynamics_over_ranks,
    mean_over_ranks,
    synchronize,
)
from kubetrain.trainer.metrics import (
    Reporter,
    StepReport,
    record_failure,
)
from kubetrain.trainer.optim import build_optimizer, build_schedule
from kubetrain.trainer.parallelize import ParallelModel, parallelize
from kubetrain.trainer.preflight import Preflight, PreflightFailed, open_store, store_timeout
from kubetrain.trainer.pretrained import load_embeddings, load_pretrained
from kubetrain.trainer.pretrained_config import (
    PretrainedError,
    check_vocabulary,
    teacher_error,
    trained_model,
)
from kubetrain.trainer.rank_timing import (
    WaitClock,
    gather_rank_timings,
)
from kubetrain.trainer.staging import CopyStream, Staging
from kubetrain.trainer.storage import open_storage

# Why `fit` returned: the run finished (maxSteps, early stopping), a stop signal was agreed,
# or one of `FAILURES` ended the attempt.
# (The failures' reasons are failure_classes.FailureReason's; a test checks the two agree.)
FitReason = Literal["max_steps", "early_stopping", "signalled", "preflight_failed",
                    "out_of_memory", "gpu_error", "collective_timeout", "quorum_lost"]


@dataclass(frozen=True)
class FitResult:
    """How a `fit` ended."""

    step: int
    reason: FitReason
    exit_code: int
    best_val_loss: float | None
    export_uri: str | None
    # A SIGTERM or SIGINT came after the last step boundary, too late to stop the loop: the
    # run ended as if none had (its last checkpoint is saved), and whoever sent it is
    # ending this process.
    signal_unanswered: bool = False


class TrainProgress(Stateful):
    """The loop's own state that must survive a restart: early-stopping bookkeeping."""

    def __init__(self) -> None:
        self.best_val_loss = math.inf
        self.evals_without_improvement = 0

    def record(self, val_loss: float, min_delta: float) -> None:
        """Count an evaluation as an improvement only when it beats the best by min_delta."""
        if val_loss < self.best_val_loss - min_delta:
            self.evals_without_improvement = 0
        else:
            self.evals_without_improvement += 1
        self.best_val_loss = min(self.best_val_loss, val_loss)

    def state_dict(self) -> dict[str, Any]:
        return {"best_val_loss": self.best_val_loss,
                "evals_without_improvement": self.evals_without_improvement}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best_val_loss = float(state_dict["best_val_loss"])
        self.evals_without_improvement = int(state_dict["evals_without_improvement"])


@dataclass
class _Run:
    """Everything `_train` works with, assembled by `_build`."""

    world: World
    dims: ModelDims
    max_steps: int  # maxSteps, or epochs converted to steps
    parallel: ParallelModel
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    train_data: TokenDataset
    validation_data: TokenDataset | None
    progress: TrainProgress
    app_state: dict[str, Any]
    checkpointer: Checkpointer
    reporter: Reporter
    output_loss: tuple[str, str]  # the implementation's name, and why it was chosen
    goodput: GoodputLedger
    heartbeat: Heartbeat | None  # rank 0 only
    staging: Staging  # where both checkpoint tiers stage snapshots; the optimizer step waits
    teacher: Teacher | None = None  # spec.distillation's frozen teacher
    memory: MemoryCheckpoints | None = None  # spec.checkpoint.memory's in-memory tier
    replicas: ReplicaGroups | None = None  # spec.faultTolerance's groups (fault_tolerance.py)

    @property
    def writes_checkpoints(self) -> bool:
        """Whether this group saves the job's checkpoints: every job's one, or under
        faultTolerance the first group in the quorum (the others hold the same state)."""
        return self.replicas is None or self.replicas.writes_checkpoints

    def close(self, *, failed: bool = False) -> None:
        """Wait for a checkpoint in flight, stop prefetching, stop serving metrics. After a
        `failed` attempt an in-memory copy in flight is not waited for (a peer may be gone)."""
        try:
            if self.memory is not None:
                self.memory.close(abandon=failed)
            self.checkpointer.close()
        finally:
            if self.heartbeat is not None:
                self.heartbeat.close()
            self.train_data.close()
            if self.validation_data is not None:
                self.validation_data.close()
            self.reporter.close()
            if self.replicas is not None:
                self.replicas.close()


class Trainer:
    """Trains one TrainingJob: `Trainer("job.yaml").fit()`.

    `job` is a TrainingJob, its spec, or the path of a manifest. Metrics go to
    `metrics_log` (JSONL, rank 0; default `$KUBETRAIN_METRICS_LOG`, else
    metrics.jsonl in the working directory) and, when `serve_metrics`, to a
    Prometheus endpoint on `spec.metrics.port`.
    """

    def __init__(self, job: TrainingJob | TrainingJobSpec | str | Path, *,
                 metrics_log: str | Path | None = None, serve_metrics: bool = True,
                 copy_stream: CopyStream | None = None) -> None:
        """`copy_stream`: where the checkpoint tiers' staged copies run (staging.py); by
        default the device's own, a side stream on CUDA and in place on the CPU. A test
        gives a stand-in that defers them as a stream would."""
        if isinstance(job, str | Path):
            job = load_job(job)
        if isinstance(job, TrainingJob):
            self.spec, self.name = job.spec, job.metadata.name
            # An out-of-memory restart's smaller micro-batch (status.effective), if any.
            self.micro_batch_size = job.micro_batch_size
            effective = job.status.effective if job.status is not None else None
            self.out_of_memory_restarts = effective.out_of_memory_restarts if effective else 0
        else:
            self.spec, self.name = job, "kubetrain"
            self.micro_batch_size = job.optimization.micro_batch_size
            self.out_of_memory_restarts = 0
        self.metrics_log = Path(
            metrics_log or os.environ.get("KUBETRAIN_METRICS_LOG", "metrics.jsonl"))
        self.serve_metrics = serve_metrics
        self.copy_stream = copy_stream
        self._preflight: Preflight | None = None  # this attempt's check, once it started
        self._lifeline: Lifeline | None = None  # in a worker pod, while `fit` runs

    def fit(self) -> FitResult:
        """Train until maxSteps, early stopping or a stop signal; see the module docstring.

        A failure in `FAILURES` ends the attempt with its reason and exit code; any other
        error propagates. In a worker pod, this process then tells the pod's lifeline
        (lifeline.py) how it ended.
        """
        lifeline = self._lifeline = Lifeline.for_this_process()
        if lifeline is not None:
            lifeline.start()
        try:
            result = self._fit()
        except BaseException as error:
            if lifeline is not None:
                lifeline.end(1, PEER_LOST if is_peer_lost(error) else "Unknown",
                             f"{type(error).__name__}: {error}"[:300])
            raise
        if lifeline is not None:
            failure = next((f for f in FAILURES if f.reason == result.reason), None)
            lifeline.end(result.exit_code,
                         failure.failure_class if failure is not None else result.reason)
        return result

    def _fit(self) -> FitResult:
        # A group this call makes is this call's to end; a group the caller made, the caller's.
        leave_the_group = not dist.is_initialized()
        # The ledger starts before the preflight check, so that it books the check apart.
        goodput = GoodputLedger(attempt_started_at())
        try:
            world = self._join(goodput)
        except PreflightFailed as error:
            return self._preflight_failed(error)
        try:
            return self._attempt(world, goodput)
        except RuntimeError as error:  # torch.distributed's errors are RuntimeErrors too
            failure = failure_of(error)
            if failure is None:
                raise
            # A failed rank leaves the group by exiting: its peers may be blocked in a
            # collective that will never complete, and leaving politely would wait on them.
            leave_the_group = False
            self._record_failure(failure.failure_class, error, world)
            return FitResult(0, failure.reason, failure.exit_code, None, None)
        finally:
            if leave_the_group:
                shutdown_world()

    def _attempt(self, world: World, goodput: GoodputLedger) -> FitResult:
        """Build the run and train it; closed, and the stop handler removed, however it ends."""
        run = self._build(world, goodput)
        lifeline = self._lifeline
        # Given up on a peer that is gone: this rank's failure is that peer's, not its own.
        stop = StopRequest(on_give_up=None if lifeline is None else (
            lambda why: lifeline.end(EXIT_RESTART, PEER_LOST, why)))
        stop.install()
        with contextlib.ExitStack() as cleanup:
            # Last, after closing: until closed, a SIGTERM (the agent stopping) only sets the flag.
            cleanup.callback(stop.uninstall)
            failed = True  # until _train returns
            cleanup.callback(lambda: run.close(failed=failed))
            try:
                result = self._train(run, stop)
                failed = False
            except RuntimeError as error:
                if is_out_of_memory(error):
                    # The ledger as of now in the heartbeat: the restart with half the
                    # micro-batch books this attempt's time to goodput's `oom`.
                    run.goodput.charge(PRODUCTIVE)
                    self._account(run, run.goodput.step, final=True)
                raise
        if stop.signalled and result.reason != "signalled":
            return replace(result, signal_unanswered=True)
        return result

    def _join(self, goodput: GoodputLedger) -> World:
        """Join the group, inside the preflight check when `runPolicy.preflight` asks for it."""
        policy = self.spec.run_policy.preflight
        if not policy.enabled:
            return init_world()
        launched = not dist.is_initialized() and "WORLD_SIZE" in os.environ
        rank = int(os.environ["RANK"]) if launched else 0
        world_size = int(os.environ["WORLD_SIZE"]) if launched else 1
        goodput.charge(STARTUP)
        store = None
        if launched:  # bounded by the check's deadline: its host may be the stalled one
            store = open_store(policy, rank, attempt_store)
        check = Preflight(policy, rank=rank, world_size=world_size, device=local_device()[0],
                          store=store if world_size > 1 else None,
                          mesh=preflight_dimensions(self.spec, world_size))
        self._preflight = check
        check.check_device()
        goodput.charge(PREFLIGHT)
        check.joining()
        # By the check's deadline; a fresh connection to the store tells who never joined.
        world = check.join(lambda: init_world(store),
                           lambda: attempt_store(store_timeout(policy)))
        goodput.charge(STARTUP)
        check.check_group()
        check.check_mesh()
        goodput.charge(PREFLIGHT)
        if store is not None:
            store.set_timeout(STORE_TIMEOUT)
        if world.is_main:
            print(check.summary(), flush=True)
        return world

    def _preflight_failed(self, error: PreflightFailed) -> FitResult:
        """End the attempt: every live rank exits, one per pod writes why and stops its agent."""
        failure = failure_of(error)
        assert failure is not None  # PreflightFailed is one of FAILURES
        check = self._preflight
        print(f"rank {os.environ.get('RANK', '0')}: {failure.failure_class}: {error}",
              file=sys.stderr, flush=True)
        if check is None or check.writes_the_failure():
            stop_torchrun_agent()
            record_failure(failure.failure_class, str(error), self.micro_batch_size,
                           nodes=error.nodes, reported_nodes=error.reported_nodes)
        if check is not None and check.abandoned_join:
            # A thread is still blocked joining the group: the interpreter's exit would
            # wait on it (the process group's teardown), so this rank ends here.
            if self._lifeline is not None:
                self._lifeline.end(failure.exit_code, failure.failure_class, str(error))
            sys.stdout.flush()
            os._exit(failure.exit_code)
        return FitResult(0, failure.reason, failure.exit_code, None, None)

    def _record_failure(self, failure_class: TrainerFailureClass, error: BaseException,
                        world: World) -> None:
        """The failure's class and words, for the termination message and the log."""
        if failure_class in ENDS_THE_POD:
            stop_torchrun_agent()  # before writing: the agent's SIGTERM is ignored from here
        message = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        if failure_class == "CUDAOutOfMemory":
            message += out_of_memory_advice(self.spec, self.micro_batch_size, world)
        traceback.print_exception(error, file=sys.stderr)  # where it happened, for the logs
        print(f"rank {world.rank}: {failure_class} at micro-batch {self.micro_batch_size}: "
              f"{message}", file=sys.stderr, flush=True)
        record_failure(failure_class, message, self.micro_batch_size)

    def _build(self, world: World, goodput: GoodputLedger) -> _Run:
        """Data, model, parallelism, optimizer, schedule, checkpointer and reporter."""
        # A model.init folder decides the model's dimensions and INL dynamics (config.json,
        # checked against the spec): from here on the spec says so, for the model, its
        # metrics, checkpoints and export.
        spec, dims = trained_model(self.spec)
        # The mesh from the spec and the pod shape (mesh.py): auto's choice becomes the spec's,
        # and the data is split over data-parallel ranks (a tensor-parallel group shares it).
        mesh = build_mesh(spec, dims, world)
        spec = spec.model_copy(update={"parallelism": mesh.parallelism(spec.parallelism)})
        if world.is_main:
            print(f"mesh: {mesh.shape.describe()} ({mesh.why})", flush=True)
        self.spec = spec
        opt = spec.optimization
        # Under faultTolerance the groups' data-parallel ranks read side by side.
        data_rank, data_world = data_slot(spec.fault_tolerance, mesh.dp_rank, mesh.dp_size)
        train_data, validation_data = build_datasets(
            spec, rank=data_rank, world_size=data_world,
            micro_batch_size=self.micro_batch_size)
        if spec.model.init is not None:
            check_vocabulary(dims, train_data.index.vocab_size, spec.model.init)
        elif spec.model.from_teacher:
            assert spec.distillation is not None
            check_vocabulary(dims, train_data.index.vocab_size, spec.distillation.teacher,
                             field="distillation.teacher")
        elif spec.model.vocab_size is None:
            # The model's vocabulary is the tokenizer's unless the spec sets one.
            dims = dims.model_copy(update={"vocab_size": train_data.index.vocab_size})
        # The teacher first, so the student's weights and dropout masks are drawn as they
        # would be without one.
        teacher = (load_teacher(spec, dims, train_data.index, mesh.data_parallel, world.device)
                   if spec.distillation is not None else None)
        # Every rank draws the same initial weights; FSDP2 then keeps each rank's shard.
        torch.manual_seed(opt.seed)
        model = build_model(spec.model.architecture, dims, max_seq_len=spec.data.seq_len,
                            dropout=spec.model.dropout, dynamics=spec.model.dynamics)
        # Then each rank draws its own dropout masks; checkpoints carry the generators on.
        torch.manual_seed(opt.seed + world.rank)
        model.output_loss, why = select_output_loss(world.device)
        if teacher is not None:
            assert spec.distillation is not None
            why = (f"from the teacher {spec.distillation.teacher}, temperature "
                   f"{spec.distillation.temperature:g}, alpha {spec.distillation.alpha:g}; "
                   f"evaluation: {model.output_loss.name} cross-entropy, {why}")
            model.output_loss = teacher.student_loss(model.output_loss)
        parallel = parallelize(model, spec.parallelism, mesh, world.device)
        parallel.dp_size = data_world  # the global batch is split over every group's ranks
        if mesh.tensor_parallel is not None:  # parallelize set the vocabulary-parallel loss
            why = f"tensorParallel {mesh.shape.tensor_parallel} splits the vocabulary"
        optimizer = build_optimizer(parallel.module, opt, spec.learning_rate, world.device,
                                    parallel.scaler)
        # Epochs become steps once, from the data and the global batch (see `epochs`).
        max_steps = opt.steps_for(tokens_per_epoch=train_data.samples_per_epoch * spec.data.seq_len,
                                  seq_len=spec.data.seq_len, world_size=data_world)
        spec.check_warmup(max_steps)
        schedule = build_schedule(optimizer, peak=spec.learning_rate,
                                  warmup_steps=spec.warmup_steps(max_steps), max_steps=max_steps,
                                  spec=opt)
        progress = TrainProgress()
        app_state: dict[str, Any] = {
            "model": ModelState(parallel.module, optimizer), "scheduler": schedule,
            "data": train_data, "train": progress, "rng": RandomState(), "goodput": goodput,
            "checkpoint_load_tiers": goodput.tier_state,
        }
        if parallel.scaler is not None:
            app_state["scaler"] = parallel.scaler
        replicas = None
        if spec.fault_tolerance is not None:
            # What a group that comes back takes from a live one (fault_tolerance.HealState).
            replicas = ReplicaGroups.join(
                spec.fault_tolerance, world, self.name,
                {name: app_state[name] for name in
                 ("model", "scheduler", "data", "train", "rng", "goodput", "scaler")
                 if name in app_state})
        reporter = Reporter(spec, enabled=world.is_main, metrics_log=self.metrics_log,
                            job_name=self.name, serve=self.serve_metrics, max_steps=max_steps)

        def committed(info: CheckpointInfo) -> None:
            reporter.checkpointed(info.step, info.uri, info.time.timestamp(),
                                  val_loss=info.val_loss, best=info.best)

        # Checkpoints written before goodput accounting (or its split by tier) existed
        # still resume.
        staging = Staging(world.device, self.copy_stream)
        checkpointer = Checkpointer(spec, rank=world.rank, world_size=world.world_size,
                                    model_dims=dims, on_commit=committed,
                                    optional_state=frozenset({"goodput",
                                                              "checkpoint_load_tiers"}),
                                    staging=staging)
        heartbeat = (Heartbeat(open_storage(spec.checkpoint.uri, spec.storage))
                     if world.is_main else None)
        return _Run(world=world, dims=dims, max_steps=max_steps, parallel=parallel,
                    optimizer=optimizer, schedule=schedule, train_data=train_data,
                    validation_data=validation_data, progress=progress, app_state=app_state,
                    checkpointer=checkpointer, reporter=reporter,
                    output_loss=(model.output_loss.name, why), goodput=goodput,
                    heartbeat=heartbeat, staging=staging, teacher=teacher,
                    memory=open_memory_tier(spec, rank=world.rank, world_size=world.world_size,
                                            local_rank=world.local_rank, job_name=self.name,
                                            staging=staging),
                    replicas=replicas)

    def _train(self, run: _Run, stop: StopRequest) -> FitResult:
        """The loop, one iteration per optimizer step, in the module docstring's order."""
        spec = self.spec
        step = self._resume(run)
        meter = StepMeter(run.world, run.parallel, run.dims, run.goodput, spec,
                          self.micro_batch_size)
        if run.replicas is not None:
            run.replicas.samples_per_group_step = (
                meter.accumulation * self.micro_batch_size * run.parallel.dp_size
                // run.replicas.groups)
            run.reporter.quorum(step, run.replicas.participants, run.replicas.groups,
                                run.replicas.skipped_samples)  # the start's quorum
        stop.inside_since = lambda: meter.clock.inside_since  # its deadline (distributed.py)
        # The saves' waits on the other ranks count as inside collectives for that deadline.
        run.checkpointer.waiting_on_peers = meter.clock.inside
        if run.memory is not None:
            run.memory.waiting_on_peers = meter.clock.inside
        if step == 0 and spec.evaluation.every_steps:
            self._evaluate_and_record(run, step, meter.clock)  # the baseline to improve on
        reason: FitReason = "max_steps"
        val_loss: float | None = None  # of an evaluation at this step
        while step < run.max_steps:
            meter.begin_step()
            with meter.clock.waiting():
                stopping = stop.agreed(run.world.device)
            run.goodput.charge(PRODUCTIVE)  # agreeing waits for the last step's device work
            if stopping:
                reason = "signalled"
                break
            batches = meter.fetch(run.train_data)
            run.goodput.charge(DATA_WAIT)
            if run.replicas is not None:
                # The step's quorum of groups, answered while the step computes.
                groups_before = run.replicas.participants
                run.replicas.quorum()
            # Forward/backward with accumulation → clip → optimizer step → schedule.
            result = self._train_step(run, meter, batches)
            if run.replicas is not None:
                step = self._after_quorum(run, meter, step, groups_before)
            if result is None:  # a group failed inside the step: none of them took it
                run.goodput.charge(LOST_PROGRESS)
                continue
            if run.replicas is None:
                step += 1

            # Metrics: cheap ones every step, reduced ones every logEverySteps.
            run.reporter.stepped(step, meter.global_tokens, meter.end_step())
            stepped = run.goodput.charge(PRODUCTIVE)
            if run.replicas is not None:  # the absent groups' share of a degraded step
                run.goodput.move(PRODUCTIVE, DEGRADED, stepped * run.replicas.absent_share)
            run.goodput.stepped(step)
            if step % spec.metrics.log_every_steps == 0 or step == run.max_steps:
                # Its gathers wait on every rank: a rank signalled while blocked in one on a
                # lost peer gives up as in a step's collectives (StopRequest), not in 30 s.
                with meter.clock.inside():
                    self._log_interval(run, meter, step, result)

            # Evaluation and early stopping.
            every, val_loss = spec.evaluation.every_steps, None
            if every and (step % every == 0 or step == run.max_steps):
                val_loss = self._evaluate_and_record(run, step, meter.clock)
                patience = spec.evaluation.early_stopping.patience
                if patience and run.progress.evals_without_improvement >= patience:
                    reason = "early_stopping"
                    break

            # Checkpoints every everySteps, and (keepBest) at each new best validation loss.
            if run.writes_checkpoints and (step % spec.checkpoint.every_steps == 0 or (
                    val_loss is not None and run.checkpointer.improves_best(val_loss))):
                saved = self._save(run, step, val_loss, blocking=False)
                run.goodput.move(CHECKPOINT_SAVE, STRAGGLER, meter.stragglers.saved("s3", saved))
            if run.memory is not None and run.writes_checkpoints and run.memory.due(step):
                saved = self._snapshot(run, run.memory, step)
                run.goodput.move(CHECKPOINT_SAVE, STRAGGLER,
                                 meter.stragglers.saved("memory", saved))
        return self._finish(run, stop, step, reason, val_loss)

    @staticmethod
    def _after_quorum(run: _Run, meter: StepMeter, step: int, groups_before: int) -> int:
        """With replica groups, after a step's commit: report a heal at it and a change in
        the groups present; the step the groups are at."""
        replicas = run.replicas
        assert replicas is not None
        if replicas.healed_at is not None:
            run.reporter.healed(replicas.healed_at, replicas.participants)
        if replicas.participants != groups_before:
            run.reporter.quorum(replicas.step, replicas.participants, replicas.groups,
                                replicas.skipped_samples)
            meter.stragglers.pace_changed()  # a step across more groups takes longer
        return replicas.step

    def _resume(self, run: _Run) -> int:
        """Load the latest checkpoint (or start from `model.init`, or the teacher's embeddings),
        book the attempt's start and report it; the step the loop starts from."""
        spec, reporter, model = self.spec, run.reporter, run.parallel.module
        goodput = run.goodput
        goodput.charge(STARTUP)
        if dist.is_initialized() and dist.get_world_size() > 1:
            # Every rank's process started at its own moment: the group's is rank 0's.
            started = [goodput.attempt_started]
            dist.broadcast_object_list(started, src=0)
            goodput.agree(started[0])
        if run.replicas is not None:
            # A group that comes back takes a live group's state (at its first step's
            # commit), not a checkpoint's.
            healed = run.replicas.first_quorum()
            if healed:  # (reported when taken: `_after_quorum`)
                reporter.started(healed, run.world.world_size, *run.output_loss)
                goodput.charge(STARTUP)
                return healed
        # The in-memory tier first (own memory, then a partner's copy), then S3.
        restored = run.memory.load_latest(run.app_state) if run.memory is not None else None
        loaded = (restored.step if restored is not None
                  else run.checkpointer.load_latest(run.app_state))
        if loaded is None and spec.model.init is not None:
            # Pretrained weights only start a job: any checkpoint to resume from wins.
            load_pretrained(model, spec.model.init, spec.storage)
            reporter.initialised(spec.model.init)
        elif loaded is None and spec.model.from_teacher:
            # A student sized from its teacher starts from the teacher's embeddings.
            assert spec.distillation is not None
            try:
                load_embeddings(model, spec.distillation.teacher, spec.storage)
            except PretrainedError as error:
                raise teacher_error(error) from None
        step = loaded or 0
        if run.replicas is not None:
            run.replicas.starts_at(step)
        # Booked by the tier it came from (a fresh start's look for one, by none).
        goodput.charge_load(load_tier(restored, loaded))
        # A checkpoint of another job (resumeFrom) does not carry this job's time.
        redone_through = goodput.resume(
            self._last_heartbeat(run),
            from_this_job=(not step or restored is not None
                           or run.checkpointer.latest is not None),
            out_of_memory_restarts=self.out_of_memory_restarts)
        if step:
            resumed_from = (restored.uri if restored is not None
                            else run.checkpointer.latest.uri if run.checkpointer.latest
                            else str(spec.checkpoint.resume_from))
            reporter.resumed(step, resumed_from, run.world.world_size, redone_through)
        if run.checkpointer.best is not None:
            reporter.kept_best(run.checkpointer.best.step, run.checkpointer.best.val_loss)
        reporter.started(step, run.world.world_size, *run.output_loss)
        goodput.charge(STARTUP)
        # A heartbeat before the first step: an attempt killed before its first logged
        # step (OOMKilled while building its first batch) still leaves its time for the
        # next attempt to book, to `oom` after an out-of-memory restart.
        self._account(run, step)
        return step

    def _train_step(self, run: _Run, meter: StepMeter,
                    batches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepResult | None:
        """One optimizer step on the step's micro-batches: forward/backward with accumulation
        → clip → optimizer step → learning-rate schedule. Under faultTolerance the gradients
        are averaged over the groups before clipping, and None means the groups did not
        commit the step (one failed inside it): the optimizer did not step."""
        parallel, model, optimizer = run.parallel, run.parallel.module, run.optimizer
        device, teacher = run.world.device, run.teacher

        # Forward/backward, synchronising gradients only on the last micro-step.
        loss_sum = torch.zeros((), device=device)
        terms_sum = torch.zeros(2, device=device)  # distillation: cross-entropy, KD
        for index, (inputs, targets) in enumerate(batches):
            inputs = inputs.to(device, non_blocking=True)
            with parallel.gradient_sync(index == meter.accumulation - 1), parallel.autocast():
                if teacher is not None:
                    teacher.teach(inputs)  # soft targets for the student's loss
                # The model returns the summed token loss without holding the logits.
                loss = model(inputs, targets.to(device, non_blocking=True)) / meter.local_tokens
            (parallel.scaler.scale(loss) if parallel.scaler else loss).backward()
            loss_sum += loss.detach()
            if teacher is not None:
                terms_sum += torch.stack(teacher.terms()) / meter.local_tokens

        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if run.replicas is not None:
            with meter.clock.waiting():
                run.replicas.average(grads)
                if not run.replicas.commit():
                    optimizer.zero_grad(set_to_none=True)
                    return None
        # Clip on the global norm (DTensor shards under FSDP2 reduce across ranks).
        if parallel.scaler is not None:
            parallel.scaler.unscale_(optimizer)
        # On DTensor shards get_total_norm reduces their partial norms across ranks: a
        # collective, where a rank waits for a slower peer. (Its own arithmetic, one read of
        # the local shards, is timed with it.)
        sharded = any(isinstance(grad, DTensor) for grad in grads)
        with meter.clock.waiting() if sharded else contextlib.nullcontext():
            grad_norm = torch.nn.utils.get_total_norm(grads)
            if isinstance(grad_norm, DTensor):
                grad_norm = grad_norm.full_tensor()
        clip_norm = self.spec.optimization.grad_clip_norm
        if clip_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), clip_norm, grad_norm)

        # Optimizer step, then the learning rate for the next one. The step changes what a
        # snapshot in flight reads: it waits for the snapshot (on CUDA, the device waits).
        learning_rate = float(run.schedule.get_last_lr()[0])
        run.staging.before_update()
        if parallel.scaler is not None:
            parallel.scaler.step(optimizer)
            parallel.scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        run.schedule.step()
        return StepResult(loss_sum, terms_sum, grad_norm, learning_rate)

    def _log_interval(self, run: _Run, meter: StepMeter, step: int, result: StepResult) -> None:
        """Report the interval since the last logged step, ending at `step` (collective):
        throughput over its wall time, `result`'s loss reduced over ranks, each rank's
        compute and wait, and the goodput totals."""
        interval, device = meter.interval, run.world.device
        seconds = interval.end()
        interval.waited += meter.clock.settle()  # on CUDA, the interval's collectives
        tokens_per_second = interval.tokens / seconds
        ce_loss = kd_loss = None
        if run.teacher is not None:
            ce_loss, kd_loss = (mean_over_ranks(term) for term in result.terms)
        meter.computed += interval.busy - interval.waited
        ranks = gather_rank_timings(
            (interval.busy - interval.waited) / interval.steps,
            interval.waited / interval.steps, meter.computed)
        run.reporter.logged(StepReport(
            step=step, epoch=run.train_data.epochs_done,
            loss=mean_over_ranks(result.loss), learning_rate=result.learning_rate,
            grad_norm=float(result.grad_norm), tokens_per_second=tokens_per_second,
            mfu=(meter.model_flops * tokens_per_second / meter.flops_per_second_peak
                 if meter.flops_per_second_peak else 0.0),
            step_time=seconds / interval.steps,
            data_wait_ratio=interval.data_wait / seconds,
            dynamics=(dynamics_over_ranks(run.parallel.module, device)
                      if self.spec.model.dynamics.enabled else None),
            ce_loss=ce_loss, kd_loss=kd_loss, ranks=tuple(ranks),
        ), device)
        meter.interval = interval.next()
        run.goodput.charge(PRODUCTIVE)  # the step's device work, waited for by the log
        # While a rank is a straggler the group runs at its pace, the log's gathers too:
        # what that cost over the healthy pace is not goodput (StragglerBooking).
        productive = run.goodput.seconds[PRODUCTIVE]
        for source, seconds in meter.stragglers.lost(
                [timing.compute_seconds for timing in ranks],
                [timing.wait_seconds for timing in ranks], interval.steps,
                wall=productive - meter.productive_mark).items():
            run.goodput.move(source, STRAGGLER, seconds)
        meter.productive_mark = run.goodput.seconds[PRODUCTIVE]
        self._account(run, step)

    def _finish(self, run: _Run, stop: StopRequest, step: int, reason: FitReason,
                val_loss: float | None) -> FitResult:
        """Save the final checkpoint (every rank, whatever ended the loop); a finished run
        then exports the model and reports that it finished."""
        spec = self.spec
        if run.writes_checkpoints:
            self._save(run, step, val_loss, blocking=True)
        best = run.progress.best_val_loss if math.isfinite(run.progress.best_val_loss) else None
        if reason == "signalled":
            self._account(run, step, final=True)
            code = EXIT_SIGNALLED if stop.signalled else EXIT_RESTART
            return FitResult(step, reason, code, best, None)
        export_uri, export_step = None, step
        if spec.checkpoint.export and run.writes_checkpoints:
            if spec.checkpoint.export_from == "best":
                # The final checkpoint holds the last weights; the model takes the best ones.
                export_step = run.checkpointer.load_best(
                    {"model": ModelWeights(run.parallel.module)}) or step
            export_uri = export_model(run.parallel.module, run.dims, spec, rank=run.world.rank)
        run.goodput.charge(CHECKPOINT_SAVE)  # the export is the run's last save
        if run.memory is not None:
            run.memory.close(discard=True)  # finished: nothing will restore from memory
        self._account(run, step, final=True)
        run.reporter.finished(step, reason, best, export_uri, export_step=export_step,
                              export_format=export_format(spec, run.dims) if export_uri else None)
        return FitResult(step, reason, EXIT_COMPLETE, best, export_uri)

    @staticmethod
    def _save(run: _Run, step: int, val_loss: float | None, *, blocking: bool) -> float:
        """Save the checkpoint of `step` (collective): the step's device work until then is
        productive, the save is not. Returns the save's seconds."""
        synchronize(run.world.device)
        run.goodput.charge(PRODUCTIVE)
        run.checkpointer.save(step, run.app_state, blocking=blocking, val_loss=val_loss)
        return run.goodput.charge(CHECKPOINT_SAVE)

    @staticmethod
    def _snapshot(run: _Run, memory: MemoryCheckpoints, step: int) -> float:
        """Snapshot `step` into the in-memory tier; its blocking part is a save's time.
        Returns its seconds."""
        synchronize(run.world.device)
        run.goodput.charge(PRODUCTIVE)
        memory.save(step, run.app_state)
        return run.goodput.charge(CHECKPOINT_SAVE)

    def _evaluate_and_record(self, run: _Run, step: int, clock: WaitClock) -> float | None:
        """The validation loss at `step`, recorded for early stopping; None without data."""
        if run.validation_data is None:
            return None
        synchronize(run.world.device)  # the step's device work is productive, not evaluation
        run.goodput.charge(PRODUCTIVE)
        # The same validation samples at any micro-batch: more, smaller batches after an OOM.
        batches = self.spec.evaluation.batches * (
            self.spec.optimization.micro_batch_size // self.micro_batch_size)
        val_loss = evaluate(run.parallel, run.validation_data, batches, run.world.device,
                            clock)
        run.goodput.charge(EVALUATION)
        run.progress.record(val_loss, self.spec.evaluation.early_stopping.min_delta)
        run.reporter.evaluated(step, val_loss)
        return val_loss


    @staticmethod
    def _last_heartbeat(run: _Run) -> dict[str, Any] | None:
        """Rank 0's read of the goodput heartbeat, shared with every rank (collective)."""
        holder = [run.heartbeat.read() if run.heartbeat is not None else None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(holder, src=0)
        return holder[0]

    @staticmethod
    def _account(run: _Run, step: int, *, final: bool = False) -> None:
        """Export the goodput totals and write the heartbeat (rank 0; `final` waits for it)."""
        snapshot = run.goodput.snapshot()
        run.reporter.accounted(step, snapshot["seconds"], snapshot["checkpoint_load_tiers"])
        if run.heartbeat is not None and run.writes_checkpoints:
            run.heartbeat.write(snapshot, wait=final)
