"""`python -m kubetrain.trainer JOB.yaml`: train one TrainingJob (run under torchrun: in a
worker pod, `python -m kubetrain.trainer.launch` runs this module in forked processes).

Exit codes, read by the operator and the local runner: 0 training complete
(maxSteps or early stopping; under torchrun, a process signalled past its last step ends
by that SIGTERM once complete, see `end_by_sigterm`); 143 stopped by SIGTERM/SIGINT after
saving a checkpoint; 75 another rank was signalled, the checkpoint is saved and this
rank exits so torchrun re-forms the group; 2 an invalid manifest, or a
model.init that does not fit it (permanent); 87 the device ran out of memory,
88 a collective timed out, 89 the preflight check failed (runPolicy.preflight) and
90 the GPU itself failed (all four also written, with their class, into the
termination message: under torchrun the pod's exit code is torchrun's, and for 87,
89 and 90 the worker asks its torchrun agent to stop rather than restart in place);
anything else a failure.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from kubetrain.api.manifest import InvalidManifest, load_job
from kubetrain.protocol import EXIT_COMPLETE, EXIT_INVALID_MANIFEST, RANK_PROCESS_PREFIX
from kubetrain.trainer.collector import collector_paused


def name_process() -> None:
    """Name this process after its rank (`kt-rank-N` in ps, top and /proc/PID/comm):
    under kubetrain.trainer.launch every training process has its fork server's
    command line."""
    rank = os.environ.get("RANK")
    if rank is not None and sys.platform == "linux":
        Path("/proc/self/comm").write_text(f"{RANK_PROCESS_PREFIX}{rank}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kubetrain.trainer", description=(__doc__ or "").strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("job", metavar="JOB.yaml", help="the TrainingJob manifest")
    parser.add_argument(
        "--metrics-log", default=os.environ.get("KUBETRAIN_METRICS_LOG", "metrics.jsonl"),
        help="JSONL metrics log written by rank 0 (env KUBETRAIN_METRICS_LOG; "
        "default ./metrics.jsonl)",
    )
    parser.add_argument(
        "--metrics-port", type=int, default=None,
        help="serve /metrics on this port instead of spec.metrics.port (`kubetrain run` gives "
        "each replica group's rank 0 its own, as each pod has its own network)",
    )
    args = parser.parse_args(argv)
    name_process()
    try:
        job = load_job(args.job)
    except InvalidManifest as error:
        print(f"invalid TrainingJob: {error}", file=sys.stderr)
        return EXIT_INVALID_MANIFEST
    if args.metrics_port is not None:
        metrics = job.spec.metrics.model_copy(update={"port": args.metrics_port})
        job = job.model_copy(update={"spec": job.spec.model_copy(update={"metrics": metrics})})

    # torch loads only once the manifest is valid; without the collector's passes over the
    # objects it creates (0.3-0.5 s of 2 s), and they are then left out of every later pass.
    with collector_paused():
        from kubetrain.trainer.fault_tolerance import NotInAReplicaGroup
        from kubetrain.trainer.loop import Trainer
        from kubetrain.trainer.pretrained_config import PretrainedError

    try:
        result = Trainer(job, metrics_log=args.metrics_log).fit()
    # model.init or a distillation teacher this job cannot use; replica groups not started
    except (PretrainedError, NotInAReplicaGroup) as error:
        print(f"invalid TrainingJob: {error}", file=sys.stderr)
        return EXIT_INVALID_MANIFEST
    if (result.signal_unanswered and result.exit_code == EXIT_COMPLETE
            and "TORCHELASTIC_RUN_ID" in os.environ):
        end_by_sigterm()
    return result.exit_code


def end_by_sigterm() -> None:
    """End this process by the SIGTERM that came as its run finished, its work done.

    Under torchrun a training process that returns 0 then waits for its agent to read the
    result (torch's worker wrapper), and an agent that sent SIGTERM is stopping its workers
    (a new member at the rendezvous, the pod deleted): it never reads, and kills them only
    at its shutdown timeout, 30 s, which the group's restart waits out. Ended by the
    signal, it lets go at once; the run's last checkpoint is saved, so a restart finds the
    job done.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    try:
        code = main()
    finally:
        # Nothing the collector could still free matters at exit, and its passes over the
        # objects torch creates took 0.85 s of each trainer process's 1 s exit; a
        # survivor's exit is part of every restart of its group.
        gc.freeze()
    sys.exit(code)
