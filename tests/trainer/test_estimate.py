"""The memory planner: how each setting moves the estimate, and the recommendation it makes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kubetrain.api.manifest import parse_job
from kubetrain.api.trainingjob import TrainingJobSpec
from kubetrain.sizing import parameter_count
from kubetrain.trainer.estimate import (
    EAGER_AUTOCAST_ACTIVATIONS,
    GIB,
    Plan,
    estimate_memory,
    job_plan,
    recommend,
)


def manifest(**spec: object) -> dict:
    return {"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
            "metadata": {"name": "big"},
            "spec": {"image": "x", "model": {"preset": "llama-8b"},
                     "data": {"train": "s3://d/train", "seqLen": 4096},
                     "optimization": {"microBatchSize": 4, "gradientAccumulationSteps": 4},
                     "checkpoint": {"uri": "s3://c/big"}, **spec}}


def job_spec(**spec: object) -> TrainingJobSpec:
    return parse_job(manifest(**spec)).spec


def test_fsdp_shards_weights_gradients_and_optimizer_state_over_the_world() -> None:
    spec = job_spec()
    plan = job_plan(spec, 8)
    alone, sharded = estimate_memory(spec, 1, plan), estimate_memory(spec, 8, plan)
    n = parameter_count(spec.model.resolve())
    assert alone.parameters == 4 * n and alone.optimizer == 8 * n
    assert sharded.parameters == 4 * n // 8 and sharded.gradients == 4 * n // 8
    # One process computes under autocast, whose eager blocks keep more (fp32 residuals);
    # FSDP2's bf16 parameters do not: the same tensors, counted without that factor.
    assert sharded.activations == pytest.approx(alone.activations / EAGER_AUTOCAST_ACTIVATIONS,
                                                rel=1e-6)
    ddp = job_spec(parallelism={"strategy": "ddp"})
    assert estimate_memory(ddp, 8, plan).parameters == 4 * n


def test_checkpointing_trades_activation_memory_and_micro_batch_scales_it() -> None:
    spec = job_spec()
    activations = {ac: estimate_memory(spec, 8, Plan(4, 4, ac)).activations
                   for ac in ("none", "selective", "full")}
    assert activations["none"] > activations["selective"] > activations["full"]
    half = estimate_memory(spec, 8, Plan(2, 8, "none"))
    assert half.activations * 2 == activations["none"]


def test_the_recommendation_fits_and_keeps_the_global_batch() -> None:
    spec = job_spec()
    asked = job_plan(spec, 8)
    assert estimate_memory(spec, 8, asked).total > 80 * GIB
    better = recommend(spec, 8, 80 * GIB)
    assert better is not None
    assert estimate_memory(spec, 8, better).total <= 80 * GIB
    assert (better.micro_batch_size * better.gradient_accumulation
            == asked.micro_batch_size * asked.gradient_accumulation)
    assert recommend(spec, 1, 8 * GIB) is None  # 8B parameters of fp32 Adam state never fit


@pytest.mark.parametrize(("gpu", "code"), [("80", 1), ("200", 0)])
def test_the_command_prints_the_estimate_and_exits_by_whether_it_fits(
        tmp_path: Path, gpu: str, code: int) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest(workers={"procsPerWorker": 8})))
    # Torch-free: the planner runs where torch is not installed (poisoned here).
    program = ("import sys; sys.modules['torch'] = None; from kubetrain.cli import main; "
               f"sys.exit(main(['estimate', {str(path)!r}, '--gpu-memory', {gpu!r}]))")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == code, done.stderr
    billions = parameter_count(parse_job(manifest()).spec.model.resolve()) / 1e9
    assert f"llama-8b: {billions:.2f}B parameters, 8 processes" in done.stdout
    assert ("Recommended for 80 GiB" in done.stdout) == (code == 1)


def test_the_chunked_loss_frees_the_logits_memory_and_the_recommendation_uses_it() -> None:
    """llama-1b with a 128k vocabulary: the full logits of 8 x 2048 tokens are most of a
    GPU's memory; chunked, the loss holds one chunk, whatever the micro-batch."""
    spec = job_spec(model={"preset": "llama-1b"}, data={"train": "s3://d/t", "seqLen": 2048},
                    optimization={"microBatchSize": 16, "gradientAccumulationSteps": 1})
    plan = job_plan(spec, 8)
    full = estimate_memory(spec, 8, plan, "full")
    chunked = estimate_memory(spec, 8, plan, "chunked")
    liger = estimate_memory(spec, 8, plan, "liger")
    vocab = spec.model.resolve().vocab_size
    assert full.logits == 16 * 2048 * vocab * (2 + 8)
    assert chunked.logits < full.logits / 50 and liger.logits < full.logits / 10
    assert estimate_memory(spec, 8, Plan(1, 16, "none"), "chunked").logits == chunked.logits

    # The logits alone do not fit 40 GiB; without them, less recomputation and bigger
    # micro-batches do.
    with_full = recommend(spec, 8, 40 * GIB, "full")
    with_chunks = recommend(spec, 8, 40 * GIB, "chunked")
    assert with_full is not None and with_chunks is not None
    order = ["none", "selective", "full"]
    assert (order.index(with_chunks.activation_checkpointing),
            -with_chunks.micro_batch_size) < (order.index(with_full.activation_checkpointing),
                                              -with_full.micro_batch_size)


