"""How `kubetrain run` starts one simulated node: the torchrun command line and its environment.

A local run stands in for the operator's worker pods: node `i` is a `torchrun`
agent (`python -m kubetrain.trainer.launch`, torchrun for the trainer, as in a
pod) with the settings of worker pod `i` (procs per worker, the `kubetrain`
rendezvous, elastic nnodes), but the rendezvous is on loopback, the group never grows
past `replicas`, and the trainer reads the run folder's copy of the manifest. Pure: the
runner starts what `agent_launch` describes, and `--dry-run` prints the same thing.

An own-code job (spec.trainer) runs as its worker pods do
(kubetrain.operator.own_code_container): `python -m kubetrain.trainer.own_code`, which
restores the newest checkpoint into the node's own KUBETRAIN_CHECKPOINT_DIR and uploads the
folders the code marks complete, around the same torchrun agent running the user's command
(`own_code_agent_launch`). torchrun's settings, the programs and the variables' names are
the conventions both runners share (`kubetrain.pod_conventions`).
"""

from __future__ import annotations

import os
import random
import socket
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from kubetrain.api.trainingjob import EnvVar, TrainingJob
from kubetrain.pod_conventions import (
    FINAL_SYNC_SECONDS_ENV,
    OWN_CODE_ENTRY_MODULE,
    SHUTDOWN_TIMEOUT_ENV,
    TRAINER_LAUNCH_MODULE,
    torchrun_settings,
)
from kubetrain.sdk.batch import OUT_OF_MEMORY_RESTARTS_ENV
from kubetrain.sdk.checkpoints import CHECKPOINT_DIR_ENV

RENDEZVOUS_HOST = "127.0.0.1"


@dataclass(frozen=True)
class Rendezvous:
    """The c10d rendezvous one attempt of the worker group meets at."""

    port: int
    run_id: str

    @property
    def endpoint(self) -> str:
        return f"{RENDEZVOUS_HOST}:{self.port}"


@dataclass(frozen=True)
class AgentLaunch:
    """One simulated node: its index, command line, and the variables added to the
    environment; `options`, torchrun's options on that command line, by name, in order
    (each `--name value`, after the interpreter and its module)."""

    index: int
    argv: list[str]
    env: dict[str, str]
    options: dict[str, str] = field(default_factory=dict)


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now.

    Chosen below the kernel's ephemeral range: a port from that range (what binding to
    port 0 gives) can become any outgoing connection's source port between this probe
    and the bind that needs it, and that bind then fails with "Address already in use".
    """
    low = _ephemeral_ports_start()
    for _ in range(64):
        port = random.randrange(max(1024, low - 16384), low)
        with socket.socket() as probe:
            try:
                probe.bind((RENDEZVOUS_HOST, port))
            except OSError:
                continue
            return port
    with socket.socket() as probe:  # all tried were taken: the kernel's choice, then
        probe.bind((RENDEZVOUS_HOST, 0))
        return int(probe.getsockname()[1])


def _ephemeral_ports_start() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where unreadable)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def threads_per_process(job: TrainingJob, cpus: int | None = None) -> int:
    """CPU threads each training process may use so the whole local group fits the machine.

    Every simulated node's processes share this machine's cores; without a limit
    each would start one thread per core and they would slow each other down.
    """
    processes = job.spec.workers.replicas * job.spec.workers.procs_per_worker
    return max(1, (cpus or os.cpu_count() or 1) // processes)


def agent_launch(
    job: TrainingJob, manifest: Path, metrics_log: Path, index: int, rendezvous: Rendezvous,
    log_dir: Path, metrics_port: int | None = None
) -> AgentLaunch:
    """The torchrun agent of simulated node `index` for one attempt of the group; torchrun's
    own files under `log_dir`; rank 0's /metrics on `metrics_port` if given, else on
    spec.metrics.port."""
    options = _torchrun_options(job, rendezvous, log_dir)
    argv = [
        sys.executable, "-m", TRAINER_LAUNCH_MODULE,
        *(word for option, value in options.items() for word in (f"--{option}", value)),
        str(manifest), "--metrics-log", str(metrics_log),
        *(("--metrics-port", str(metrics_port)) if metrics_port is not None else ()),
    ]
    env = {
        # Literal variables of the pod template apply locally too; valueFrom ones
        # (Secrets) come from the user's own environment instead.
        **_literal_env(job.spec.workers.template.env),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads_per_process(job))),
        "PYTHONUNBUFFERED": "1",
    }
    return AgentLaunch(index, argv, env, options)


def _torchrun_options(job: TrainingJob, rendezvous: Rendezvous, log_dir: Path
                      ) -> dict[str, str]:
    """torchrun's options of a worker pod, each with its value, and where its files go."""
    settings = torchrun_settings(
        job, endpoint=rendezvous.endpoint, run_id=rendezvous.run_id,
        # At most `replicas` nodes ever start here, so the rendezvous closes as soon as they
        # have all joined instead of waiting for maxReplicas that will never come.
        max_nodes=job.spec.workers.replicas,
        # The runner owns restarts: a failed process ends the agent, and the runner
        # restarts the whole group under spec.runPolicy, counting each restart once.
        max_restarts=0)
    return {
        **settings,
        # Its files (a failed worker's error.json) in the run folder: by default each agent
        # makes a /tmp/torchelastic_* folder of its own that nothing removes (a pod's /tmp
        # goes with its container; this machine's stays).
        "log-dir": str(log_dir),
    }


