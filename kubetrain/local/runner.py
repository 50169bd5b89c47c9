"""The local runner: a TrainingJob's worker group as processes on this machine, under its policy.

`LocalRun` does locally what the operator does on Kubernetes: it starts
`spec.workers.replicas` simulated nodes (`kubetrain.local.node`), each a
`torchrun` agent running the real trainer, and watches them. A failed or lost
node, or a step that stops advancing for `progressDeadlineSeconds`, tears the
group down and starts it again on a fresh rendezvous after the backoff that
`kubetrain.local.recovery` decides; the trainer resumes from its newest
checkpoint. `activeDeadlineSeconds` and Ctrl-C (SIGINT or SIGTERM) stop the
group the way a planned change does on Kubernetes: SIGTERM to every agent, the
trainer saves a checkpoint and exits, and running the same job again resumes.

A failed node gets the operator's failure class, decided by the same rule
(`kubetrain.restart_rules.failure_class`): a node the runner lost itself, the kernel's
OOM-kill count in the run's memory cgroup (`kubetrain.local.memory`), the trainer's
termination message (each node has its own termination log, as each pod does), or its
exit code. Every node that failed in one poll is judged together, as the operator judges
the pods that failed by one pass. Out of memory, the group restarts at once with half
the micro-batch: the manifest the trainer reads carries it in status.effective, as the
operator's ConfigMap does, and the summary says what changed and why.

Own code (spec.trainer) runs under the same policy, as its pods do: each node runs
kubetrain's own-code entry around torchrun and the user's command, progress comes from the
code's reports to a status endpoint served here (kubetrain.local.trainer_status_endpoint), and
checkpoints from the commits the entry uploads (kubetrain.local.own_code); every attempt
resumes from the newest commit. The runner cannot halve a script's micro-batch itself: an
out-of-memory restart is decided as for kubetrain's trainer (not counted, no backoff, at
most log2 of the spec's micro-batch) and reaches the code as
KUBETRAIN_OUT_OF_MEMORY_RESTARTS, which kubetrain.sdk.micro_batch_size halves by, as on
Kubernetes.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from kubetrain.api.trainingjob import TrainingJob, TrainingJobStatus
from kubetrain.local.launch import (
    AgentLaunch,
    Rendezvous,
    agent_launch,
    free_port,
    own_code_agent_launch,
)
from kubetrain.local.memory import oom_kills
from kubetrain.local.metrics_log import Event, MetricsLogReader, RunHistory, append_event
from kubetrain.local.node import Node
from kubetrain.local.own_code import (
    CommittedCheckpoints,
    OpenListing,
    ReportedGoodput,
    fresh_node_dirs,
)
from kubetrain.local.progress import Outcome, ProgressDisplay, summary
from kubetrain.local.recovery import (
    Decision,
    GroupFailure,
    ProgressClock,
    after_attempt,
    node_failure_class,
)
from kubetrain.local.replica_groups import (
    EventRelay,
    LighthouseError,
    group_metrics_log,
    lighthouse,
)
from kubetrain.local.report import write_after_run
from kubetrain.local.trainer_status_endpoint import LocalStatusEndpoint, token_file
from kubetrain.local.workspace import Workspace
from kubetrain.pod_conventions import (
    ATTEMPT_STARTED_ENV,
    TERMINATION_LOG_ENV,
    replica_group_env,
    replica_group_of,
)
from kubetrain.protocol import trainer_failure

# Exit statuses of `kubetrain run`.
EXIT_SUCCEEDED = 0
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130

# A failed or hung group is torn down quickly: its collectives are broken, nothing to save.
FAILED_GROUP_GRACE_SECONDS = 5.0
# A stopping group saves a checkpoint first (torchrun gives its workers 30 s after SIGTERM).
STOPPING_GROUP_GRACE_SECONDS = 120.0
POLL_SECONDS = 0.2
LOG_TAIL_LINES = 20


@dataclass(frozen=True)
class RunOptions:
    """How `kubetrain run` runs a job, beyond what the manifest says."""

    kill_at_steps: tuple[int, ...] = ()
    """Kill a simulated node (SIGKILL, as a lost machine) when the step first reaches each."""


@dataclass
class _Stop:
    """Why the group must stop in an orderly way (a checkpoint is saved first)."""

    reason: str
    exit_code: int


@dataclass
class _Attempt:
    """What one run of the worker group came to."""

    finished: bool = False
    failures: list[GroupFailure] = field(default_factory=list)  # the nodes that failed
    stop: _Stop | None = None


@dataclass
class LocalRun:
    """One `kubetrain run` of a job; `run()` returns the command's exit status."""

    job: TrainingJob
    workspace: Workspace
    options: RunOptions = field(default_factory=RunOptions)
    open_listing: OpenListing | None = None
    """Own code: how to list the checkpoints committed under a URI (the command's)."""

    def __post_init__(self) -> None:
        self.history = RunHistory()
        self.reader = MetricsLogReader(self.workspace.metrics_log)
        for event in self.reader.read_new():  # earlier runs of the same job
            self.history.apply(event)
        self.checkpoints_before = len(self.history.checkpoints)
        own_code = self.job.spec.own_code
        self.display = ProgressDisplay(self.job.spec.optimization.max_steps
                                       if self.job.spec.optimization.epochs is None
                                       and not own_code else None)
        # Own code: its commits under checkpoint.uri, and its reports' endpoint while it runs.
        if own_code and self.open_listing is None:
            raise ValueError("an own-code job's run needs open_listing to see its commits")
        self.commits = (CommittedCheckpoints(self.job, self.open_listing)
                        if own_code and self.open_listing is not None else None)
        # ...and its goodput, from the steps it reports (kubetrain's trainer logs its own).
        self.goodput = (ReportedGoodput.resumed(self.workspace.metrics_log) if own_code
                        else None)
        # Own code's report endpoints: one for the run, or one a replica group (each group's
        # rank 0 reports the steps it trains into its group's log, as kubetrain's trainer).
        self.endpoints: list[LocalStatusEndpoint] = []
        self.pending_kills = sorted(set(self.options.kill_at_steps))
        self.restarts: list[str] = []
        # The micro-batch of each attempt that changed it (out of memory), the spec's first.
        self.micro_batches = [self.job.micro_batch_size]
        self.out_of_memory_at: float | None = None  # unix time of the last OOM, until a step
        self.oom_recovery_seconds: list[float] = []  # from each OOM to the next training step
        self.signals: list[int] = []  # SIGINT / SIGTERM received, in order
        self.started = time.monotonic()
        self.oom_kills_before: int | None = None  # in the run's cgroup, when the attempt began
        self.lost_nodes: set[int] = set()  # nodes this attempt lost on purpose (kill at step)
        self.counted: list[GroupFailure] = []  # failures counted against maxRestarts
        # spec.faultTolerance: the lighthouse's address while the run lasts, the groups'
        # events into the run's log, and the groups waiting out a backoff to start again.
        self.lighthouse_url: str | None = None
        self.relay = (EventRelay(self.workspace.metrics_log,
                                 self.job.spec.fault_tolerance.replica_groups)
                      if self.job.spec.fault_tolerance is not None else None)
        self.group_restarts_due: dict[int, float] = {}  # group -> monotonic time to start it
        # Each group's rank 0 serves /metrics (as each pod does on its own network): group 0
        # on spec.metrics.port, the others on free ports of their own.
        tolerance = self.job.spec.fault_tolerance
        groups = tolerance.replica_groups if tolerance is not None else 1
        self._metrics_ports = [self.job.spec.metrics.port] + [
            free_port() for _ in range(groups - 1)]

    def run(self) -> int:
        """Run the group until the job finishes, fails or is stopped; print the summary."""
        manifest = self.workspace.write_manifest(self.job)
        with ExitStack() as stack:
            stack.enter_context(self._signals_forwarded())
            if self.job.spec.own_code:
                self.endpoints = [stack.enter_context(endpoint)
                                  for endpoint in self._own_code_endpoints()]
            if self.relay is not None:
                try:
                    self.lighthouse_url = stack.enter_context(
                        lighthouse(self.job, self.workspace.logs / "lighthouse.log"))
                except LighthouseError as error:
                    print(f"kubetrain run: {error}", file=sys.stderr, flush=True)
                    return EXIT_FAILED
            return self._attempts(manifest)

    def _attempts(self, manifest: Path) -> int:
        """Run attempts of the group until one finishes, stops or fails for good."""
        failures = self.counted
        attempt = 0
        while True:
            result = self._run_group(manifest, attempt)
            if result.finished:
                return self._finish(True, self._finished_reason(), EXIT_SUCCEEDED)
            if result.stop is not None:
                return self._finish(False, result.stop.reason, result.stop.exit_code)
            assert result.failures
            self._log_failure(result.failures[0])
            spec = self.job.spec
            decision = after_attempt(
                spec, failures, result.failures, micro_batch_size=self.job.micro_batch_size,
                out_of_memory_restarts=len(self.micro_batches) - 1,
                world_size=spec.workers.replicas * spec.workers.procs_per_worker)
            if decision.counted is None:  # out of memory: a smaller micro-batch, or the end
                if not self._halve_micro_batch(decision):
                    return self._finish(False, self.restarts.pop(), EXIT_FAILED)
                manifest = self.workspace.write_manifest(self.job)
                attempt += 1
                continue
            failures.append(decision.counted)
            if not decision.restart:
                return self._finish(False, decision.reason, EXIT_FAILED)
            self.restarts.append(decision.reason)
            max_restarts = self.job.spec.run_policy.max_restarts
            self.display.say(f"{decision.reason}: restarting the group in "
                             f"{decision.delay:g}s (restart {len(failures)} of "
                             f"{max_restarts})")
            if not self._sleep(decision.delay):
                return self._finish(False, "interrupted while waiting to restart",
                                    EXIT_INTERRUPTED)
            attempt += 1

    def _log_failure(self, failure: GroupFailure) -> None:
        """Add the failure, with its class, to the metrics log: the run report counts them.

        The group is stopped by now, so no trainer writes the log meanwhile.
        """
        self._append({"event": "failure", "class": failure.failure_class,
                      "reason": failure.reason, "exit_code": failure.exit_code,
                      "micro_batch_size": self.job.micro_batch_size, "time": time.time()})

    def _append(self, event: Event) -> None:
        append_event(self.workspace.metrics_log, event)

    def _halve_micro_batch(self, decision: Decision) -> bool:
        """Take the out-of-memory decision into self.job (status.effective); False: fail."""
        self.restarts.append(decision.reason)
        effective = decision.effective
        if not decision.restart or effective is None:
            return False
        # From the first of a chain of OOMs (16 -> 8 -> 4) to the step that ends it.
        self.out_of_memory_at = self.out_of_memory_at or time.time()
        self.micro_batches.append(effective.micro_batch_size)
        status = (self.job.status or TrainingJobStatus()).model_copy(
            update={"effective": effective})
        self.job = self.job.model_copy(update={"status": status})
        self.display.say(f"{decision.reason}: restarting the group now (not counted in "
                         "spec.runPolicy.maxRestarts)")
        return True

    # --- one attempt of the group ----------------------------------------------------

    def _run_group(self, manifest: Path, attempt: int) -> _Attempt:
        self.lost_nodes = set()
        self.group_restarts_due = {}
        launched_at = f"{time.time():.3f}"
        self.oom_kills_before = oom_kills()
        node_dirs: list[Path] = []
        resumed = self.commits.resumed() if self.commits is not None else None
        if self.goodput is not None:
            step = resumed.get("step") if resumed is not None else None
            self.goodput.attempt(float(launched_at), step if isinstance(step, int) else None)
        if self.commits is not None:
            if resumed is not None:
                self._append(resumed)
            node_dirs = fresh_node_dirs(self.workspace, self.job.spec.workers.replicas)
        if self.relay is not None:
            self.relay.attempt()
        with ExitStack() as logs:

            def start(indexes: list[int], rendezvous: Rendezvous, launched_at: str
                      ) -> list[Node]:
                """Nodes `indexes`, meeting at `rendezvous`, launched at `launched_at`."""
                nodes = []
                for index in indexes:
                    log = logs.enter_context(self.workspace.worker_log(index).open("ab"))
                    log.write(f"\n=== kubetrain run: attempt {attempt}, launched at "
                              f"{launched_at}, rendezvous {rendezvous.endpoint} ===\n".encode())
                    log.flush()
                    launch = (self._own_code_launch(manifest, index, rendezvous,
                                                    node_dirs[index])
                              if self.commits is not None
                              else self._launch(manifest, index, rendezvous))
                    launch.env[ATTEMPT_STARTED_ENV] = launched_at
                    termination_log = self.workspace.logs / f"worker-{index}.termination-log"
                    termination_log.write_text("")  # fresh each attempt, as a new container's
                    launch.env[TERMINATION_LOG_ENV] = str(termination_log)
                    nodes.append(Node(launch, cwd=Path.cwd(), log=log))
                return nodes

            def start_group(group: int, launched_at: str = launched_at) -> list[Node]:
                """A replica group's nodes, on a rendezvous of their own."""
                rendezvous = self._rendezvous(attempt, group, restart=len(self.counted))
                return start(self._group_nodes(group), rendezvous, launched_at)

            def restart_group(group: int) -> list[Node]:
                return start_group(group, f"{time.time():.3f}")

            tolerance = self.job.spec.fault_tolerance
            nodes = (start(list(range(self.job.spec.workers.replicas)),
                           self._rendezvous(attempt), launched_at) if tolerance is None
                     else [node for group in range(tolerance.replica_groups)
                           for node in start_group(group)])
            try:
                result = self._watch(nodes, restart_group)
            except BaseException:
                for node in nodes:
                    node.lose()
                raise
            if result.stop is not None:
                self.display.say(f"{result.stop.reason}: stopping the workers, which save a "
                                 "checkpoint first (Ctrl-C again to kill them now)")
                self._stop_all(nodes, STOPPING_GROUP_GRACE_SECONDS)
            elif result.failures:
                self._stop_all(nodes, FAILED_GROUP_GRACE_SECONDS)
            self._read_events()
            if self.goodput is not None:
                self._append(self.goodput.event(time.time()))
                self._read_events()
            self.display.close()
        return result

    def _rendezvous(self, attempt: int, group: int | None = None, restart: int = 0
                    ) -> Rendezvous:
        """A fresh rendezvous for an attempt of the nodes, or of one replica group's."""
        run_id = f"{self.job.metadata.name}-{os.getpid()}-{attempt}"
        if group is not None:
            run_id += f"-group-{group}-{restart}"
        return Rendezvous(free_port(), run_id)

    def _launch(self, manifest: Path, index: int, rendezvous: Rendezvous) -> AgentLaunch:
        """Node `index` of kubetrain's trainer; in a replica group, told its group and the
        lighthouse, and logging to its group's metrics log (`EventRelay` merges them)."""
        if self.relay is None:
            return agent_launch(self.job, manifest, self.workspace.metrics_log, index,
                                rendezvous, self.workspace.torchrun_logs)
        assert self.lighthouse_url is not None
        group = self._group_of(index)
        launch = agent_launch(self.job, manifest,
                              group_metrics_log(self.workspace.metrics_log, group), index,
                              rendezvous, self.workspace.torchrun_logs,
                              metrics_port=self._metrics_ports[group])
        launch.env.update(replica_group_env(self.job, index, self.lighthouse_url))
        return launch

    def _group_of(self, index: int) -> int:
        group = replica_group_of(self.job, index)
        assert group is not None, "only a job with spec.faultTolerance has replica groups"
        return group

    def _group_nodes(self, group: int) -> list[int]:
        return [index for index in range(self.job.spec.workers.replicas)
                if self._group_of(index) == group]

    def _own_code_endpoints(self) -> list[LocalStatusEndpoint]:
        """The report endpoint of the run's metrics log; with replica groups, one a group
        into its group's log, whose steps `EventRelay` passes on once."""
        root = self.workspace.root
        if self.relay is None:
            return [LocalStatusEndpoint(token_file(root), self._append)]
        return [LocalStatusEndpoint(token_file(root, group), functools.partial(
            append_event, group_metrics_log(self.workspace.metrics_log, group)))
            for group in range(len(self.relay.readers))]

    def _own_code_launch(self, manifest: Path, index: int, rendezvous: Rendezvous,
                         checkpoint_dir: Path) -> AgentLaunch:
        """Node `index` of own code; in a replica group, told its group and the lighthouse
        as the operator tells its pods, and reporting to its group's endpoint."""
        group = 0 if self.relay is None else self._group_of(index)
        launch = own_code_agent_launch(self.job, manifest, index, rendezvous, checkpoint_dir,
                                       self.endpoints[group].reporter_env(),
                                       self.workspace.torchrun_logs,
                                       len(self.micro_batches) - 1)
        if self.relay is not None:
            assert self.lighthouse_url is not None
            launch.env.update(replica_group_env(self.job, index, self.lighthouse_url))
        return launch

    def _watch(self, nodes: list[Node], restart_group: Callable[[int], list[Node]]
               ) -> _Attempt:
        clock = ProgressClock(step=-1, since=time.monotonic())
        policy = self.job.spec.run_policy
        while True:
            self._read_events(clock, nodes)
            if self.signals:
                name = signal.Signals(self.signals[-1]).name
                return _Attempt(stop=_Stop(f"interrupted by {name}", EXIT_INTERRUPTED))
            now = time.monotonic()
            for group, due in sorted(self.group_restarts_due.items()):
                if now >= due:
                    del self.group_restarts_due[group]
                    for node in restart_group(group):
                        nodes[node.index] = node
            waiting = {index for group in self.group_restarts_due
                       for index in self._group_nodes(group)}
            statuses = [node.poll() for node in nodes]
            failed = [(node, code) for node, code in zip(nodes, statuses, strict=True)
                      if code is not None and code != 0 and node.index not in waiting]
            if failed:
                failures = [self._node_failure(node, code) for node, code in failed]
                if not self._restart_groups_alone(nodes, [node for node, _ in failed], failures):
                    return _Attempt(failures=failures)
                continue
            # Finished: every node not waiting out a backoff exited 0. A group still waiting
            # then is not started again: it would only resume from the last checkpoint and
            # end at once (when every group waits, no node is left to have finished).
            others = [code for node, code in zip(nodes, statuses, strict=True)
                      if node.index not in waiting]
            if others and all(code == 0 for code in others):
                if self.group_restarts_due:
                    named = ", ".join(str(group) for group in sorted(self.group_restarts_due))
                    self.display.say(f"replica group {named} not started again: the other "
                                     "groups finished training")
                    self.group_restarts_due = {}
                self._read_events(clock, nodes)
                return _Attempt(finished=True)
            if clock.is_hung(policy, now):
                return _Attempt(failures=[GroupFailure(
                    f"no training progress for {clock.stalled_for(now):.0f}s "
                    f"(spec.runPolicy.{clock.deadline(policy)[1]})", None, self.history.step)])
            deadline = policy.active_deadline_seconds
            if deadline is not None and now - self.started > deadline:
                return _Attempt(stop=_Stop(f"running longer than {deadline}s "
                                           "(spec.runPolicy.activeDeadlineSeconds)", EXIT_FAILED))
            time.sleep(POLL_SECONDS)

    def _restart_groups_alone(self, nodes: list[Node], failed: list[Node],
                              failures: list[GroupFailure]) -> bool:
        """With spec.faultTolerance, restart the replica groups of the failed nodes and no
        other, as the operator does: True when they are restarting (their other nodes
        stopped, each group due again after the policy's backoff). False leaves it to the
        whole job's restart: without groups, out of memory or a failed preflight check (as
        on Kubernetes), or when the policy ends the job."""
        if self.relay is None or any(f.failure_class == "PreflightFailed" for f in failures):
            return False
        spec = self.job.spec
        decision = after_attempt(
            spec, self.counted, failures, micro_batch_size=self.job.micro_batch_size,
            out_of_memory_restarts=len(self.micro_batches) - 1,
            world_size=spec.workers.replicas * spec.workers.procs_per_worker)
        if decision.counted is None or not decision.restart:
            return False
        self._log_failure(failures[0])
        self.counted.append(decision.counted)
        self.restarts.append(decision.reason)
        groups = sorted({self._group_of(node.index) for node in failed})
        group_nodes = [nodes[index] for group in groups for index in self._group_nodes(group)]
        named = ", ".join(str(group) for group in groups)
        self.display.say(f"{decision.reason}: restarting replica group {named} alone in "
                         f"{decision.delay:g}s (restart {len(self.counted)} of "
                         f"{spec.run_policy.max_restarts}); the other groups train on")
        self._stop_all(group_nodes, FAILED_GROUP_GRACE_SECONDS)
        for group in groups:
            self.group_restarts_due[group] = time.monotonic() + decision.delay
        return True

    def _read_events(self, clock: ProgressClock | None = None,
                     nodes: list[Node] | None = None) -> None:
        """Show the new metrics-log events; kill the nodes --kill-worker-at-step names."""
        if self.commits is not None:
            for commit in self.commits.new(force=nodes is None):
                self._append(commit)
        if self.relay is not None:
            self.relay.pump()
        for event in self.reader.read_new():
            self.history.apply(event)
            self.display.show(event, self.history)
            if clock is not None and event["event"] in {"step", "start", "resumed"}:
                clock.observe(self.history.step, time.monotonic(),
                              is_step=event["event"] == "step")
            if event["event"] == "step":
                if self.goodput is not None:
                    self.goodput.stepped(event)
                if self.out_of_memory_at is not None:
                    self.oom_recovery_seconds.append(
                        float(event.get("time", time.time())) - self.out_of_memory_at)
                    self.out_of_memory_at = None
                if nodes:
                    self._inject_kills(nodes)

    def _inject_kills(self, nodes: list[Node]) -> None:
        # A kill fires once, at the first step logged at or after it, in whichever
        # attempt gets there: replaying the same steps after a resume does not re-fire it.
        while self.pending_kills and self.history.step >= self.pending_kills[0]:
            at = self.pending_kills.pop(0)
            victim = nodes[-1]  # the last node: not the rendezvous host, like most lost nodes
            self.display.say(f"step {self.history.step}: killing worker {victim.index} "
                             f"(--kill-worker-at-step {at})")
            victim.lose()
            self.lost_nodes.add(victim.index)

    def _node_failure(self, node: Node, code: int) -> GroupFailure:
        kind = self._failure_class(node, code)
        if code < 0:
            what = f"worker {node.index} was lost (killed by {signal.Signals(-code).name})"
        else:
            what = f"worker {node.index} failed with exit code {code}"
            if kind != "Unknown":
                what += f" ({kind})"
            self.display.say(f"{what}; the end of {self.workspace.worker_log(node.index)}:")
            for line in self._log_tail(node.index):
                self.display.say(f"  | {line}")
        step = self.history.step
        return GroupFailure(f"{what} at step {step}", code, step, kind,
                            node_lost=node.index in self.lost_nodes)

    def _failure_class(self, node: Node, code: int) -> str:
        """The class the operator would give this node's pod (kubetrain.operator.failures),
        from its termination log and the run's OOM-kill count since the attempt began."""
        log = self.workspace.logs / f"worker-{node.index}.termination-log"
        said = trainer_failure(log.read_text() if log.exists() else None)
        after = oom_kills()
        oom_killed = (after is not None and self.oom_kills_before is not None
                      and after > self.oom_kills_before)
        return node_failure_class(code, said.failure_class if said is not None else None,
                                  oom_killed, self.job.spec.run_policy.permanent_exit_codes,
                                  lost=node.index in self.lost_nodes)

    def _log_tail(self, index: int) -> list[str]:
        text = self.workspace.worker_log(index).read_text(errors="replace")
        return text.splitlines()[-LOG_TAIL_LINES:]

    def _stop_all(self, nodes: list[Node], grace_seconds: float) -> None:
        """SIGTERM every agent; after `grace_seconds`, or another Ctrl-C, kill what is left."""
        signals_before = len(self.signals)
        for node in nodes:
            node.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_seconds
        while any(node.poll() is None for node in nodes):
            self._read_events()
            if len(self.signals) > signals_before or time.monotonic() > deadline:
                break
            time.sleep(POLL_SECONDS)
        for node in nodes:
            if node.poll() is None:
                node.lose()

    # --- signals, waiting and the end ------------------------------------------------

    @contextmanager
    def _signals_forwarded(self) -> Iterator[None]:
        def note(signum: int, _frame: FrameType | None) -> None:
            self.signals.append(signum)

        previous = {sig: signal.signal(sig, note) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _sleep(self, seconds: float) -> bool:
        """Wait `seconds`; False if interrupted meanwhile."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not self.signals:
            time.sleep(max(0.0, min(POLL_SECONDS, deadline - time.monotonic())))
        return not self.signals

    def _finished_reason(self) -> str:
        finished = self.history.finished
        return str(finished.get("reason", "finished")) if finished else "all workers exited 0"

    def _finish(self, succeeded: bool, reason: str, exit_code: int) -> int:
        self.display.close()
        outcome = Outcome(succeeded, reason, time.monotonic() - self.started, self.restarts,
                          self.checkpoints_before, self.micro_batches,
                          self.oom_recovery_seconds, own_code=self.job.spec.own_code)
        logs = f"{self.workspace.logs}/, {self.workspace.metrics_log}"
        print(summary(self.job.metadata.name, self.history, outcome, self.job.spec.checkpoint.uri,
                      logs), flush=True)
        print(f"  {'report':<17}{write_after_run(self.workspace.root)}", flush=True)
        return exit_code
