"""The state-space student (model.architecture: ssm): the chunked scan and the recurrence
compute the same model, it has the parameters sizing.py counts, and the job fields that
build it are checked."""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from kubetrain.api.manifest import InvalidManifest, parse_job
from kubetrain.api.presets import PRESETS
from kubetrain.api.trainingjob import TrainingJobSpec
from kubetrain.sizing import ssm_parameter_count, ssm_state_elements
from kubetrain.trainer.export import export_model
from kubetrain.trainer.model import Transformer
from kubetrain.trainer.pretrained import load_embeddings
from kubetrain.trainer.pretrained_config import PretrainedError, read_config, trained_model
from kubetrain.trainer.ssm import StateSpaceModel

sys.path.insert(0, str(Path(__file__).parent))
from compiled_check import assert_compiled_computes_what_eager_does
from saved_tensors import bytes_saved_for_backward

DIMS = PRESETS["tiny"].dims
# fp32: the scan sums the same products as the recurrence in another order (and through
# exp of differences of cumulative log decays), so they agree to rounding, not bit for bit.
SCAN_TOLERANCE = 1e-4


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _lively_model(chunk_size: int, seed: int = 0) -> StateSpaceModel:
    """A model whose SSM is far from its initial near-identity: long and short memories
    (A from 0.05 to 16, step sizes up to ~3) and large projections, so a wrong decay,
    a missed chunk boundary or a state lost between chunks changes the logits."""
    torch.manual_seed(seed)
    model = StateSpaceModel(DIMS, max_seq_len=512, chunk_size=chunk_size)
    with torch.no_grad():
        for block in model.blocks():
            mixer = block.mixer
            heads = mixer.shape.heads
            mixer.a_log.copy_(torch.linspace(-3.0, 2.8, heads))
            mixer.dt_bias.copy_(torch.linspace(-4.0, 3.0, heads))
            mixer.in_proj.weight.normal_(std=0.3)
            mixer.skip.uniform_(-1, 1)
        model.output.weight.normal_(std=0.5)  # tied: the embeddings too; logits of several units
    return model.eval()


@pytest.mark.parametrize(("chunk_size", "length"), [(16, 50), (64, 64), (8, 129)])
def test_the_parallel_scan_and_the_recurrent_step_give_the_same_logits(
        chunk_size: int, length: int) -> None:
    """Logits of a sequence from the chunked scan (`forward`), from the recurrence alone
    (`step` from the empty state), and from a prefill of the first part followed by steps:
    one model, to within fp32 rounding. Lengths that are not a multiple of the chunk, one
    that is, and many chunks."""
    model = _lively_model(chunk_size)
    tokens = torch.randint(0, DIMS.vocab_size, (2, length), generator=torch.Generator()
                           .manual_seed(1))
    with torch.no_grad():
        parallel = model(tokens)
        states = model.empty_state(2)
        recurrent = []
        for position in range(length):
            logits, states = model.step(tokens[:, position], states)
            recurrent.append(logits)
        stepped = torch.stack(recurrent, dim=1)
        split = length // 3
        prefilled, states = model.prefill(tokens[:, :split])
        resumed = []
        for position in range(split, length):
            logits, states = model.step(tokens[:, position], states)
            resumed.append(logits)
        continued = torch.cat([prefilled, torch.stack(resumed, dim=1)], dim=1)
    largest = max(float((parallel - stepped).abs().max()),
                  float((parallel - continued).abs().max()))
    print(f"chunk {chunk_size}, {length} tokens: largest parallel-vs-recurrent logit "
          f"difference {largest:.2e} (logits up to {float(parallel.abs().max()):.1f}; "
          f"tolerance {SCAN_TOLERANCE:g})")
    assert largest < SCAN_TOLERANCE
    assert float(parallel.std()) > 0.1  # logits that differ between tokens, not a constant


def test_the_scan_carries_information_across_chunks() -> None:
    """Changing the first token changes the logits two chunks later (the state passes
    between chunks), identically in both modes."""
    model = _lively_model(chunk_size=8)
    tokens = torch.randint(0, DIMS.vocab_size, (1, 24), generator=torch.Generator()
                           .manual_seed(2))
    changed = tokens.clone()
    changed[0, 0] = (tokens[0, 0] + 1) % DIMS.vocab_size
    with torch.no_grad():
        difference = (model(tokens) - model(changed))[0, 16:]
    assert float(difference.abs().max()) > 1e-3


