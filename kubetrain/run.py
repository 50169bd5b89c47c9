"""Run a TrainingJob on this machine: simulated nodes as local torchrun agents, live progress.

The same manifest you would `kubectl apply`: `spec.workers.replicas` simulated
nodes, each a `torchrun` agent with `procsPerWorker` training processes, meet at
a c10d rendezvous on loopback and run the real trainer. Relative data and
checkpoint paths live under ./runs/JOB/ (with the metrics log, the manifest the
trainer reads and each worker's log); s3:// URIs use spec.storage and the AWS
credentials in your environment. The run policy applies as on Kubernetes:
restarts with backoff up to maxRestarts, hang detection, deadlines.

A job annotated `kubetrain.io/prepare-from: CORPUS` has spec.data.train prepared
from CORPUS (a path or URI, or `python-stdlib` for the standard library's own
source) on its first run, as `kubetrain prepare` would; examples/quickstart.yaml
does this.

A job with its own code (spec.trainer) runs the same way: each simulated node runs
kubetrain's own-code entry around torchrun and your command, so checkpoints your code marks
complete are uploaded to spec.checkpoint.uri and restored before every attempt, and reports
through kubetrain.sdk or transformers' KubeflowCallback drive the progress bar.

A job with replica groups (spec.faultTolerance) runs each group as its own torchrun
group beside torchft's lighthouse, and a failed group restarts alone while the others
train on, as under the operator.

Ctrl-C saves a checkpoint and stops; the same command again resumes from it.
`--dry-run` shows what would run here next to the Pod the operator would create.

The command sits above both runners: it runs the local runner (`kubetrain.local`), and its
dry run shows that runner's launch beside the operator's Pod (`kubetrain.operator`), which
neither runner may import of the other.
"""

from __future__ import annotations

import argparse
import shlex
import socket
import sys
from typing import Any

from kubetrain.api.manifest import InvalidManifest, load_job
from kubetrain.api.trainingjob import TrainingJob
from kubetrain.local.launch import AgentLaunch, Rendezvous, agent_launch
from kubetrain.local.own_code import Commit, CommitListing, OpenListing
from kubetrain.local.replica_groups import group_metrics_log
from kubetrain.local.workspace import (
    PREPARE_FROM_ANNOTATION,
    PYTHON_STDLIB,
    Workspace,
    copy_stdlib_sources,
)
from kubetrain.pod_conventions import pet_variable, replica_group_env, replica_group_of


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("manifest", metavar="JOB.yaml", help="the TrainingJob manifest")
    parser.add_argument(
        "--dry-run", action="store_true",
        help="print the commands and environment of each simulated node and the Pod the "
        "operator would create for worker 0, then exit",
    )
    parser.add_argument(
        "--kill-worker-at-step", dest="kill_at_steps", type=_step, action="append", default=[],
        metavar="N",
        help="kill a worker (its agent and training processes, with SIGKILL, like a lost "
        "node) when the run first reaches step N, to watch it recover from the latest "
        "checkpoint; repeatable",
    )


def _step(text: str) -> int:
    step = int(text)
    if step < 1:
        raise argparse.ArgumentTypeError(f"a step is a positive number, got {step}")
    return step


def run(args: argparse.Namespace) -> int:
    try:
        job = load_job(args.manifest)
    except (InvalidManifest, OSError) as error:
        print(f"kubetrain run: {error}", file=sys.stderr)
        return 2
    workspace = Workspace.of(job)
    local_job = workspace.localize(job)
    if args.dry_run:
        print(own_code_dry_run(job, local_job, workspace) if job.spec.own_code
              else dry_run(job, local_job, workspace))
        return 0

    from kubetrain.local.runner import LocalRun, RunOptions

    if job.spec.run_policy.suspend:
        print(f"kubetrain run: {job.metadata.name} is suspended (spec.runPolicy.suspend: true): "
              "set it to false to run it", file=sys.stderr)
        return 1
    options = RunOptions(kill_at_steps=tuple(args.kill_at_steps))
    if job.spec.own_code:
        print(_own_code_plan(local_job, workspace), file=sys.stderr)
        return LocalRun(local_job, workspace, options, _commit_listing(local_job)).run()
    if _port_in_use(job.spec.metrics.port):
        print(f"kubetrain run: spec.metrics.port {job.spec.metrics.port} is already in use on "
              "this machine (another run?): stop it or choose another port", file=sys.stderr)
        return 1
    try:
        source = ensure_data(local_job, workspace)
    except (ValueError, FileNotFoundError) as error:
        print(f"kubetrain run: {error}", file=sys.stderr)
        return 1
    if source is not None:
        print(f"prepared {local_job.spec.data.train} from {source} "
              f"(the {PREPARE_FROM_ANNOTATION} annotation)", file=sys.stderr)
    print(_plan(local_job, workspace), file=sys.stderr)
    return LocalRun(local_job, workspace, options).run()


