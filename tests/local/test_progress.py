"""Following the trainer's metrics log and showing it (kubetrain.local.metrics_log, .progress)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from kubetrain.local.metrics_log import MetricsLogReader, RunHistory, parse_lines
from kubetrain.local.progress import Outcome, ProgressDisplay, summary


def line(**event: Any) -> str:
    return json.dumps(event) + "\n"


def step(n: int, loss: float) -> str:
    return line(event="step", step=n, max_steps=100, loss=loss, lr=1e-3, grad_norm=1.0,
                tokens_per_second=5000.0, mfu=0.0, step_time=0.1, data_wait_ratio=0.0,
                time=1.0)


def test_reader_returns_each_complete_line_once_and_waits_for_a_partial_one(
        tmp_path: Path) -> None:
    log = tmp_path / "metrics.jsonl"
    reader = MetricsLogReader(log)
    assert reader.read_new() == []  # not written yet
    first, second = step(10, 5.0), step(20, 4.0)
    log.write_text(first + second[:15])
    assert [e["step"] for e in reader.read_new()] == [10]
    with log.open("a") as f:
        f.write(second[15:])
    assert [e["step"] for e in reader.read_new()] == [20]
    assert reader.read_new() == []


def test_lines_that_are_not_events_are_skipped() -> None:
    text = "not json\n[1, 2]\n{\"no_event\": 1}\n" + step(1, 2.0)
    assert [e["event"] for e in parse_lines(text)] == ["step"]


def test_history_follows_a_run_with_a_resume() -> None:
    history = RunHistory()
    events = parse_lines(
        line(event="start", step=0, world_size=2, time=0)
        + step(10, 6.0)
        + line(event="eval", step=10, val_loss=5.5, perplexity=244.7, time=1)
        + line(event="checkpoint", step=10, uri="s3://b/ckpt/step-10", time=2)
        + step(20, 4.0)
        + line(event="resumed", step=10, uri="s3://b/ckpt/step-10", world_size=2, time=3)
        + step(20, 4.1)
        + line(event="eval", step=20, val_loss=3.5, perplexity=33.1, time=4)
        + line(event="finished", step=20, reason="max_steps", best_val_loss=3.5,
               export_uri="s3://b/ckpt/export", time=5)
    )
    steps_seen = []
    for event in events:
        history.apply(event)
        steps_seen.append(history.step)
    assert steps_seen == [0, 10, 10, 10, 20, 10, 20, 20, 20]
    assert (history.first_loss, history.loss) == (6.0, 4.1)
    assert history.val_losses == [(10, 5.5), (20, 3.5)]
    assert history.resumed_from == [10]
    assert history.best_val_loss == 3.5
    latest = history.latest_checkpoint
    assert latest is not None and (latest.step, latest.uri) == (10, "s3://b/ckpt/step-10")
    assert history.finished is not None


def test_display_shows_step_loss_and_events() -> None:
    out = io.StringIO()
    display = ProgressDisplay(max_steps=100, stream=out)
    history = RunHistory()
    for event in parse_lines(step(10, 6.25) + line(event="eval", step=10, val_loss=5.5,
                                                   perplexity=244.7, time=1)):
        history.apply(event)
        display.show(event, history)
    display.close()
    text = out.getvalue()
    assert "10/100" in text
    assert "loss=6.2500" in text
    assert "validation loss 5.5000" in text


def test_summary_reports_losses_checkpoints_and_the_exported_model() -> None:
    history = RunHistory()
    for event in parse_lines(
        step(10, 6.0)
        + line(event="eval", step=10, val_loss=5.5, time=1)
        + line(event="checkpoint", step=10, uri="runs/x/checkpoints/step-10", time=2)
        + step(20, 4.0)
        + line(event="eval", step=20, val_loss=3.5, time=3)
        + line(event="finished", step=20, reason="max_steps", best_val_loss=3.5,
               export_uri="runs/x/checkpoints/export", time=4)
    ):
        history.apply(event)
    outcome = Outcome(True, "max_steps", 75.0, ["worker 1 was lost at step 15"], 0)
    text = summary("x", history, outcome, "runs/x/checkpoints", "runs/x/logs/")
    assert "x succeeded: max_steps (1m 15s)" in text
    assert "first 5.5000, final 3.5000, best 3.5000" in text
    assert "1 written by this run; latest: step 10 at runs/x/checkpoints/step-10" in text
    assert "worker 1 was lost at step 15" in text
    assert "exported model   runs/x/checkpoints/export" in text
    assert "kubetrain generate --checkpoint runs/x/checkpoints " in text


def test_summary_names_the_best_checkpoint_and_the_step_the_export_holds() -> None:
    history = RunHistory()
    for event in parse_lines(
        step(10, 6.0)
        + line(event="eval", step=10, val_loss=3.25, time=1)
        + line(event="checkpoint", step=10, uri="runs/x/checkpoints/step-00000010",
               val_loss=3.25, best=True, time=2)
        + step(20, 4.0)
        + line(event="eval", step=20, val_loss=3.5, time=3)
        + line(event="checkpoint", step=20, uri="runs/x/checkpoints/step-00000020",
               val_loss=3.5, best=False, time=4)
        + line(event="finished", step=20, reason="early_stopping", best_val_loss=3.25,
               export_uri="runs/x/checkpoints/export", export_step=10, time=5)
    ):
        history.apply(event)
    outcome = Outcome(True, "early_stopping", 30.0, [], 0)
    text = summary("x", history, outcome, "runs/x/checkpoints", "runs/x/logs/")
    assert ("best checkpoint  step 10, validation loss 3.2500, at "
            "runs/x/checkpoints/step-00000010") in text
    assert "runs/x/checkpoints/export (Hugging Face Llama: weights of step 10;" in text


SSM_FORMAT = "kubetrain SSM, model_type kubetrain_ssm, for model.init and kubetrain generate"


def test_summary_names_what_reads_an_export_the_trainer_says_is_not_a_llama() -> None:
    history = RunHistory()
    for event in parse_lines(step(20, 4.0) + line(
            event="finished", step=20, reason="max_steps", best_val_loss=None,
            export_uri="runs/s/checkpoints/export", export_step=20,
            export_format=SSM_FORMAT, time=5)):
        history.apply(event)
    text = summary("s", history, Outcome(True, "max_steps", 30.0, [], 0), "runs/s/checkpoints",
                   "runs/s/logs/")
    assert f"({SSM_FORMAT}: weights of step 20;" in text
    assert "Hugging Face Llama" not in text


def test_summary_breaks_the_wall_time_down_by_cause_from_the_latest_goodput_event() -> None:
    history = RunHistory()
    for event in parse_lines(
        line(event="goodput", step=5, ratio=0.5, seconds={"productive": 1.0, "startup": 1.0})
        + line(event="goodput", step=20, ratio=0.8, seconds={
            "productive": 80.0, "startup": 6.0, "downtime": 9.0, "lost_progress": 4.5,
            "data_wait": 0.5, "evaluation": 0.0})
    ):
        history.apply(event)
    outcome = Outcome(True, "max_steps", 100.0, [], 0)
    text = summary("x", history, outcome, "runs/x/checkpoints", "runs/x/logs/")
    assert ("goodput          80.0% of 1m 40s productive; badput: downtime 9.0s, "
            "startup 6.0s, lost progress 4.5s, data wait 0.5s") in text


def test_a_distillation_runs_terms_show_in_the_bar_and_the_summary() -> None:
    out = io.StringIO()
    display = ProgressDisplay(max_steps=100, stream=out)
    history = RunHistory()
    for event in parse_lines(line(event="step", step=10, max_steps=100, loss=4.25, ce_loss=6.5,
                                  kd_loss=2.0, tokens_per_second=5000.0, time=1.0)):
        history.apply(event)
        display.show(event, history)
    display.close()
    assert "loss=4.2500, ce=6.5000, kd=2.0000" in out.getvalue()
    text = summary("x", history, Outcome(True, "max_steps", 5.0, [], 0), "c", "l")
    assert "distillation     cross-entropy 6.5000, KD term 2.0000 at step 10" in text


def test_summary_says_which_tiers_the_checkpoint_load_came_from() -> None:
    history = RunHistory()
    for event in parse_lines(line(event="goodput", step=20, ratio=0.8, seconds={
            "productive": 80.0, "checkpoint_load": 2.5, "downtime": 17.5},
            checkpoint_load_tiers={"memory": 0.4, "partner": 0.0, "s3": 2.1})):
        history.apply(event)
    assert history.checkpoint_load_tiers == {"memory": 0.4, "partner": 0.0, "s3": 2.1}
    text = summary("x", history, Outcome(True, "max_steps", 100.0, [], 0),
                   "runs/x/checkpoints", "runs/x/logs/")
    assert ("badput: downtime 17.5s, checkpoint load 2.5s (memory 0.4s, s3 2.1s)") in text