def test_the_model_has_the_parameters_sizing_counts_and_a_state_that_does_not_grow() -> None:
    model = StateSpaceModel(DIMS, max_seq_len=64)
    assert sum(p.numel() for p in model.parameters()) == ssm_parameter_count(DIMS)
    tokens = torch.randint(0, DIMS.vocab_size, (1, 300))
    with torch.no_grad():
        _, short = model.prefill(tokens[:, :10])
        _, long = model.prefill(tokens)
    sizes = [sum(t.numel() for state in states for t in state) for states in (short, long)]
    assert sizes == [ssm_state_elements(DIMS)] * 2


def test_gradients_reach_every_parameter() -> None:
    model = StateSpaceModel(DIMS, max_seq_len=64)
    tokens = torch.randint(0, DIMS.vocab_size, (2, 65))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    missing = [name for name, p in model.named_parameters()
               if p.grad is None or not bool(p.grad.abs().sum() > 0)]
    assert not missing


def test_compiled_and_checkpointed_through_parallelize_it_computes_what_eager_does() -> None:
    """parallelize's compile and activation checkpointing, applied to the SSM's blocks as to
    a transformer's: the same loss and gradients as the plain model (fp32, CPU inductor)."""
    torch.manual_seed(0)
    eager = StateSpaceModel(DIMS, max_seq_len=64, chunk_size=16)
    compiled = StateSpaceModel(DIMS, max_seq_len=64, chunk_size=16)
    compiled.load_state_dict(eager.state_dict())
    tokens = torch.randint(0, DIMS.vocab_size, (2, 49))
    assert_compiled_computes_what_eager_does(eager, compiled, tokens)


# --- the job fields --------------------------------------------------------------------


def _job_spec(model: dict[str, Any], **sections: Any) -> TrainingJobSpec:
    spec = {"image": "kubetrain/trainer:test", "model": model,
            "data": {"train": "file:///data/train", "seqLen": 64},
            "checkpoint": {"uri": "file:///checkpoints"}, **sections}
    return parse_job({"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
                      "metadata": {"name": "student"}, "spec": spec}).spec


@pytest.mark.parametrize(("model", "sections", "expected"), [
    ({"preset": "tiny", "architecture": "ssm", "dynamics": {"enabled": True}}, {},
     r"spec\.model\.dynamics\.enabled: INL dynamics act after attention"),
    ({"architecture": "ssm", "fromTeacher": True}, {},
     r"spec\.model\.fromTeacher: needs a teacher to size the model from: set "
     r"distillation\.teacher"),
    ({"architecture": "ssm", "fromTeacher": True, "init": "file:///models/a"},
     {"distillation": {"teacher": "file:///models/t"}},
     r"spec\.model\.fromTeacher: and model\.init both say where the weights start"),
])
def test_contradictory_model_fields_are_refused_naming_the_field(
        model: dict[str, Any], sections: dict[str, Any], expected: str) -> None:
    with pytest.raises(InvalidManifest, match=expected):
        _job_spec(model, **sections)


@pytest.fixture
def teacher_export(tmp_path: Path, prepared_corpus: Any) -> str:
    """An untied three-layer transformer (random weights) exported as a teacher folder."""
    spec = _job_spec({"preset": "tiny", "tieEmbeddings": False, "nLayers": 3},
                     data={"train": prepared_corpus.train_uri, "seqLen": 64},
                     checkpoint={"uri": str(tmp_path / "teacher")})
    torch.manual_seed(3)
    teacher = Transformer(spec.model.resolve(), max_seq_len=64)
    return export_model(teacher, teacher.dims, spec, rank=0)