def _commit_listing(job: TrainingJob) -> OpenListing:
    """Own code's commits under a URI, read with the trainer's storage layer for the local
    runner (which imports nothing of the trainer)."""
    from kubetrain.trainer.checkpoint_sync import commits
    from kubetrain.trainer.storage import open_storage

    def open_listing(uri: str) -> CommitListing:
        storage = open_storage(uri, job.spec.storage)
        return CommitListing(storage.uri, lambda: [Commit(commit.folder, commit.step)
                                                   for commit in commits(storage)])

    return open_listing


# Demo-data shape: small shards so every data-parallel rank reads from several, and a
# validation split large enough for a stable loss on a corpus of a few MB.
DEMO_SHARD_TOKENS = 1 << 18
DEMO_VALIDATION_FRACTION = 0.05


def corpus_inputs(source: str, workspace: Workspace) -> list[str]:
    """The inputs `kubetrain prepare` reads for a prepare-from annotation value."""
    if source != PYTHON_STDLIB:
        return [source]
    # The top level of the standard library: a few MB of real Python, without the
    # site-packages and test data that share its folder. Copied into one folder of
    # the run, so the user can see what the model trains on.
    return [str(copy_stdlib_sources(workspace.root / "corpus"))]


def ensure_data(job: TrainingJob, workspace: Workspace) -> str | None:
    """Make sure `spec.data.train` holds prepared data before any worker starts.

    Prepares it from the job's prepare-from corpus when it is missing and returns
    that corpus; returns None when the data was already there. Without the
    annotation, missing data raises FileNotFoundError at once, rather than after
    every restart the run policy allows. `job` must be localized
    (`Workspace.localize`).
    """
    from kubetrain.trainer.prepare import INDEX_NAME, TOKENIZER_NAME, prepare
    from kubetrain.trainer.storage import open_storage

    source = job.metadata.annotations.get(PREPARE_FROM_ANNOTATION)
    train = job.spec.data.train
    if open_storage(train, job.spec.storage).exists(INDEX_NAME):
        return None
    if source is None:
        raise FileNotFoundError(
            f"spec.data.train ({train}) holds no prepared data: run `kubetrain prepare "
            f"CORPUS -o {train.rstrip('/').removesuffix('/train')}`, or annotate the job with "
            f"{PREPARE_FROM_ANNOTATION}: CORPUS to have `kubetrain run` prepare it")
    output, _, split = train.rstrip("/").rpartition("/")
    if split != "train" or not output:
        raise ValueError(f"spec.data.train ({train}) must end in /train to be prepared from "
                         f"the {PREPARE_FROM_ANNOTATION} annotation: `kubetrain prepare` writes "
                         "OUTPUT/train and OUTPUT/validation")
    init = job.spec.model.init
    if job.spec.model.from_teacher and job.spec.distillation is not None:
        init = job.spec.distillation.teacher  # a student sized from it shares its vocabulary
    # A pretrained model reads token ids of its own tokenizer: the one its folder holds.
    tokenizer: dict[str, Any] = (
        {"tokenizer": f"{init.rstrip('/')}/{TOKENIZER_NAME}"} if init is not None
        else {"vocab_size": job.spec.model.resolve().vocab_size})
    prepare(corpus_inputs(source, workspace), output, **tokenizer,
            shard_tokens=DEMO_SHARD_TOKENS, validation_fraction=DEMO_VALIDATION_FRACTION,
            storage=job.spec.storage)
    return source


def _port_in_use(port: int) -> bool:
    """Whether something listens on `port`, where rank 0 will serve its metrics."""
    with socket.socket() as probe:
        # Connections of an earlier run lingering in TIME_WAIT do not count, a listener does.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError:
            return True
    return False


