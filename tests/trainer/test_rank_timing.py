"""Per-rank timing in a real 2-process torchrun (gloo, FSDP2): every rank's compute and
collective wait reach rank 0's metrics log, labelled, and add up to the step time."""

from __future__ import annotations

import socket

from kubetrain.api.manifest import load_job


def test_both_ranks_report_compute_and_wait_that_add_up_to_the_step_time(tiny_job,
                                                                         launcher) -> None:
    job = tiny_job("timed", optimization={"maxSteps": 12},
                   metrics={"logEverySteps": 4})
    assert load_job(job).spec.parallelism.strategy == "fsdp"
    steps = launcher.train(job, ranks=2)
    logged = [event for event in steps if event["event"] == "step"]
    assert [event["step"] for event in logged] == [4, 8, 12]
    host = socket.gethostname()  # no downward API outside a pod: the host names both
    for event in logged:
        ranks = event["ranks"]
        assert [timing["rank"] for timing in ranks] == [0, 1]
        for timing in ranks:
            assert (timing["pod_name"], timing["node"]) == (host, host)
            assert timing["compute_seconds"] > 0 and timing["wait_seconds"] > 0, ranks
            # The steps' own time: the interval's less what lies between steps (logging).
            busy = timing["compute_seconds"] + timing["wait_seconds"]
            assert 0.5 * event["step_time"] < busy <= 1.01 * event["step_time"], (busy, event)