def test_from_teacher_takes_the_teachers_dimensions_and_starts_from_its_embeddings(
        teacher_export: str) -> None:
    from safetensors.torch import load_file

    spec = _job_spec({"architecture": "ssm", "fromTeacher": True, "nLayers": 3},
                     distillation={"teacher": teacher_export})
    same, dims = trained_model(spec)
    teacher_dims = read_config(teacher_export, None).dims
    assert same.model.architecture == "ssm" and dims == teacher_dims
    assert (dims.n_layers, dims.tie_embeddings) == (3, False)

    torch.manual_seed(0)
    student = StateSpaceModel(dims, max_seq_len=64)
    before = {name: p.detach().clone() for name, p in student.named_parameters()}
    load_embeddings(student, teacher_export, None)
    weights = load_file(teacher_export.removeprefix("file://") + "/model.safetensors")
    assert torch.equal(student.tok_embeddings.weight, weights["model.embed_tokens.weight"])
    assert torch.equal(student.output.weight, weights["lm_head.weight"])
    unchanged = [name for name, p in student.named_parameters() if torch.equal(p, before[name])]
    assert len(unchanged) == len(before) - 2  # everything but the two embeddings


def test_from_teacher_refuses_a_dimension_that_contradicts_the_teacher_naming_both(
        teacher_export: str) -> None:
    spec = _job_spec({"architecture": "ssm", "fromTeacher": True, "dim": 128, "nLayers": 3},
                     distillation={"teacher": teacher_export})
    with pytest.raises(PretrainedError) as refused:
        trained_model(spec)
    message = str(refused.value)
    assert "spec.model.dim is 128 but config.json at " in message
    assert "says hidden_size 64: remove model.dim or set it to 64" in message
    assert "model.fromTeacher takes the dimensions from the teacher's config.json" in message
    assert "nLayers" not in message  # 3 agrees with the teacher


# --- training, resuming, exporting and generating ----------------------------------------

STEPS, HALF = 8, 4


