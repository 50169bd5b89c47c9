"""`kubetrain run` end to end: real torchrun agents running the real trainer on a tiny job.

Each test starts `python -m kubetrain run` in its own folder (so `runs/` lands
there), as a user would, and reads what the run left behind: the trainer's
metrics log, the checkpoints and the exported model.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.local.runs import (
    events,
    finish,
    of_kind,
    start_run,
    tiny_job,
    training_processes,
    wait_for_step,
)

pytestmark = pytest.mark.slow

def exported_weights(s3_endpoint: str, export_uri: str) -> dict[str, Any]:
    import boto3
    from safetensors.torch import load

    bucket, _, prefix = export_uri.removeprefix("s3://").partition("/")
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    body = client.get_object(Bucket=bucket, Key=f"{prefix}/model.safetensors")["Body"].read()
    return load(body)


def test_run_recovers_from_a_lost_worker_matches_an_uninterrupted_run_and_books_goodput(
        tmp_path: Path, corpus: Path, s3_endpoint: str, s3_bucket: str) -> None:
    import torch

    storage = {"endpoint": s3_endpoint, "region": "us-east-1"}
    data = f"s3://{s3_bucket}/data"
    max_steps = 100
    results = {}
    outputs = {}
    # The kill comes 15 steps after the checkpoint of step 40: the heartbeats of the steps
    # redone may lag a few steps on a loaded machine, and some must have landed.
    for name, extra in (("steady", ()), ("killed", ("--kill-worker-at-step", "55"))):
        manifest = tiny_job(name, corpus, data, f"s3://{s3_bucket}/{name}",
                            max_steps=max_steps, storage=storage)
        # A heartbeat per step, so the goodput accounting resolves the kill to the step.
        manifest["spec"]["metrics"]["logEverySteps"] = 1
        code, outputs[name] = finish(start_run(tmp_path / name, manifest, *extra))
        assert code == 0, outputs[name]
        results[name] = events(tmp_path / name, name)

    killed = results["killed"]
    (finished,) = of_kind(killed, "finished")
    assert finished["step"] == max_steps
    resumed = of_kind(killed, "resumed")
    assert len(resumed) == 1, "the kill should have caused exactly one resume"
    assert 0 < resumed[0]["step"] <= 55, "resumed from a checkpoint saved before the kill"
    val_losses = [event["val_loss"] for event in of_kind(killed, "eval")]
    assert val_losses[-1] < val_losses[0] - 1.0, f"validation loss did not fall: {val_losses}"

    steady_weights = exported_weights(s3_endpoint, of_kind(results["steady"], "finished")[0]
                                      ["export_uri"])
    killed_weights = exported_weights(s3_endpoint, finished["export_uri"])
    assert steady_weights.keys() == killed_weights.keys()
    for key, value in steady_weights.items():
        torch.testing.assert_close(killed_weights[key], value, rtol=0, atol=0, msg=key)

    _assert_goodput_books_the_kill(tmp_path / "killed", "killed", killed, outputs["killed"])


def _assert_goodput_books_the_kill(folder: Path, name: str, found: list[dict[str, Any]],
                                   output: str) -> None:
    """The lost worker's cost is booked as lost progress and downtime, and every second of
    the run's wall time is in exactly one cause."""
    (resumed,) = of_kind(found, "resumed")
    before_resume = found[:found.index(resumed)]
    redone = [event for event in of_kind(before_resume, "step")
              if event["step"] > resumed["step"]]
    # Each step event's step_time is the wall time of its one-step log interval, and a
    # heartbeat follows each, written in the background: the resume names the step of the
    # last heartbeat written before the kill (on loaded cores the last few may still be on
    # their way at the kill; the time after the last one written is downtime).
    through = resumed["redone_through"]
    assert through is not None and resumed["step"] + 2 <= through <= redone[-1]["step"], (
        resumed, len(redone))
    # The heartbeats are rank 0's goodput events' totals: the ledger books the productive
    # time between the checkpoint's and that heartbeat's as lost progress, and keeps the
    # rest of the stretch in its causes (a rank slowed by the loaded machine is `straggler`
    # time). The checkpoint holds one rank's ledger as of the save, after the evaluation,
    # the event rank 0's as of the log before it: they differ by the ranks' milliseconds
    # between the two (5-20 ms measured), far less than any cause wrongly carried.
    totals = {event["step"]: event["seconds"] for event in of_kind(before_resume, "goodput")}
    carried = {cause: totals[through][cause] - totals[resumed["step"]][cause]
               for cause in totals[through]}
    seconds = of_kind(found, "goodput")[-1]["seconds"]
    assert seconds["lost_progress"] == pytest.approx(carried["productive"], abs=0.1), carried
    # Against the step events' own clock: the stretch's step time (summed, not estimated from
    # a typical step: on loaded cores a few take twice the median) is its productive,
    # straggler and data-wait time; the first redone step's interval also holds the
    # resumed checkpoint's save and evaluation, booked as those.
    times = [event["step_time"] for event in redone if event["step"] <= through]
    stepping = carried["productive"] + carried["straggler"] + carried["data_wait"]
    print(f"redone {len(redone)} steps, {len(times)} of them before the last heartbeat, in "
          f"{sum(times):.3f}s ({sum(times[1:]):.3f}s without the first); lost progress "
          f"{seconds['lost_progress']:.3f}s; the stretch's causes "
          f"{ {cause: round(spent, 3) for cause, spent in carried.items() if spent} }")
    assert 0.9 * sum(times[1:]) <= stepping <= 1.1 * sum(times), times

    # The runner's own clock says when the job began (the first attempt's launch) and the
    # trainer's finished event when it ended: every second between is in one cause.
    worker_log = (folder / "runs" / name / "logs" / "worker-0.log").read_text()
    assert f"steps {resumed['step'] + 1}-{through} are trained again" in worker_log
    launched = float(re.findall(r"attempt 0, launched at ([0-9.]+)", worker_log)[0])
    wall = of_kind(found, "finished")[0]["time"] - launched
    print(f"causes sum to {sum(seconds.values()):.3f}s of {wall:.3f}s wall: {seconds}")
    assert sum(seconds.values()) == pytest.approx(wall, rel=0.02)
    assert seconds["downtime"] > 0 and seconds["startup"] > 0
    assert seconds["checkpoint_load"] > 0 and seconds["evaluation"] > 0
    assert "goodput" in output and "lost progress" in output
    # The resume loaded from S3 (no memory tier): its load is booked there, and only it.
    tiers = of_kind(found, "goodput")[-1]["checkpoint_load_tiers"]
    assert 0 < tiers["s3"] <= seconds["checkpoint_load"], tiers
    assert tiers["memory"] == tiers["partner"] == 0, tiers