def test_a_distillation_teacher_adds_its_sharded_weights_and_chunk_but_no_gradients_or_state(
        ) -> None:
    """llama-1b distilled from llama-8b on 8 processes in bf16: the teacher's weights cost 2
    bytes per parameter over 8 shards, and nothing of the student's training state changes."""
    teacher = parse_job(manifest()).spec.model.resolve()  # llama-8b
    spec = job_spec(model={"preset": "llama-1b"},
                    distillation={"teacher": "s3://models/llama-8b"})
    plan = job_plan(spec, 8)
    alone = estimate_memory(spec, 8, plan)
    distilled = estimate_memory(spec, 8, plan, teacher=teacher)
    for part in ("parameters", "gradients", "optimizer", "fsdp_working_set", "activations"):
        assert getattr(distilled, part) == getattr(alone, part), part
    weights = 2 * parameter_count(teacher) // 8
    output_weight = 2 * teacher.vocab_size * teacher.dim  # gathered whole for the loss
    assert weights + output_weight < distilled.teacher < weights + output_weight + 2 * GIB
    assert alone.teacher == 0 and distilled.total > alone.total + weights
    # Unsharded (ddp), each rank holds the whole teacher, still without fp32 master weights.
    ddp = job_spec(model={"preset": "llama-1b"}, parallelism={"strategy": "ddp"},
                   distillation={"teacher": "s3://models/llama-8b"})
    assert estimate_memory(ddp, 8, plan, teacher=teacher).teacher > 2 * parameter_count(teacher)


@pytest.mark.parametrize("dynamics", [False, True], ids=["llama", "dynamics"])
def test_the_command_reads_the_teachers_config_and_prints_its_row(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], dynamics: bool) -> None:
    """A kubetrain export with INL dynamics teaches with its controllers: the row counts
    their parameters too, 2 bytes each over the 8 shards."""
    from kubetrain.api.trainingjob import DynamicsSpec
    from kubetrain.cli import main
    from kubetrain.sizing import dynamics_parameter_count
    from kubetrain.trainer.export import hf_config

    teacher = parse_job(manifest()).spec.model.resolve()  # llama-8b's dimensions
    (tmp_path / "teacher").mkdir()
    (tmp_path / "teacher" / "config.json").write_text(json.dumps(hf_config(
        teacher, 4096, eos_token_id=0, dynamics=DynamicsSpec(enabled=dynamics))))
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest(model={"preset": "llama-1b"},
                                            workers={"procsPerWorker": 8},
                                            distillation={"teacher": str(tmp_path / "teacher")})))
    main(["estimate", str(path), "--gpu-memory", "200"])
    out = capsys.readouterr().out
    described = (f"distilled from a {parameter_count(teacher, dynamics) / 1e9:.2f}B-parameter "
                 f"teacher{' with INL dynamics' if dynamics else ''} (")
    assert described in out
    (row,) = [line for line in out.splitlines() if "distillation teacher (bf16, 1/8 each)" in line]
    spec = parse_job(yaml.safe_load(path.read_text())).spec
    expected = estimate_memory(spec, 8, job_plan(spec, 8), teacher=teacher,
                               teacher_dynamics=dynamics).teacher
    assert float(row.split()[-1]) == pytest.approx(expected / GIB, abs=0.006)
    plain = estimate_memory(spec, 8, job_plan(spec, 8), teacher=teacher).teacher
    controllers = teacher.n_layers * dynamics_parameter_count(teacher.dim)
    gathered = 2 * 2 * dynamics_parameter_count(teacher.dim)  # two gathered blocks' worth
    assert expected - plain == (2 * controllers // 8 + gathered if dynamics else 0)


def test_a_model_init_job_is_sized_from_its_config_json_without_torch(tmp_path: Path) -> None:
    import json

    from kubetrain.api.presets import PRESETS
    from kubetrain.trainer.export import hf_config

    dims = PRESETS["llama-1b"].dims
    folder = tmp_path / "pretrained"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf_config(dims, 4096, 0)))
    for model, code in (({"init": str(folder), "preset": "custom"}, 0),
                        ({"init": str(folder), "dim": 1024}, 2)):
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_dump(manifest(model=model)))
        program = ("import sys; sys.modules['torch'] = None; from kubetrain.cli import main; "
                   f"sys.exit(main(['estimate', {str(path)!r}, '--gpu-memory', '200']))")
        done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == code, done.stderr
        if code == 0:
            assert (f"model.init {folder}: {parameter_count(dims) / 1e9:.2f}B parameters"
                    in done.stdout)
        else:
            assert "spec.model.dim is 1024 but config.json at" in done.stderr
            assert "says hidden_size 2048" in done.stderr


