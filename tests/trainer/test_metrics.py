"""Rank 0's reporting: the Prometheus exposition passes promtool, the metrics log has the
documented events, and `Trainer` runs in-process as a notebook would call it."""

from __future__ import annotations

import gc
import json
import multiprocessing
import subprocess
import urllib.request
from pathlib import Path

import pytest
import torch
from host_tools import require_tool
from prometheus_client.parser import text_string_to_metric_families

from kubetrain.api.manifest import load_job
from kubetrain.trainer import Trainer
from kubetrain.trainer.metrics import Reporter, StepReport
from kubetrain.trainer.rank_timing import RankTiming

LOG_FIELDS = {
    "step": {"event", "step", "max_steps", "epoch", "loss", "lr", "grad_norm",
             "tokens_per_second", "mfu", "step_time", "data_wait_ratio", "ranks", "time"},
    "eval": {"event", "step", "val_loss", "perplexity", "time"},
    "checkpoint": {"event", "step", "uri", "val_loss", "best", "time"},
    "resumed": {"event", "step", "uri", "world_size", "redone_through", "time"},
    "start": {"event", "step", "max_steps", "world_size", "output_loss", "time"},
    "finished": {"event", "step", "reason", "best_val_loss", "export_uri", "export_step",
                 "export_format", "time"},
    "goodput": {"event", "step", "ratio", "seconds", "time"},
}
# Seconds by cause, as the goodput ledger reports them (cumulative since the job began).
GOODPUT_SECONDS = {"productive": 600.0, "data_wait": 12.0, "checkpoint_save": 20.0,
                   "checkpoint_load": 8.0, "startup": 45.0, "evaluation": 30.0,
                   "lost_progress": 50.0, "downtime": 35.0, "oom": 0.0, "straggler": 3.0,
                   "preflight": 1.0, "degraded": 0.0}
# Rank 1 computes longer; rank 0 waits for it.
RANKS = (RankTiming(0, "job-worker-0", "node-a", 0.15, 0.10, 6.0),
         RankTiming(1, "job-worker-1", "node-b", 0.24, 0.01, 9.6))


def _report_a_run(reporter: Reporter) -> None:
    reporter.resumed(40, "file:///ckpt/step-00000040", 2, redone_through=47)
    reporter.started(40, 2)
    reporter.stepped(41, 1024, 0.25)
    reporter.logged(StepReport(step=41, epoch=0.5, loss=3.5, learning_rate=1e-3, grad_norm=0.9,
                               tokens_per_second=4096.0, mfu=0.0, step_time=0.25,
                               data_wait_ratio=0.01, ranks=RANKS), torch.device("cpu"))
    reporter.evaluated(41, 3.75)
    reporter.checkpointed(41, "file:///ckpt/step-00000041", 1_700_000_000.0)
    reporter.accounted(41, GOODPUT_SECONDS)
    reporter.finished(41, "max_steps", 3.75, None)


