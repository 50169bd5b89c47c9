"""Real training runs: torchrun with 2 CPU ranks (gloo) and single processes, on a real corpus."""

from __future__ import annotations

import math
import signal
import subprocess
import time
import urllib.request

import pytest
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kubetrain.trainer.checkpoint import latest_checkpoint

# The fewest steps that show the learning claim with room to spare: the tiny model's
# validation loss (1,024 tokens a step at its preset's learning rate) is at 0.74 of its start
# at step 150, 0.72 at 200 and 0.70 at 300, under fsdp and ddp alike; a higher rate falls
# faster at first and then stalls (0.81 at step 150 at twice the rate).
LEARNS_STEPS = 200
BEST_LEARNING_RATE = 0.03  # too high for the tiny model: it learns, then diverges


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "checkpointing"), [("fsdp", "selective"), ("ddp", "full")])
def test_two_ranks_learn_the_corpus_in_bf16_with_activation_checkpointing(
        tiny_job, launcher, strategy: str, checkpointing: str) -> None:
    """FSDP2 and DDP, bf16 on gloo, with activation checkpointing: validation loss falls well."""
    job = tiny_job(
        f"learns-{strategy}",
        optimization={"maxSteps": LEARNS_STEPS, "warmupSteps": 20},
        evaluation={"everySteps": LEARNS_STEPS // 2, "batches": 8},
        parallelism={"strategy": strategy, "precision": "bf16",
                     "activationCheckpointing": checkpointing},
        metrics={"logEverySteps": 50},
    )
    # A guard against a hang, not a speed target: about 90 s alone on a slower 2-core
    # machine, 130 s beside the other worker's tests.
    events = launcher.train(job, ranks=2, timeout=480)

    evals = [e for e in events if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [0, LEARNS_STEPS // 2, LEARNS_STEPS]
    start, end = evals[0]["val_loss"], evals[-1]["val_loss"]
    # From near-uniform guessing (about ln(vocab)) to a model that has learned Python's tokens.
    assert end < 0.75 * start, f"validation loss went from {start:.3f} to {end:.3f}"
    assert [e["world_size"] for e in events if e["event"] == "start"] == [2]
    (finished,) = [e for e in events if e["event"] == "finished"]
    assert finished["reason"] == "max_steps" and finished["step"] == LEARNS_STEPS
    assert finished["best_val_loss"] == min(e["val_loss"] for e in evals)


@pytest.mark.slow
def test_same_global_batch_gives_the_same_losses_however_it_is_split(tiny_job, launcher) -> None:
    """8 sequences per step as 1x8 on one process, as 2 micro-batches of 4 on one process,
    and as 2 ranks x 2 micro-batches of 2 under FSDP2 and under DDP: the same training, up
    to fp32 reduction order (the data order is global, so every split sees the same samples).
    """
    steps = 12

    def losses(name: str, ranks: int, micro: int, accumulation: int, strategy: str) -> list:
        job = tiny_job(name, optimization={"maxSteps": steps, "microBatchSize": micro,
                                           "gradientAccumulationSteps": accumulation},
                       parallelism={"strategy": strategy})
        logged = [e for e in launcher.train(job, ranks) if e["event"] == "step"]
        assert [e["step"] for e in logged] == list(range(1, steps + 1))
        return [e["loss"] for e in logged] + [e["grad_norm"] for e in logged]

    whole_batch = losses("whole", 1, 8, 1, "fsdp")
    accumulated = losses("accumulated", 1, 4, 2, "fsdp")
    fsdp = losses("fsdp", 2, 2, 2, "fsdp")
    ddp = losses("ddp", 2, 2, 2, "ddp")
    for split in (accumulated, fsdp, ddp):
        assert split == pytest.approx(whole_batch, rel=1e-4)
    # The run learned something, so equal curves are not equal by being flat.
    assert whole_batch[steps - 1] < whole_batch[0] - 0.5


EXPORTED_METRICS = {
    "kubetrain_step", "kubetrain_max_steps", "kubetrain_epoch", "kubetrain_loss",
    "kubetrain_validation_loss",
    # Not kubetrain_ce_loss / kubetrain_kd_loss, the kubetrain_dynamics_* gauges nor the
    # kubetrain_replica_* ones: only jobs with a teacher, with INL dynamics or with
    # spec.faultTolerance export those.
    "kubetrain_learning_rate", "kubetrain_grad_norm", "kubetrain_tokens_per_second",
    "kubetrain_mfu_ratio", "kubetrain_step_duration_seconds", "kubetrain_data_wait_ratio",
    "kubetrain_memory_allocated_bytes", "kubetrain_memory_reserved_bytes",
    "kubetrain_last_step_timestamp_seconds", "kubetrain_restarts",
    "kubetrain_latest_checkpoint_step", "kubetrain_latest_checkpoint_timestamp_seconds",
    "kubetrain_best_checkpoint_step", "kubetrain_best_checkpoint_validation_loss",
    "kubetrain_tokens",  # a counter: its sample is kubetrain_tokens_total
    "kubetrain_step_time_seconds", "kubetrain_goodput_ratio",
    "kubetrain_wall_time_seconds",  # a counter by cause: kubetrain_wall_time_seconds_total
    "kubetrain_checkpoint_load_seconds",  # checkpoint_load's by tier, a counter as well
    # Every rank's compute and collective wait (rank 0 exports all of them), and the step
    # of the interval they describe: what the operator's straggler rule reads.
    "kubetrain_rank_compute_seconds", "kubetrain_rank_wait_seconds",
    "kubetrain_rank_timing_step",
    "kubetrain_rank_compute_time_seconds",  # a counter: each rank's compute since its start
}


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.mark.slow
def test_sigterm_saves_one_checkpoint_on_every_rank_and_training_resumes_from_it(
        tiny_job, launcher, tmp_path) -> None:
    """Rank 1 of an FSDP2 fp16 run gets SIGTERM: both ranks save the same step, rank 1 exits
    143 and rank 0 75 (restart me). Meanwhile rank 0 serves /metrics. A one-process rerun
    resumes there (model, optimizer, grad scaler and data position, resharded)."""
    job = tiny_job("stopped", optimization={"maxSteps": 100_000},
                   parallelism={"precision": "fp16"},  # the grad scaler's state is saved too
                   metrics={"logEverySteps": 5})
    spec = yaml.safe_load(job.read_text())["spec"]
    port = spec["metrics"]["port"]
    # Started the way torchrun starts workers (its environment), so each rank's exit code
    # can be read directly instead of through torchrun's summary.
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(launcher.free_port()),
                  "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    ranks = [
        subprocess.Popen(launcher.command(job, 1),
                         env={**launcher.env(), **rendezvous, "RANK": str(r),
                              "LOCAL_RANK": str(r)},
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    try:
        _wait_for(lambda: len(launcher.events(job, "step")) >= 2, 90, "10 training steps")

        exposition = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)
        families = {f.name: f for f in text_string_to_metric_families(exposition.read().decode())}
        assert set(families) == EXPORTED_METRICS
        value = {f.name: f.samples[0].value for f in families.values() if f.type == "gauge"}
        assert value["kubetrain_step"] >= 10
        assert value["kubetrain_max_steps"] == 100_000
        assert value["kubetrain_loss"] > 0 and value["kubetrain_learning_rate"] > 0
        assert abs(value["kubetrain_last_step_timestamp_seconds"] - time.time()) < 60
        tokens = {s.name: s.value for s in families["kubetrain_tokens"].samples}
        assert tokens["kubetrain_tokens_total"] >= 10 * 2 * 8 * 64  # steps x ranks x batch
        durations = {s.name: s.value for s in families["kubetrain_step_duration_seconds"].samples}
        assert durations["kubetrain_step_duration_seconds_count"] >= 10
        compute = families["kubetrain_rank_compute_seconds"].samples
        assert {sample.labels["rank"] for sample in compute} == {"0", "1"}

        ranks[1].send_signal(signal.SIGTERM)
        codes = [rank.wait(timeout=90) for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()
    assert codes == [75, 143], [rank.stderr.read()[-3000:] for rank in ranks if rank.stderr]

    (saved,) = launcher.events(job, "checkpoint")
    assert latest_checkpoint(spec["checkpoint"]["uri"]).step == saved["step"]
    assert not launcher.events(job, "finished")

    # Resume with one process (the checkpoint reshards) and train 5 more steps.
    manifest = yaml.safe_load(job.read_text())
    manifest["spec"]["optimization"]["maxSteps"] = saved["step"] + 5
    manifest["spec"]["metrics"]["port"] = launcher.free_port()
    job.write_text(yaml.safe_dump(manifest))
    launcher.train(job, ranks=1)
    (resumed,) = launcher.events(job, "resumed")
    assert (resumed["step"], resumed["world_size"]) == (saved["step"], 1)
    (finished,) = launcher.events(job, "finished")
    assert (finished["step"], finished["reason"]) == (saved["step"] + 5, "max_steps")

    # Goodput carries over the stop: the pause between the two runs is downtime, and
    # every second from the first start to the end lands in exactly one cause.
    first_start = launcher.events(job, "start")[0]["time"]
    final = launcher.events(job, "goodput")[-1]
    assert final["seconds"]["downtime"] > 0
    assert 0 < final["ratio"] < 1
    assert sum(final["seconds"].values()) == pytest.approx(final["time"] - first_start, abs=15)


@pytest.mark.slow
def test_epochs_train_the_steps_that_cover_that_share_of_the_data(tiny_job, launcher,
                                                                 prepared_corpus) -> None:
    """A tenth of an epoch at 1024 tokens per step: the trainer converts it to steps from the
    shards' token count, trains that many, and reports the epoch it reached."""
    from kubetrain.trainer.data import TokenDataset

    job = tiny_job("epochs", optimization={"epochs": 0.1, "maxSteps": None,
                                           "globalBatchTokens": 1024, "warmupSteps": 2},
                   metrics={"logEverySteps": 5})
    events = launcher.train(job, ranks=1)

    data = TokenDataset(prepared_corpus.train_uri, seq_len=64, micro_batch_size=8)
    data.close()
    tokens_per_epoch = data.samples_per_epoch * 64
    expected = math.ceil(0.1 * tokens_per_epoch / 1024)
    (finished,) = [e for e in events if e["event"] == "finished"]
    assert finished["step"] == expected and finished["reason"] == "max_steps"
    steps = [e for e in events if e["event"] == "step"]
    assert {e["max_steps"] for e in steps} == {expected}
    # 1024 tokens per step are 16 sequences of 64: the epoch at each logged step.
    for event in steps:
        assert event["epoch"] == round(event["step"] * 16 / data.samples_per_epoch, 4)
    assert 0.1 <= steps[-1]["epoch"] < 0.1 + 16 / data.samples_per_epoch


@pytest.mark.slow
def test_early_stopping_with_keep_best_exports_the_best_checkpoints_weights(
        tiny_job, launcher) -> None:
    """A learning rate too high for the tiny model: validation loss falls, then climbs, and
    early stopping ends the run. keepBest kept the best checkpoint out of keepLast 1, and
    exportFrom: best exported its weights, not the last ones."""
    from safetensors.torch import load_file

    from kubetrain.trainer.checkpoint import committed_checkpoints
    from kubetrain.trainer.export import hf_state_dict
    from kubetrain.trainer.generate import load_model

    job = tiny_job("best", optimization={"maxSteps": 60, "warmupSteps": 2,
                                         "learningRate": BEST_LEARNING_RATE,
                                         "schedule": "constant"},
                   evaluation={"everySteps": 2, "batches": 4,
                               "earlyStopping": {"patience": 3}},
                   checkpoint={"everySteps": 1000, "keepLast": 1, "keepBest": True,
                               "exportFrom": "best", "export": True},
                   metrics={"logEverySteps": 2})
    events = launcher.train(job, ranks=1)

    (finished,) = [e for e in events if e["event"] == "finished"]
    assert finished["reason"] == "early_stopping", finished
    evals = {e["step"]: e["val_loss"] for e in events if e["event"] == "eval" and e["step"]}
    best_step = min(evals, key=evals.__getitem__)
    print(f"validation losses: {evals}; best at step {best_step}")
    assert best_step < finished["step"] and finished["export_step"] == best_step
    uri = yaml.safe_load(job.read_text())["spec"]["checkpoint"]["uri"]
    kept = {info.step: info.uri for info in committed_checkpoints(uri)}
    assert set(kept) == {best_step, finished["step"]}  # keepLast 1, and the best

    exported = load_file(f"{uri}/export/model.safetensors")
    for step, equal in ((best_step, True), (finished["step"], False)):
        checkpoint = load_model(kept[step]).model
        weights = hf_state_dict(checkpoint.state_dict(), checkpoint.dims)
        assert exported.keys() == weights.keys()
        same = all(torch.equal(exported[name], weights[name]) for name in weights)
        assert same == equal, f"export against the checkpoint of step {step}"