def _literal_env(variables: Iterable[EnvVar]) -> dict[str, str]:
    return {var.name: var.value for var in variables if var.value is not None}


# Seconds torchrun gives own code's processes to save after SIGTERM, and the entry then
# uploads the last checkpoint: together within the runner's grace for a stopping group.
OWN_CODE_SHUTDOWN_SECONDS = 60
OWN_CODE_FINAL_SYNC_SECONDS = 45
# How often the entry uploads marked folders: a local run wants them up soon.
OWN_CODE_SYNC_SECONDS = 1.0


def own_code_agent_launch(job: TrainingJob, manifest: Path, index: int,
                          rendezvous: Rendezvous, checkpoint_dir: Path,
                          reporter_env: dict[str, str], log_dir: Path,
                          out_of_memory_restarts: int = 0) -> AgentLaunch:
    """Simulated node `index` of an own-code job: kubetrain's entry around torchrun and the
    user's command, with the node's own checkpoint folder (a pod's emptyDir), the local
    status endpoint's variables and torchrun's files under `log_dir`."""
    trainer = job.spec.trainer
    if trainer is None:
        raise ValueError(f"{job.metadata.name} runs kubetrain's trainer: use agent_launch")
    argv = [
        sys.executable, "-m", OWN_CODE_ENTRY_MODULE,
        "--sync-interval", f"{OWN_CODE_SYNC_SECONDS:g}", str(manifest), "--",
        sys.executable, "-m", "torch.distributed.run",
        *(word for option, value in _torchrun_options(job, rendezvous, log_dir).items()
          for word in (f"--{option}", value)),
        *trainer.torchrun_arguments(),
    ]
    env = {
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads_per_process(job))),
        "PYTHONUNBUFFERED": "1",
        SHUTDOWN_TIMEOUT_ENV: str(OWN_CODE_SHUTDOWN_SECONDS),
        FINAL_SYNC_SECONDS_ENV: str(OWN_CODE_FINAL_SYNC_SECONDS),
        CHECKPOINT_DIR_ENV: str(checkpoint_dir.resolve()),
        OUT_OF_MEMORY_RESTARTS_ENV: str(out_of_memory_restarts),
        **reporter_env,
        # The user's own last, so that they win over ours, as in the pod.
        **_literal_env(job.spec.workers.template.env),
        **_literal_env(trainer.env),
    }
    return AgentLaunch(index, argv, env)