def test_the_exposition_passes_promtool_and_the_log_has_the_documented_events(
        tiny_job, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = load_job(tiny_job("reported"))
    log = tmp_path / "metrics.jsonl"
    reporter = Reporter(job.spec, enabled=True, metrics_log=log, job_name="reported")
    try:
        _report_a_run(reporter)
        url = f"http://127.0.0.1:{job.spec.metrics.port}/metrics"
        exposition = urllib.request.urlopen(url, timeout=10).read().decode()
    finally:
        reporter.close()

    families = {f.name: f for f in text_string_to_metric_families(exposition)}
    assert families["kubetrain_step"].samples[0].value == 41
    assert families["kubetrain_epoch"].samples[0].value == 0.5
    assert families["kubetrain_validation_loss"].samples[0].value == 3.75
    assert families["kubetrain_latest_checkpoint_step"].samples[0].value == 41
    assert all(not sample.labels for f in families.values() for sample in f.samples
               if f.type != "histogram" and f.name not in {
                   "kubetrain_wall_time_seconds", "kubetrain_checkpoint_load_seconds",
                   "kubetrain_rank_compute_seconds",
                   "kubetrain_rank_wait_seconds", "kubetrain_rank_compute_time_seconds"})
    per_rank = {(name, sample.labels["rank"], sample.labels["pod_name"], sample.labels["node"]):
                sample.value for name in ("kubetrain_rank_compute_seconds",
                                          "kubetrain_rank_wait_seconds",
                                          "kubetrain_rank_compute_time_seconds")
                for sample in families[name].samples if not sample.name.endswith("_created")}
    assert per_rank == {
        ("kubetrain_rank_compute_seconds", "0", "job-worker-0", "node-a"): 0.15,
        ("kubetrain_rank_compute_seconds", "1", "job-worker-1", "node-b"): 0.24,
        ("kubetrain_rank_wait_seconds", "0", "job-worker-0", "node-a"): 0.10,
        ("kubetrain_rank_wait_seconds", "1", "job-worker-1", "node-b"): 0.01,
        ("kubetrain_rank_compute_time_seconds", "0", "job-worker-0", "node-a"): 6.0,
        ("kubetrain_rank_compute_time_seconds", "1", "job-worker-1", "node-b"): 9.6}
    by_cause = {sample.labels["cause"]: sample.value
                for sample in families["kubetrain_wall_time_seconds"].samples}
    assert by_cause == GOODPUT_SECONDS
    assert families["kubetrain_goodput_ratio"].samples[0].value == pytest.approx(
        600 / sum(GOODPUT_SECONDS.values()))

    # The operator reads the same exposition into status.goodput and the ETA.
    from kubetrain.operator.facts import metrics_sample
    from kubetrain.operator.observation import goodput_status

    sample = metrics_sample(exposition)
    assert sample.wall_seconds == GOODPUT_SECONDS and sample.step_time == 0.25
    # ... and every rank's compute time into the straggler rule, for the logged interval.
    assert sample.ranks_step == 41
    assert [(rank.rank, rank.pod, rank.node, rank.compute_seconds, rank.compute_seconds_total)
            for rank in sample.ranks] == [(0, "job-worker-0", "node-a", 0.15, 6.0),
                                          (1, "job-worker-1", "node-b", 0.24, 9.6)]
    status = goodput_status(sample.wall_seconds).wire()
    wall = sum(GOODPUT_SECONDS.values())
    assert status["productiveSeconds"] == 600 and status["wallSeconds"] == round(wall)
    assert status["badputSeconds"]["lostProgress"] == 50
    assert status["ratio"] == round(600 / wall, 4)
    promtool = require_tool("promtool", "prometheus")
    checked = subprocess.run([promtool, "check", "metrics"], input=exposition,
                             capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0 and not checked.stdout.strip(), checked.stdout + checked.stderr

    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["event"] for e in events] == [
        "resumed", "start", "step", "eval", "checkpoint", "goodput", "finished"]
    for event in events:
        assert set(event) == LOG_FIELDS[event["event"]]
    assert events[0]["redone_through"] == 47  # steps 41-47 are redone: lost progress
    # The resumed line keeps its shape (the whole loop's tests match its end); the steps
    # trained again follow on a line of their own.
    printed = capsys.readouterr().out.splitlines()
    assert printed[:2] == [
        "resumed from file:///ckpt/step-00000040 at step 40 with 2 processes",
        "steps 41-47 are trained again (after the checkpoint, before the restart)"], printed


def test_a_reporter_on_another_rank_writes_and_serves_nothing(tiny_job, tmp_path: Path) -> None:
    job = load_job(tiny_job("silent"))
    reporter = Reporter(job.spec, enabled=False, metrics_log=tmp_path / "m.jsonl",
                        job_name="silent")
    _report_a_run(reporter)
    reporter.close()
    assert not (tmp_path / "m.jsonl").exists()


def test_trainer_fits_in_process_as_a_group_of_one(tiny_job, tmp_path: Path) -> None:
    """What a notebook does: no torchrun, no environment; the group is left as found."""
    path = tiny_job("notebook", optimization={"maxSteps": 6, "warmupSteps": 2},
                    evaluation={"everySteps": 3, "batches": 2},
                    checkpoint={"export": True})
    spec = load_job(path).spec
    gc.collect()  # what earlier tests in this process left is not this fit's to answer for
    result = Trainer(spec, metrics_log=tmp_path / "log.jsonl", serve_metrics=False).fit()

    assert (result.step, result.reason, result.exit_code) == (6, "max_steps", 0)
    assert result.export_uri is not None and result.export_uri.endswith("/export")
    assert not torch.distributed.is_initialized()
    evals = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()
             if '"eval"' in line]
    assert result.best_val_loss == min(e["val_loss"] for e in evals)
    events = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    final = [e for e in events if e["event"] == "goodput"][-1]
    assert final["seconds"]["productive"] > 0 and final["seconds"]["startup"] > 0
    assert final["seconds"]["evaluation"] > 0 and final["seconds"]["checkpoint_save"] > 0
    assert final["seconds"]["lost_progress"] == final["seconds"]["downtime"] == 0
    assert 0 < final["ratio"] < 1

    # Then the notebook forks (a DataLoader's workers, Linux's default start method), and the
    # child collects garbage: no dead gloo group of the fit may be among it, whose destructor
    # would wait forever in the child for the parent's threads.
    child = multiprocessing.get_context("fork").Process(target=gc.collect)
    child.start()
    child.join(timeout=30)
    hung = child.is_alive()
    if hung:
        child.kill()
    assert not hung and child.exitcode == 0, "a process forked after fit() hung collecting it"