def test_interrupted_run_saves_a_checkpoint_and_the_same_command_resumes_it(
        tmp_path: Path, corpus: Path) -> None:
    name = "interrupted"
    manifest = tiny_job(name, corpus, "data", "checkpoints", max_steps=60)
    run = start_run(tmp_path, manifest)
    wait_for_step(run, tmp_path, name, 25)
    # While it runs, rank 0's metrics endpoint is live at the spec's port.
    url = f"http://127.0.0.1:{manifest['spec']['metrics']['port']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
    assert families["kubetrain_step"].samples[0].value >= 25
    run.send_signal(signal.SIGINT)
    code, output = finish(run)
    assert code == 130, output

    stopped = events(tmp_path, name)
    assert not of_kind(stopped, "finished")
    saved = max(event["step"] for event in of_kind(stopped, "checkpoint"))
    last_logged = max(event["step"] for event in of_kind(stopped, "step"))
    assert saved >= last_logged, "the checkpoint on SIGINT holds the latest step"
    assert (tmp_path / "runs" / name / "data" / "train" / "index.json").exists()

    code, output = finish(start_run(tmp_path, manifest))
    assert code == 0, output
    after = events(tmp_path, name)[len(stopped):]
    assert [event["step"] for event in of_kind(after, "resumed")] == [saved]
    assert of_kind(after, "finished")[0]["step"] == 60
    assert "resumed from" in output and "succeeded" in output
    assert json.loads((tmp_path / "runs" / name / "metrics.jsonl").read_text()
                      .splitlines()[-1])["event"] == "finished"

    # And the model it trained can be sampled from.
    sampled = subprocess.run(
        [sys.executable, "-m", "kubetrain", "generate", "--checkpoint", f"runs/{name}/checkpoints",
         "--prompt", "def ", "--max-tokens", "20", "--seed", "0"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=True)
    assert sampled.stdout.startswith("def ") and len(sampled.stdout) > len("def \n")


def test_a_frozen_worker_is_detected_as_a_hang_and_the_group_restarts(
        tmp_path: Path, corpus: Path) -> None:
    name = "frozen"
    manifest = tiny_job(name, corpus, "data", "checkpoints", max_steps=60,
                        # The start has a deadline of its own, long enough for a restarted
                        # group to start and resume under CI load (two test workers on two
                        # cores), so the hang is seen 12 s after the last step.
                        run_policy={"progressDeadlineSeconds": 12,
                                    "startupDeadlineSeconds": 120})
    run = start_run(tmp_path, manifest)
    wait_for_step(run, tmp_path, name, 25)
    # SIGSTOP one rank: the others block in their next collective, so no step advances.
    os.kill(max(training_processes(tmp_path)), signal.SIGSTOP)
    code, output = finish(run)
    assert code == 0, output
    assert "no training progress for" in output
    found = events(tmp_path, name)
    assert len(of_kind(found, "resumed")) == 1
    assert of_kind(found, "finished")[0]["step"] == 60
    assert training_processes(tmp_path) == []
    # torchrun's own folders are in the run folder, one per node and attempt, not in /tmp.
    assert len(list((tmp_path / "runs" / name / "logs" / "torchrun").iterdir())) == 4


def test_run_fine_tunes_a_qwen3_checkpoint_and_exports_what_transformers_loads(
        tmp_path: Path, corpus: Path, prepared_corpus: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A small Qwen3-shaped model made here by transformers (random weights, heads wider
    than hidden / heads, per-head q/k norms), saved as a hub folder with its tokenizer:
    `kubetrain run` prepares the corpus with that tokenizer, two FSDP ranks load it under
    the qwen3-0.6b preset's training defaults, fine-tune, and export a Qwen3ForCausalLM that
    transformers loads with no missing or unexpected key and the checkpoint's logits."""
    import torch
    import transformers

    from kubetrain.trainer.generate import load_model

    folder = tmp_path / "qwen3"
    config = transformers.Qwen3Config(
        vocab_size=prepared_corpus.train.vocab_size, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=256, tie_word_embeddings=True,
        bos_token_id=prepared_corpus.train.eos_token_id,
        eos_token_id=prepared_corpus.train.eos_token_id)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(folder)
    tokenizer = Path(prepared_corpus.tokenizer_uri.removeprefix("file://"))
    (folder / "tokenizer.json").write_bytes(tokenizer.read_bytes())

    name = "qwen3"
    manifest = tiny_job(name, corpus, "data", "checkpoints", max_steps=12)
    manifest["spec"]["model"] = {"preset": "qwen3-0.6b", "init": str(folder)}
    manifest["spec"]["workers"] = {"replicas": 1, "procsPerWorker": 2}
    manifest["spec"]["optimization"].update(learningRate=3e-3, warmupSteps=2)
    manifest["spec"]["evaluation"] = {"everySteps": 12, "batches": 4}
    code, output = finish(start_run(tmp_path, manifest))
    assert code == 0, output

    found = events(tmp_path, name)
    assert [event["uri"] for event in of_kind(found, "initialised")] == [str(folder)]
    val_losses = [event["val_loss"] for event in of_kind(found, "eval")]
    assert val_losses[-1] < val_losses[0] - 0.5, val_losses  # it fine-tuned
    (finished,) = of_kind(found, "finished")
    exported = Path(finished["export_uri"].removeprefix("file://"))
    assert json.loads((exported / "config.json").read_text())["model_type"] == "qwen3"
    assert (exported / "tokenizer.json").read_bytes() == tokenizer.read_bytes()

    hf, loading = transformers.AutoModelForCausalLM.from_pretrained(
        exported, dtype=torch.float32, output_loading_info=True)
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    assert not any(loading.values()), loading
    monkeypatch.chdir(tmp_path)  # the spec the checkpoint records names runs/... paths
    trained = load_model(f"runs/{name}/checkpoints").model
    tokens = torch.randint(0, config.vocab_size, (2, 64),
                           generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, trained(tokens), rtol=1e-5, atol=1e-5)