@pytest.fixture(scope="module")
def trained(prepared_corpus: Any, launcher: Any,
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny SSM job trained three ways, 8 sequences per step throughout: on one process
    for 8 steps; and on 2 torchrun ranks (FSDP2 per block, full activation checkpointing)
    for 4 steps, then resumed from that checkpoint on one process (rescaled 2 → 1) for
    4 more, and exported. Constant learning rate after warmup, so a run of 4 steps
    follows the same schedule as the first half of one of 8."""
    folder = tmp_path_factory.mktemp("ssm-jobs")

    def job(name: str, steps: int, micro: int, **spec: Any) -> Path:
        manifest = {
            "apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
            "metadata": {"name": name},
            "spec": {
                "image": "kubetrain/trainer:test",
                "model": {"preset": "tiny", "architecture": "ssm"},
                "data": {"train": prepared_corpus.train_uri, "seqLen": 64},
                "optimization": {"maxSteps": steps, "microBatchSize": micro,
                                 "gradientAccumulationSteps": 2, "warmupSteps": 2,
                                 "schedule": "constant"},
                "evaluation": {"everySteps": 0},
                "parallelism": {"strategy": "fsdp", "precision": "fp32"},
                "checkpoint": {"uri": str(folder / name / "checkpoints"),
                               "everySteps": 1000, "export": False},
                "metrics": {"port": launcher.free_port(), "logEverySteps": 1},
                **spec,
            },
        }
        path = folder / name / "job.yaml"
        path.parent.mkdir(exist_ok=True)
        path.write_text(yaml.safe_dump(manifest))
        return path

    one = launcher.train(job("one", STEPS, micro=4), ranks=1)
    rescaled = job("rescaled", HALF, micro=2,
                   parallelism={"strategy": "fsdp", "precision": "fp32",
                                "activationCheckpointing": "full"})
    launcher.train(rescaled, ranks=2)
    job("rescaled", STEPS, micro=4, checkpoint={
        "uri": str(folder / "rescaled" / "checkpoints"), "everySteps": 1000, "export": True})
    return {"one": one, "rescaled": launcher.train(rescaled, ranks=1),
            "checkpoints": folder / "rescaled" / "checkpoints",
            "export": folder / "rescaled" / "checkpoints" / "export",
            "corpus": prepared_corpus}


def _steps(events: list[dict[str, Any]]) -> dict[int, tuple[float, float]]:
    """Each step's loss and gradient norm; a step logged again after a resume, its last."""
    return {e["step"]: (e["loss"], e["grad_norm"]) for e in events if e["event"] == "step"}


@pytest.mark.slow
def test_two_fsdp2_ranks_then_one_resumed_rank_log_the_losses_of_one_uninterrupted_rank(
        trained: dict[str, Any]) -> None:
    one, rescaled = _steps(trained["one"]), _steps(trained["rescaled"])
    assert sorted(one) == sorted(rescaled) == list(range(1, STEPS + 1))
    (resumed,) = [e for e in trained["rescaled"] if e["event"] == "resumed"]
    assert resumed["step"] == HALF and resumed["world_size"] == 1
    for step in one:
        assert rescaled[step] == pytest.approx(one[step], rel=1e-4), f"step {step}"
    assert one[STEPS][0] < one[1][0] - 0.5  # it learned: equal curves are not flat ones


@pytest.mark.slow
def test_the_export_is_marked_ssm_and_transformers_refuses_it(trained: dict[str, Any]) -> None:
    from safetensors.torch import load_file

    config = json.loads((trained["export"] / "config.json").read_text())
    assert config["architectures"] == ["KubetrainSSMForCausalLM"]
    assert config["model_type"] == "kubetrain_ssm"
    assert config["kubetrain"] == {"ssm": {"expand": 2, "stateSize": 64, "convWidth": 4}}
    names = set(load_file(str(trained["export"] / "model.safetensors")))
    assert {f"model.layers.{i}.mixer.{p}" for i in range(DIMS.n_layers)
            for p in ("in_proj.weight", "conv.weight", "a_log", "dt_bias", "skip")} <= names
    import transformers

    with pytest.raises(ValueError, match="kubetrain_ssm"):
        transformers.AutoConfig.from_pretrained(str(trained["export"]))
    # The run's summary learns from the trainer what reads the export (not "Hugging Face").
    finished = [e for e in trained["rescaled"] if e["event"] == "finished"][-1]  # the export's
    assert finished["export_format"].startswith("kubetrain SSM, model_type kubetrain_ssm")


@pytest.mark.slow
def test_generate_samples_recurrently_what_the_parallel_model_predicts_and_model_init_loads_it(
        trained: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    """`kubetrain generate` on the SSM's checkpoints samples in recurrent mode; greedily, it
    picks the tokens a full parallel forward over the growing context picks. model.init of
    another job from the export builds an SSM (the folder's architecture) with the same
    weights, so the same logits."""
    from kubetrain.trainer.generate import add_arguments, load_model, run, sample
    from kubetrain.trainer.pretrained import load_pretrained

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    loaded = load_model(str(trained["checkpoints"]))
    model = loaded.model
    assert isinstance(model, StateSpaceModel) and loaded.step == STEPS
    prompt = loaded.tokenizer.encode("def main(", add_special_tokens=False).ids
    produced = sample(model, prompt, max_tokens=12, temperature=0, top_k=None)
    context = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            context.append(int(model(torch.tensor([context]))[0, -1].argmax()))
    assert produced == context[len(prompt):]

    spec = _job_spec({"init": str(trained["export"])},
                     data={"train": trained["corpus"].train_uri, "seqLen": 64})
    spec, dims = trained_model(spec)
    assert spec.model.architecture == "ssm" and dims == model.dims
    initialised = StateSpaceModel(dims, max_seq_len=64)
    load_pretrained(initialised, str(trained["export"]), None)
    tokens = torch.tensor([context])
    with torch.no_grad():
        torch.testing.assert_close(initialised.eval()(tokens), model(tokens))

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--checkpoint", str(trained["checkpoints"]), "--prompt",
                              "def main(", "--max-tokens", "12", "--temperature", "0"])
    assert run(args) == 0
    assert capsys.readouterr().out.strip() == loaded.tokenizer.decode(
        context, skip_special_tokens=True).strip()