def test_a_model_init_job_of_a_dynamics_export_counts_the_controllers(tmp_path: Path) -> None:
    import json

    from kubetrain.api.presets import PRESETS
    from kubetrain.api.trainingjob import DynamicsSpec
    from kubetrain.trainer.export import hf_config

    dims = PRESETS["llama-1b"].dims
    folder = tmp_path / "pretrained"
    folder.mkdir()
    config = hf_config(dims, 4096, 0, DynamicsSpec(enabled=True, beta_max=1.5))
    (folder / "config.json").write_text(json.dumps(config))
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest(model={"init": str(folder)})))
    program = ("import sys; sys.modules['torch'] = None; from kubetrain.cli import main; "
               f"sys.exit(main(['estimate', {str(path)!r}, '--gpu-memory', '200']))")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert parameter_count(dims, True) > parameter_count(dims)
    assert (f"model.init {folder} with INL dynamics: {parameter_count(dims, True) / 1e9:.2f}B "
            "parameters" in done.stdout)


# Peaks bench/mfu.py measured on one H100 80GB HBM3 (torch 2.11, Liger's fused loss,
# one process), in GiB: the allocator's peak reservation plus memory outside it. The
# commands are in bench/README.md. Each row: model, layers, micro-batch, checkpointing,
# compile, precision, measured peak.
H100_PEAKS = [
    ("llama-1b", None, 4, "none", True, "bf16", 35.8),
    ("llama-1b", None, 8, "none", True, "bf16", 45.3),
    ("llama-1b", None, 16, "none", True, "bf16", 67.8),
    ("llama-1b", None, 4, "none", False, "bf16", 40.8),
    ("llama-1b", None, 4, "selective", False, "bf16", 33.2),
    ("llama-1b", None, 16, "none", True, "fp8", 52.2),
    ("llama-8b", 8, 4, "none", True, "bf16", 62.0),
    ("llama-8b", 8, 4, "none", True, "fp8", 56.3),
]


@pytest.mark.parametrize(("preset", "layers", "micro", "checkpointing", "compile_",
                          "precision", "peak"), H100_PEAKS)
def test_the_estimate_is_at_most_10_percent_above_the_measured_gpu_peaks_and_never_below(
        preset: str, layers: int | None, micro: int, checkpointing: str, compile_: bool,
        precision: str, peak: float) -> None:
    """An estimate below the peak sends jobs into OOMs; far above it wastes the GPU."""
    model: dict[str, object] = {"preset": preset, "vocabSize": 128_256}
    if layers:
        model["nLayers"] = layers
    spec = job_spec(model=model, data={"train": "s3://d/t", "seqLen": 2048},
                    optimization={"microBatchSize": micro, "gradientAccumulationSteps": 1},
                    parallelism={"precision": precision, "compile": compile_,
                                 "activationCheckpointing": checkpointing})
    estimate = estimate_memory(spec, 1, job_plan(spec, 1), "liger").total / GIB
    assert 0.9 <= peak / estimate <= 1.0, f"measured {peak} GiB, estimated {estimate:.1f}"


def test_compile_and_float8_shrink_the_activation_estimate() -> None:
    def activations(**parallelism: object) -> int:
        spec = job_spec(parallelism=parallelism)
        return estimate_memory(spec, 1, job_plan(spec, 1)).activations

    eager, compiled = activations(compile=False), activations(compile=True)
    fp8 = activations(compile=True, precision="fp8")
    assert fp8 < compiled < eager
    # Checkpointed blocks keep only their inputs, compiled or not.
    assert (activations(compile=True, activationCheckpointing="full")
            < activations(compile=True, activationCheckpointing="selective") < compiled)


def test_a_job_that_fits_is_shown_the_largest_micro_batch_that_fits_with_its_global_batch(
        tmp_path: Path) -> None:
    spec = {"model": {"preset": "llama-1b"}, "data": {"train": "s3://d/t", "seqLen": 2048},
            "optimization": {"microBatchSize": 2, "gradientAccumulationSteps": 32},
            "parallelism": {"compile": True}}
    larger = recommend(job_spec(**spec), 1, 80 * GIB, grow=True)
    assert larger is not None and larger.micro_batch_size > 2
    assert larger.micro_batch_size * larger.gradient_accumulation == 64
    assert larger.activation_checkpointing == "none"
    doubled = Plan(larger.micro_batch_size * 2, larger.gradient_accumulation // 2, "none")
    assert estimate_memory(job_spec(**spec), 1, larger).total <= 80 * GIB
    assert estimate_memory(job_spec(**spec), 1, doubled).total > 80 * GIB
    # Without grow the recommendation never exceeds the job's micro-batch.
    assert recommend(job_spec(**spec), 1, 80 * GIB) == job_plan(job_spec(**spec), 1)

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest(**spec)))
    done = subprocess.run([sys.executable, "-m", "kubetrain", "estimate", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "fits a larger micro-batch, the same global batch" in done.stdout
    assert f"optimization.microBatchSize: {larger.micro_batch_size}" in done.stdout
