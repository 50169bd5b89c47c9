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
    for event in logged[1:]:
        # The steps' own time: the interval's less what lies between steps (logging). Not
        # the first interval: `step_time` is rank 0's, and in the first step a rank that
        # reached the loop earlier waits for the other, so its interval began earlier.
        for timing in event["ranks"]:
            busy = timing["compute_seconds"] + timing["wait_seconds"]
            assert 0.5 * event["step_time"] < busy < 1.1 * event["step_time"], (busy, event)


def test_a_group_of_one_waits_for_nobody(tiny_job, launcher) -> None:
    job = tiny_job("alone", optimization={"maxSteps": 8}, metrics={"logEverySteps": 4})
    logged = [event for event in launcher.train(job, ranks=1) if event["event"] == "step"]
    assert len(logged) == 2
    for event in logged:
        [timing] = event["ranks"]
        assert timing["rank"] == 0 and timing["wait_seconds"] == 0
        assert 0.5 * event["step_time"] < timing["compute_seconds"] < 1.1 * event["step_time"]