def test_checkpoint_load_by_tier_reaches_the_exposition_the_log_and_the_jobs_status(
        tiny_job, tmp_path: Path) -> None:
    from prometheus_client import generate_latest

    from kubetrain.operator.facts import metrics_sample
    from kubetrain.operator.observation import goodput_status
    from kubetrain.trainer.metrics import REGISTRY

    job = load_job(tiny_job("tiers"))
    log = tmp_path / "metrics.jsonl"
    reporter = Reporter(job.spec, enabled=True, metrics_log=log, job_name="tiers", serve=False)
    # Beyond what any earlier test of this process booked: the counters are process-wide.
    seconds = {**GOODPUT_SECONDS, "checkpoint_load": 4000.0}
    tiers = {"memory": 1000.5, "partner": 0.0, "s3": 2999.5}
    try:
        reporter.accounted(50, seconds, tiers)
    finally:
        reporter.close()
    exposition = generate_latest(REGISTRY).decode()
    shown = {sample.labels["tier"]: sample.value
             for family in text_string_to_metric_families(exposition)
             if family.name == "kubetrain_checkpoint_load_seconds"
             for sample in family.samples if sample.name.endswith("_total")}
    assert shown == tiers
    (event,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert event["checkpoint_load_tiers"] == tiers and event["seconds"] == seconds

    sample = metrics_sample(exposition)
    assert sample.checkpoint_load_seconds == tiers
    status = goodput_status(sample.wall_seconds or {}, sample.checkpoint_load_seconds).wire()
    assert status["badputSeconds"]["checkpointLoad"] == 4000.0
    assert status["badputSeconds"]["checkpointLoadByTier"] == tiers
    # A trainer that does not export the split leaves it out of the status.
    assert "checkpointLoadByTier" not in goodput_status(seconds).wire()["badputSeconds"]


def test_a_run_appending_after_a_torn_last_line_starts_its_records_on_a_line_of_their_own(
        tiny_job, tmp_path: Path) -> None:
    job = load_job(tiny_job("torn"))
    log = tmp_path / "metrics.jsonl"
    whole = json.dumps({"event": "step", "step": 7, "loss": 3.5}) + "\n"
    log.write_text(whole + '{"event": "step", "step": 8, "lo')  # the last run ended mid-line
    reporter = Reporter(job.spec, enabled=True, metrics_log=log, job_name="torn", serve=False)
    try:
        reporter.started(8, 1)
    finally:
        reporter.close()

    first, torn, started = log.read_text().splitlines()
    assert json.loads(first)["step"] == 7 and torn == '{"event": "step", "step": 8, "lo'
    assert json.loads(started)["event"] == "start"
    # A log that ends where a line does gets no blank line.
    reporter = Reporter(job.spec, enabled=True, metrics_log=log, job_name="torn", serve=False)
    try:
        reporter.started(8, 1)
    finally:
        reporter.close()
    assert [json.loads(line)["event"] for line in log.read_text().splitlines()[2:]] == [
        "start", "start"]