def _length(job: TrainingJob) -> str:
    """How long the job trains, as its spec says it."""
    opt = job.spec.optimization
    if opt.epochs is not None:
        return f"{opt.epochs:g} epochs"
    return f"{opt.steps_for(tokens_per_epoch=0, seq_len=1, world_size=1)} steps"


def _plan(job: TrainingJob, workspace: Workspace) -> str:
    workers = job.spec.workers
    nodes = "node" if workers.replicas == 1 else "nodes"
    processes = "process" if workers.procs_per_worker == 1 else "processes"
    return (f"{job.metadata.name}: {workers.replicas} simulated {nodes} x "
            f"{workers.procs_per_worker} training {processes}{_groups(job)}, "
            f"{_length(job)}; "
            f"data {job.spec.data.train}, checkpoints {job.spec.checkpoint.uri}, "
            f"metrics http://127.0.0.1:{job.spec.metrics.port}/metrics, logs {workspace.logs}/")


def _groups(job: TrainingJob) -> str:
    tolerance = job.spec.fault_tolerance
    return ("" if tolerance is None else
            f" in {tolerance.replica_groups} replica groups under torchft's lighthouse")


def _own_code_plan(job: TrainingJob, workspace: Workspace) -> str:
    workers = job.spec.workers
    assert job.spec.trainer is not None
    nodes = "node" if workers.replicas == 1 else "nodes"
    processes = "process" if workers.procs_per_worker == 1 else "processes"
    return (f"{job.metadata.name}: {workers.replicas} simulated {nodes} x "
            f"{workers.procs_per_worker} {processes} of your code "
            f"({shlex.join([*job.spec.trainer.command, *job.spec.trainer.args])})"
            f"{_groups(job)}; "
            f"checkpoints {job.spec.checkpoint.uri}, logs {workspace.logs}/")


def own_code_dry_run(job: TrainingJob, local_job: TrainingJob, workspace: Workspace) -> str:
    """What `kubetrain run` would start here for an own-code job, and the worker container
    the operator would run instead (kubetrain.operator.own_code_container)."""
    import yaml

    from kubetrain.local.launch import own_code_agent_launch
    from kubetrain.local.own_code import node_checkpoint_dir
    from kubetrain.local.trainer_status_endpoint import token_file
    from kubetrain.operator.own_code_container import own_code_container

    lines = [f"# {job.metadata.name}: your code here (kubetrain run) and on Kubernetes",
             "# here: each node's checkpoint folder is emptied at every attempt, which "
             "restores the newest commit of spec.checkpoint.uri first, as a new pod does; "
             "rendezvous port 0 = a free port per attempt"]
    if job.spec.fault_tolerance is not None:
        lines.append("# here: each replica group is a torchrun group of its own, beside "
                     "torchft's lighthouse at 127.0.0.1:<port>; a failed group restarts alone, "
                     "and each group's rank 0 reports to an endpoint of its own")
    for index in range(job.spec.workers.replicas):
        group = replica_group_of(job, index)
        reporter = {"KUBEFLOW_TRAINER_SERVER_URL": "http://127.0.0.1:<port>/status",
                    "KUBEFLOW_TRAINER_SERVER_TOKEN": str(token_file(workspace.root, group))}
        launch = own_code_agent_launch(local_job, workspace.manifest, index,
                                       _dry_run_rendezvous(job, index),
                                       node_checkpoint_dir(workspace, index), reporter,
                                       workspace.torchrun_logs)
        if group is not None:
            launch.env.update(replica_group_env(job, index, "http://127.0.0.1:<port>"))
        lines.append(f"\n# simulated node {index} (output: {workspace.worker_log(index)})")
        lines.append(_shell_lines(launch.env, launch.argv))
    container = own_code_container(job)
    lines.append(f"\n# on Kubernetes: {job.spec.workers.replicas} worker Pods, each running")
    lines.append(yaml.safe_dump({"image": container.image, "command": container.command,
                                 "env": container.env}, sort_keys=False).rstrip())
    return "\n".join(lines)