@pytest.mark.slow
def test_a_model_init_job_from_the_export_builds_the_ssm_and_starts_from_its_weights(
        trained: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the Trainer: a job whose model.init is the SSM's export (architecture left
    at its default) trains an SSM from those weights. One step at a learning rate of 1e-9
    leaves them as they were, so its export is the source export."""
    from safetensors.torch import load_file

    from kubetrain.pod_conventions import ATTEMPT_STARTED_ENV
    from kubetrain.trainer import Trainer

    spec = _job_spec({"init": str(trained["export"])},
                     data={"train": trained["corpus"].train_uri, "seqLen": 64},
                     optimization={"maxSteps": 1, "microBatchSize": 2, "warmupSteps": 0,
                                   "learningRate": 1e-9},
                     evaluation={"everySteps": 0}, parallelism={"precision": "fp32"},
                     checkpoint={"uri": str(tmp_path / "checkpoints"), "export": True})
    assert spec.model.architecture == "transformer"  # the folder says ssm
    # An in-process attempt begins now (its startup is booked from when it began).
    monkeypatch.setenv(ATTEMPT_STARTED_ENV, str(time.time()))
    result = Trainer(spec, metrics_log=tmp_path / "metrics.jsonl", serve_metrics=False).fit()
    assert result.exit_code == 0 and result.export_uri is not None
    folder = Path(result.export_uri.removeprefix("file://"))
    assert json.loads((folder / "config.json").read_text())["model_type"] == "kubetrain_ssm"
    source = load_file(str(trained["export"] / "model.safetensors"))
    exported = load_file(str(folder / "model.safetensors"))
    assert exported.keys() == source.keys()
    for name, tensor in source.items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=1e-6, msg=name)


# --- kubetrain estimate ------------------------------------------------------------------


def _bytes_saved_for_backward(model: StateSpaceModel, tokens: torch.Tensor,
                              dtype: torch.dtype | None) -> int:
    """Bytes of the tensors autograd keeps from the blocks' forward, parameters and (under
    autocast) their cached casts aside: the planner counts those in other rows."""
    x = model.tok_embeddings(tokens)

    def blocks() -> None:
        hidden = x
        autocast = torch.autocast("cpu", dtype=dtype or torch.bfloat16,
                                  enabled=dtype is not None)
        with autocast:
            for block in model.layers:
                hidden = block(hidden)

    casts = 0 if dtype is None else dtype.itemsize * sum(
        p.numel() for p in model.layers.parameters() if p.dim() >= 2)
    return bytes_saved_for_backward(model, blocks) - casts


@pytest.mark.parametrize(("precision", "dtype"), [("fp32", None), ("bf16", torch.bfloat16)])
@pytest.mark.parametrize("seq_len", [64, 100])
def test_estimate_counts_the_ssm_parameters_and_the_activations_autograd_keeps(
        precision: str, dtype: torch.dtype | None, seq_len: int) -> None:
    from kubetrain.trainer.estimate import Plan, estimate_memory

    spec = _job_spec({"preset": "tiny", "architecture": "ssm"},
                     data={"train": "file:///data/train", "seqLen": seq_len},
                     parallelism={"precision": precision})
    plan = Plan(micro_batch_size=2, gradient_accumulation=1, activation_checkpointing="none")
    estimate = estimate_memory(spec, 1, plan)
    assert estimate.parameters == 4 * ssm_parameter_count(DIMS)
    torch.manual_seed(0)
    tokens = torch.randint(0, DIMS.vocab_size, (2, seq_len))
    measured = _bytes_saved_for_backward(StateSpaceModel(DIMS, seq_len), tokens, dtype)
    print(f"{precision}, {seq_len} tokens: estimated {estimate.activations} bytes of "
          f"activations, autograd keeps {measured}")
    assert estimate.activations == pytest.approx(measured, rel=0.05)
    checkpointed = estimate_memory(spec, 1, Plan(2, 1, "full"))
    assert checkpointed.activations < estimate.activations


def test_the_command_sizes_a_from_teacher_student_and_prints_its_generation_state(
        teacher_export: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kubetrain.trainer.estimate import add_arguments, run

    manifest = {"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
                "metadata": {"name": "student"},
                "spec": {"image": "x", "model": {"architecture": "ssm", "fromTeacher": True},
                         "data": {"train": "file:///data/train", "seqLen": 64},
                         "distillation": {"teacher": teacher_export},
                         "checkpoint": {"uri": "file:///checkpoints"}}}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(manifest))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args([str(job), "--gpu-memory", "80"])) == 0
    out = capsys.readouterr().out
    teacher = read_config(teacher_export, None).dims
    state_mib = 4 * ssm_state_elements(teacher) / 1024**2
    assert out.startswith(f"state-space model, sized from the teacher {teacher_export}: "
                          f"{ssm_parameter_count(teacher) / 1e9:.2f}B parameters")
    assert f"generation state {state_mib:.2f} MiB per sequence (fp32)" in out
    assert "distillation teacher" in out
