"""HSDP on the whole loop (issue 35): two pods of two processes under
`parallelism.strategy: hsdp`, through a container kill and a rescale, to Succeeded.

One compact job on the session's whole loop (tests/e2e/conftest.py: `cluster`; the
harness is tests/cluster/whole_loop.py), as the user sees it: the mesh the trainer lays
out from the pod shape (replicate across the 2 pods x shard within each), the preflight
that all-reduced over both of its dimensions, a kill -9 of worker 1's whole container
(the operator replaces the pod and the group resumes on the same 2 x 2 mesh), then
`kubectl scale tj --replicas=1`: under hsdp, replicas is the replicate dimension only, so
the one pod left shards over its own 2 processes (a replicate dimension of one is fsdp),
and the checkpoint written by the 2 x 2 mesh resumes on it. Four trainer processes on
CI's 2 cores are slow: the `tiny` preset and 16 steps.
"""

from __future__ import annotations

import re
import time

import pytest
from whole_loop import EVERY, Cluster, training_job
from whole_loop import advanced_after_resume as _advanced_after_resume
from whole_loop import steps_printed as _steps_printed

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = 16
PREFLIGHT = re.compile(r"preflight: 4 ranks passed in \d+\.\d+s \(matmul ok, all-reduce "
                       r"\d+\.\d+ GB/s median, links \d+\.\d+ GB/s median, \d+\.\d+ min"
                       r"(?:; measured again[^;]*)?; "  # a link slow once on a busy host
                       r"by mesh dimension, GB/s median, "
                       r"dp_replicate \d+\.\d+, dp_shard \d+\.\d+\)")


def _resumed_with(lines: list[str], processes: int) -> bool:
    """Whether rank 0 resumed with `processes` processes and printed a step after it."""
    marks = [index for index, line in enumerate(lines) if line.startswith("resumed from ")
             and line.endswith(f"with {processes} processes")]
    return bool(marks) and bool(_steps_printed(lines[marks[-1]:]))


def test_hsdp_2x2_resumes_after_a_container_kill_and_on_one_pod_after_a_rescale(
        cluster: Cluster) -> None:
    name = "hsdp"
    started = time.monotonic()
    try:
        # Below maxReplicas, torchrun's rendezvous waits its last call (30 s by default) for
        # more nodes before it closes a round: 20 s here, which the replacement pod after
        # the kill comes well within (6 s on a quiet machine), and the rescale to one pod
        # waits out.
        last_call = {"name": "PET_RDZV_CONF", "value": "last_call_timeout=20"}
        cluster.apply(training_job(
            name, cluster.s3, optimization={"maxSteps": STEPS},
            workers={"replicas": 2, "minReplicas": 1, "maxReplicas": 2, "procsPerWorker": 2,
                     "template": {"env": [last_call]}},
            parallelism={"strategy": "hsdp"}))
        cluster.wait_for_printed_step(name, EVERY + 1, timeout=300)
        lines = cluster.trainer_lines(name)
        assert "mesh: hsdp 2 x 2 (replicate x shard) (parallelism.strategy: hsdp)" in lines, lines
        [checked] = [line for line in lines if line.startswith("preflight:")]
        print(checked)
        assert PREFLIGHT.fullmatch(checked), checked

        # kill -9 of worker 1's container: the pod fails, the operator replaces it, and the
        # group resumes from the last checkpoint on the same mesh.
        cluster.kill_container(f"{name}-worker-1")
        cluster.wait_for("hsdp to advance again on 4 processes after the container kill",
                         lambda: _advanced_after_resume(cluster.trainer_lines(name))
                         and _resumed_with(cluster.trainer_lines(name), 4), 240, every=0.2)
        killed = cluster.trainer_lines(name)
        assert killed.count("mesh: hsdp 2 x 2 (replicate x shard) (parallelism.strategy: hsdp)") \
            == 2, killed

        # replicas 2 -> 1: the replicate dimension goes, each pod's shard stays as it was.
        mark = len(killed)
        cluster.scale(name, 1)
        cluster.wait_for(f"{name} to train on one pod of 2 processes",
                         lambda: _resumed_with(cluster.trainer_lines(name)[mark:], 2), 240,
                         every=0.2)
        cluster.wait_for_phase(name, "Succeeded", timeout=300)
        seconds = time.monotonic() - started

        lines = cluster.trainer_lines(name)
        after = lines[mark:]
        assert "mesh: fsdp 2 (parallelism.strategy: hsdp)" in after, after
        resumes = [line for line in lines if line.startswith("resumed from ")]
        print("\n".join(resumes))
        # A resume on the 2 x 2 mesh after the kill, and last one on one pod after the
        # rescale. Between them there may be one more: with minReplicas 1, worker 0's
        # agent, back at the rendezvous within a second, closes a round alone if the
        # replacement pod's agent comes after the last call (a loaded machine); it trains
        # on 2 processes until the group grows back to 4, elastic as configured.
        assert [r for r in resumes if r.endswith("with 4 processes")], resumes
        assert resumes[-1].endswith("with 2 processes") and len(resumes) <= 3, resumes
        printed = _steps_printed(lines)
        assert printed[-1] == STEPS and sorted(set(printed)) == list(range(1, STEPS + 1)), printed
        assert cluster.job(name)["status"]["phase"] == "Succeeded"
        print(f"hsdp 2 x 2 job with a container kill and a rescale to 1 pod: {seconds:.0f}s "
              "from apply to Succeeded")
    finally:  # a failed scenario leaves no pod behind on the shared cluster
        cluster.delete(name)
