"""Throughput figures (tokens/s, MFU, step time) are measured over wall time.

On a GPU the host only enqueues kernels, so the loop must not time steps on the
host: it reads the clock at logged steps after synchronising the device, and its
intervals are contiguous. On CPU that shows as: the logged intervals add up to
the wall time of the loop, including the work done between steps (here an
evaluation after every logged step, which host-timed steps would leave out).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from kubetrain.api.manifest import load_job
from kubetrain.trainer import Trainer


def test_logged_intervals_add_up_to_the_wall_time_of_the_loop(tiny_job: Callable[..., Path],
                                                              tmp_path: Path) -> None:
    path = tiny_job("throughput", optimization={"maxSteps": 6, "warmupSteps": 2},
                    evaluation={"everySteps": 2, "batches": 24},
                    metrics={"logEverySteps": 2})
    log = tmp_path / "log.jsonl"
    Trainer(load_job(path).spec, metrics_log=log, serve_metrics=False).fit()

    events = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [e for e in events if e["event"] == "step"]
    evals = [e for e in events if e["event"] == "eval"]
    assert [e["step"] for e in steps] == [2, 4, 6]
    assert [e["step"] for e in evals] == [0, 2, 4, 6]
    # The loop starts right after the baseline evaluation and its last interval ends at
    # step 6's log; the evaluations at steps 2 and 4 fall inside.
    wall = steps[-1]["time"] - evals[0]["time"]
    measured = sum(2 * e["step_time"] for e in steps)
    assert abs(measured - wall) <= 0.05 * wall, (measured, wall)
    tokens = 2 * 8 * 64  # steps per interval x micro-batch x seqLen
    for event in steps:
        assert abs(event["tokens_per_second"] * 2 * event["step_time"] - tokens) < 1e-6 * tokens