def dry_run(job: TrainingJob, local_job: TrainingJob, workspace: Workspace) -> str:
    """What `kubetrain run` would start here, and the Pod the operator would create instead.

    First a table of torchrun's settings in both places, then each simulated
    node's command and the worker Pod in full. Only the variables the runner
    adds are shown: the rest of the environment is passed through unprinted, so
    credentials in it never appear.
    """
    import yaml

    from kubetrain.operator.children import worker_pod

    launches = [_local_launch(local_job, workspace, index)
                for index in range(job.spec.workers.replicas)]
    pod: dict[str, Any] = worker_pod(job, 0, 0)
    restarts = ("the runner restarts the whole group under spec.runPolicy"
                if job.spec.fault_tolerance is None else
                "the runner restarts a failed replica group alone under spec.runPolicy, "
                "beside torchft's lighthouse at 127.0.0.1:<port> (a free port per run)")
    lines = [f"# {job.metadata.name}: torchrun here (kubetrain run) and on Kubernetes "
             "(the operator's worker Pod)",
             *_side_by_side(launches[0], pod),
             f"# here: rendezvous port 0 = a free port per attempt; torchrun's own restarts "
             f"are off because {restarts}",
             f"# here: the trainer reads {workspace.manifest} (relative paths resolved under "
             f"{workspace.root}/); each node's environment is yours plus the variables shown"]
    for launch in launches:
        lines.append(f"\n# simulated node {launch.index} "
                     f"(output: {workspace.worker_log(launch.index)})")
        lines.append(_shell_lines(launch.env, launch.argv))
    lines.append(f"\n# on Kubernetes: the operator creates {job.spec.workers.replicas} "
                 "such Pods (worker-0 shown), torchrun settings as PET_* variables")
    lines.append(yaml.safe_dump(pod, sort_keys=False).rstrip())
    return "\n".join(lines)


def _local_launch(job: TrainingJob, workspace: Workspace, index: int) -> AgentLaunch:
    """Node `index` as `kubetrain run` starts it (ports shown as 0 or <port>): with
    spec.faultTolerance, on its replica group's rendezvous, told its group and the
    lighthouse, writing its group's metrics log (kubetrain.local.replica_groups)."""
    group = replica_group_of(job, index)
    if group is None:
        return agent_launch(job, workspace.manifest, workspace.metrics_log, index,
                            _dry_run_rendezvous(job, index), workspace.torchrun_logs)
    launch = agent_launch(job, workspace.manifest,
                          group_metrics_log(workspace.metrics_log, group), index,
                          _dry_run_rendezvous(job, index), workspace.torchrun_logs)
    launch.env.update(replica_group_env(job, index, "http://127.0.0.1:<port>"))
    return launch


def _dry_run_rendezvous(job: TrainingJob, index: int) -> Rendezvous:
    """Node `index`'s rendezvous as the runner names it, its port and ids shown as
    placeholders: the run's, or its replica group's (kubetrain.local.runner)."""
    run_id = f"{job.metadata.name}-<pid>-<attempt>"
    group = replica_group_of(job, index)
    return Rendezvous(port=0, run_id=run_id if group is None
                      else f"{run_id}-group-{group}-<restart>")


def _side_by_side(launch: AgentLaunch, pod: dict[str, Any]) -> list[str]:
    """One row per torchrun option: its value here and in the Pod (PET_<OPTION> variables)."""
    container = pod["spec"]["containers"][0]
    in_pod = {var["name"]: var.get("value", "") for var in container["env"]
              if var["name"].startswith("PET_")}
    rows = [("torchrun option", "here", "in the Pod")]
    for option, value in launch.options.items():
        rows.append((f"--{option}", value, in_pod.get(pet_variable(option), "-")))
    # `python -m kubetrain.trainer.launch --option value ... JOB.yaml [trainer options]`:
    # the program's manifest follows the options the launch says it has.
    argv = launch.argv
    program = argv[3 + 2 * len(launch.options)]
    rows.append(("program", " ".join([*argv[1:3], program]),
                 " ".join(container["command"][1:])))
    widths = [max(len(row[column]) for row in rows) for column in range(2)]
    return [f"#   {a:<{widths[0]}}  {b:<{widths[1]}}  {c}" for a, b, c in rows]


def _shell_lines(env: dict[str, str], argv: list[str]) -> str:
    """`env` and `argv` as one shell command, an option and its value per line."""
    parts = [f"{name}={shlex.quote(value)}" for name, value in env.items()]
    words = [shlex.quote(word) for word in argv]
    # Start a new line at each option so the command reads like the Pod's PET_* list, and
    # at the program after them.
    command = [" ".join(words[:3])]
    for word in words[3:]:
        if word.startswith("-") or not command[-1].startswith("-") or " " in command[-1]:
            command.append(word)
        else:
            command[-1] += f" {word}"
    return " \\\n  ".join([" ".join(parts), *command])
