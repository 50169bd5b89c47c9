"""INL dynamics (`model.dynamics`): the controller's bounds, its gradients, the plain model
left exactly as it was, and a dynamics job that trains, reports, exports and generates."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import subprocess
import sys
import urllib.request
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import yaml
from host_tools import unavailable
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from kubetrain.api.trainingjob import DynamicsSpec, ModelSpec
from kubetrain.sizing import parameter_count
from kubetrain.trainer.model import Dynamics, Transformer

sys.path.insert(0, str(Path(__file__).parent))
from saved_tensors import bytes_saved_for_backward

REPO = Path(__file__).resolve().parents[2]
# The last commit before model.dynamics existed: the model a job without dynamics must
# still build. A deliberate change to the plain model moves this pin with it.
BEFORE_DYNAMICS = "8ee1e4258585eebc27be46f4ccf4ada9cb7879a0"
DIMS = ModelSpec(preset="tiny").resolve()
ON = DynamicsSpec(enabled=True)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)  # tiny matrices: threads only contend with parallel tests


def _model_before_dynamics(tmp_path: Path) -> ModuleType:
    """model.py as it was at BEFORE_DYNAMICS, imported from git's copy."""
    try:
        source = subprocess.run(
            ["git", "show", f"{BEFORE_DYNAMICS}:trainer/kubetrain/trainer/model.py"],
            cwd=REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as error:
        unavailable(f"needs the git history with commit {BEFORE_DYNAMICS} ({error})")
    path = tmp_path / "model_before_dynamics.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("model_before_dynamics", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("off", [None, DynamicsSpec(), DynamicsSpec(enabled=False, betaMax=5)])
def test_without_dynamics_the_model_is_bit_identical_to_the_one_before_the_option(
        off: DynamicsSpec | None, tmp_path: Path) -> None:
    """Same parameters, same draws from the generator at init, same logits, loss and
    gradients as model.py before dynamics existed, built from the same seed."""
    before = _model_before_dynamics(tmp_path)
    tokens = torch.randint(0, DIMS.vocab_size, (2, 32), generator=torch.Generator().manual_seed(3))

    def build_and_run(make: type) -> tuple[dict, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        torch.manual_seed(0)
        model = make()
        rng_after_init = torch.get_rng_state()
        logits = model(tokens)
        loss = model(tokens, tokens)
        loss.backward()
        grads = {name: p.grad for name, p in model.named_parameters()}
        return model.state_dict(), rng_after_init, logits, loss, grads

    old = build_and_run(lambda: before.Transformer(DIMS, max_seq_len=32))
    new = build_and_run(lambda: Transformer(DIMS, max_seq_len=32, dynamics=off))
    old_state, new_state = old[0], new[0]
    assert list(new_state) == list(old_state)
    assert all(torch.equal(new_state[name], old_state[name]) for name in old_state)
    assert torch.equal(new[1], old[1]), "initialisation drew differently from the generator"
    assert torch.equal(new[2], old[2]) and torch.equal(new[3], old[3])
    assert all(torch.equal(new[4][name], old[4][name]) for name in old[4])


def test_dynamics_adds_the_controller_to_every_block_and_the_count_says_so() -> None:
    model = Transformer(DIMS, max_seq_len=32, dynamics=ON)
    names = {name for name, _ in model.named_parameters() if ".dynamics." in name}
    assert names == {f"layers.{i}.dynamics.{p}" for i in range(DIMS.n_layers) for p in (
        "equilibrium", "controller_in.weight", "controller_in.bias", "controller_out.weight",
        "controller_out.bias")}
    built = sum(p.numel() for p in model.parameters())
    assert built == parameter_count(DIMS, dynamics=True) > parameter_count(DIMS)
    # Initialisation is a function of the seed, as for the rest of the model.
    torch.manual_seed(5)
    again = Transformer(DIMS, max_seq_len=32, dynamics=ON)
    torch.manual_seed(5)
    third = Transformer(DIMS, max_seq_len=32, dynamics=ON)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(),
                                                 third.state_dict().values(), strict=True))


def test_gradients_reach_every_controller_parameter() -> None:
    torch.manual_seed(0)
    model = Transformer(DIMS, max_seq_len=32, dynamics=ON)
    tokens = torch.randint(0, DIMS.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    model(tokens, tokens).backward()
    controller = {name: p.grad for name, p in model.named_parameters() if ".dynamics." in name}
    assert len(controller) == 5 * DIMS.n_layers
    for name, grad in controller.items():
        assert grad is not None and torch.count_nonzero(grad) > 0, f"no gradient reaches {name}"


def _fp32(value: float) -> float:
    """`value` as the float32 the bounds are computed in."""
    return float(torch.tensor(value, dtype=torch.float32))


@settings(max_examples=40, deadline=None)
@given(scale_exponent=st.floats(4, 6), weight_scale=st.floats(1, 1000),
       beta_max=st.floats(1e-3, 100), velocity_max=st.floats(1e-3, 100),
       seed=st.integers(0, 2**16))
def test_huge_activations_keep_beta_and_velocity_within_their_bounds(
        scale_exponent: float, weight_scale: float, beta_max: float, velocity_max: float,
        seed: int) -> None:
    """Hidden states of 1e4 to 1e6, controllers with weights up to 1000 times their initial
    size, any incoming velocity: beta stays in [0, betaMax], |v| <= velocityMax, all finite."""
    generator = torch.Generator().manual_seed(seed)
    dim = 16
    dynamics = Dynamics(dim, beta_max=beta_max, velocity_max=velocity_max)
    dynamics.reset_parameters()
    with torch.no_grad():
        for parameter in dynamics.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.02 * weight_scale)
    h = torch.randn(4, 8, dim, generator=generator) * 10**scale_exponent
    v = torch.randn(4, 8, dim, generator=generator) * 10**scale_exponent
    with torch.no_grad():
        alpha, beta, gate = dynamics.controls(h)
        h_next, v_next = dynamics(h, v)
    assert beta.min() >= 0 and beta.max() <= _fp32(beta_max)
    assert alpha.min() >= 0 and alpha.max() <= 1 and gate.min() >= 0 and gate.max() <= 1
    assert v_next.abs().max() <= _fp32(velocity_max)
    assert torch.isfinite(h_next).all()
    mean_beta, mean_square_velocity = dynamics.stats.tolist()
    assert 0 <= mean_beta <= _fp32(beta_max)
    assert 0 <= mean_square_velocity <= _fp32(velocity_max) ** 2 * (1 + 1e-6)


@settings(max_examples=10, deadline=None)
@given(scale_exponent=st.floats(4, 6), seed=st.integers(0, 2**16))
def test_a_whole_model_with_huge_embeddings_stays_bounded_and_finite(
        scale_exponent: float, seed: int) -> None:
    """The velocity carried through every block stays within velocityMax; logits are finite."""
    torch.manual_seed(seed)
    spec = DynamicsSpec(enabled=True, betaMax=1.5, velocityMax=3.0)
    model = Transformer(DIMS, max_seq_len=16, dynamics=spec).eval()
    with torch.no_grad():
        model.tok_embeddings.weight.mul_(10**scale_exponent)
        tokens = torch.randint(0, DIMS.vocab_size, (2, 16))
        x = model.tok_embeddings(tokens)
        velocity = torch.zeros_like(x)
        cos, sin = model.rope_cos[:16], model.rope_sin[:16]
        for block in model.layers:
            x, velocity = block(x, velocity, cos, sin)
            assert velocity is not None and velocity.abs().max() <= 3.0
            assert torch.isfinite(x).all()
        assert torch.isfinite(model(tokens)).all()


def _bytes_saved_for_backward(model: Transformer, tokens: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps from the blocks' forward (parameters aside)."""
    x = model.tok_embeddings(tokens)
    seq = tokens.shape[1]

    def blocks() -> None:
        hidden, velocity = x, torch.zeros_like(x) if model.has_dynamics else None
        for block in model.layers:
            hidden, velocity = block(hidden, velocity, model.rope_cos[:seq],
                                     model.rope_sin[:seq])

    return bytes_saved_for_backward(model, blocks)


def test_estimate_counts_the_controllers_parameters_and_activations() -> None:
    from kubetrain.api.manifest import parse_job
    from kubetrain.trainer.estimate import Plan, estimate_memory

    def spec(enabled: bool) -> Any:
        return parse_job({"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
                          "metadata": {"name": "e"},
                          "spec": {"image": "x", "data": {"train": "d", "seqLen": 32},
                                   "model": {"preset": "tiny", "dynamics": {"enabled": enabled}},
                                   "parallelism": {"precision": "fp32"},
                                   "checkpoint": {"uri": "c"}}}).spec

    plan = Plan(micro_batch_size=2, gradient_accumulation=1, activation_checkpointing="none")
    plain, controlled = estimate_memory(spec(False), 1, plan), estimate_memory(spec(True), 1, plan)
    assert controlled.parameters == 4 * parameter_count(DIMS, dynamics=True)
    # Against what autograd really keeps in fp32; the estimate leaves out only the velocity
    # at rest that the first block starts from (one d per token, about 5 % here).
    tokens = torch.randint(0, DIMS.vocab_size, (2, 32))
    torch.manual_seed(0)
    measured = (_bytes_saved_for_backward(Transformer(DIMS, 32, dynamics=ON), tokens)
                - _bytes_saved_for_backward(Transformer(DIMS, 32), tokens))
    estimated = controlled.activations - plain.activations
    assert estimated == pytest.approx(measured - 4 * DIMS.dim * tokens.numel(), rel=1e-3)
    checkpointed = Plan(2, 1, "full")
    assert (estimate_memory(spec(True), 1, checkpointed).activations
            > estimate_memory(spec(False), 1, checkpointed).activations)


def test_the_bounds_must_be_positive() -> None:
    for field in ("betaMax", "velocityMax"):
        with pytest.raises(ValidationError, match=field):
            ModelSpec(preset="tiny", dynamics={"enabled": True, field: 0})
    assert ModelSpec(preset="tiny").dynamics == DynamicsSpec(enabled=False, betaMax=2.0,
                                                            velocityMax=10.0)


def test_the_gauges_and_log_fields_exist_only_for_a_dynamics_job(
        tiny_job: Any, tmp_path: Path) -> None:
    from kubetrain.api.manifest import load_job
    from kubetrain.trainer.metrics import DynamicsReport, Reporter, StepReport

    def report(name: str, dynamics: DynamicsReport | None) -> tuple[dict, dict]:
        job = load_job(tiny_job(name, model={"preset": "tiny",
                                             "dynamics": {"enabled": dynamics is not None}}))
        log = tmp_path / f"{name}.jsonl"
        reporter = Reporter(job.spec, enabled=True, metrics_log=log, job_name=name)
        try:
            reporter.logged(StepReport(step=5, epoch=0.1, loss=3.0, learning_rate=1e-3,
                                       grad_norm=1.0, tokens_per_second=1.0, mfu=0.0,
                                       step_time=0.1, data_wait_ratio=0.0, dynamics=dynamics),
                            torch.device("cpu"))
            url = f"http://127.0.0.1:{job.spec.metrics.port}/metrics"
            exposition = urllib.request.urlopen(url, timeout=10).read().decode()
        finally:
            reporter.close()
        gauges = {f.name: f.samples[0].value for f in text_string_to_metric_families(exposition)
                  if f.name.startswith("kubetrain_dynamics")}
        (step,) = [json.loads(line) for line in log.read_text().splitlines()]
        return gauges, step

    gauges, step = report("with", DynamicsReport(equilibrium_mean=0.01, beta_mean=0.2,
                                                 velocity_rms=0.5))
    assert gauges == {"kubetrain_dynamics_equilibrium_mean": 0.01,
                      "kubetrain_dynamics_beta_mean": 0.2, "kubetrain_dynamics_velocity_rms": 0.5}
    assert (step["dynamics_mu_mean"], step["dynamics_beta_mean"],
            step["dynamics_velocity_rms"]) == (0.01, 0.2, 0.5)
    gauges, step = report("without", None)
    assert gauges == {} and not any(key.startswith("dynamics") for key in step)


# --- a dynamics job, trained once by two FSDP2 ranks --------------------------------------

TRAINED_STEPS = 30
BETA_MAX = 1.5


@pytest.fixture(scope="module")
def trained(prepared_corpus: Any, launcher: Any,
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny dynamics job trained by 2 torchrun ranks (FSDP2, selective activation
    checkpointing), exported at the end: its metrics-log events and folders."""
    folder = tmp_path_factory.mktemp("dynamics-job")
    manifest = {
        "apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "dynamics"},
        "spec": {
            "image": "kubetrain/trainer:test",
            "model": {"preset": "tiny", "dynamics": {"enabled": True, "betaMax": BETA_MAX}},
            "data": {"train": prepared_corpus.train_uri, "seqLen": 64},
            "optimization": {"maxSteps": TRAINED_STEPS, "microBatchSize": 4, "warmupSteps": 5},
            "evaluation": {"everySteps": 0},
            "parallelism": {"strategy": "fsdp", "precision": "fp32",
                            "activationCheckpointing": "selective"},
            "checkpoint": {"uri": str(folder / "checkpoints"), "everySteps": 1000},
            "metrics": {"port": launcher.free_port(), "logEverySteps": 5},
        },
    }
    job = folder / "job.yaml"
    job.write_text(yaml.safe_dump(manifest))
    events = launcher.train(job, ranks=2)
    return {"events": events, "checkpoints": folder / "checkpoints",
            "export": folder / "checkpoints" / "export"}


@pytest.mark.slow
def test_a_dynamics_job_learns_the_corpus_and_logs_the_controller(trained: dict) -> None:
    steps = [e for e in trained["events"] if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(5, TRAINED_STEPS + 1, 5))
    first, last = steps[0]["loss"], steps[-1]["loss"]
    print(f"loss at step {steps[0]['step']}: {first:.3f}, at step {steps[-1]['step']}: "
          f"{last:.3f}; last mu {steps[-1]['dynamics_mu_mean']:.3g}, beta "
          f"{steps[-1]['dynamics_beta_mean']:.4f}, v rms {steps[-1]['dynamics_velocity_rms']:.3g}")
    assert last < first - 1.0, f"the loss went from {first:.3f} to {last:.3f}"
    for event in steps:
        assert 0 <= event["dynamics_beta_mean"] <= BETA_MAX
        assert 0 <= event["dynamics_velocity_rms"] <= 10.0
        assert math.isfinite(event["dynamics_mu_mean"])
    # mu moved away from its initial zeros, and beta from its initial 0.05 * betaMax.
    assert steps[-1]["dynamics_mu_mean"] != 0
    assert steps[-1]["dynamics_beta_mean"] != pytest.approx(0.05 * BETA_MAX, abs=1e-6)


@pytest.mark.slow
def test_logged_mean_mu_is_the_mean_of_the_exported_mu_under_fsdp2(trained: dict) -> None:
    """Each rank holds a shard of mu: the logged mean is over the whole of it."""
    from safetensors.torch import load_file

    weights = load_file(str(trained["export"] / "model.safetensors"))
    mus = [weights[f"model.layers.{i}.dynamics.equilibrium"] for i in range(DIMS.n_layers)]
    (last,) = [e for e in trained["events"] if e["event"] == "step"][-1:]
    assert last["step"] == TRAINED_STEPS
    assert last["dynamics_mu_mean"] == pytest.approx(float(torch.cat(mus).mean()), rel=1e-5)


@pytest.mark.slow
def test_the_export_is_marked_and_transformers_refuses_it(trained: dict) -> None:
    from safetensors.torch import load_file

    config = json.loads((trained["export"] / "config.json").read_text())
    assert config["architectures"] == ["KubetrainDynamicsForCausalLM"]
    assert config["model_type"] == "kubetrain_dynamics"
    assert config["kubetrain"] == {"dynamics": {"betaMax": BETA_MAX, "velocityMax": 10.0,
                                                "controllerWidth": 64}}
    assert config["hidden_size"] == DIMS.dim and config["num_hidden_layers"] == DIMS.n_layers
    names = set(load_file(str(trained["export"] / "model.safetensors")))
    assert {f"model.layers.{i}.dynamics.{p}" for i in range(DIMS.n_layers) for p in (
        "equilibrium", "controller_in.weight", "controller_in.bias", "controller_out.weight",
        "controller_out.bias")} <= names
    import transformers

    with pytest.raises(ValueError, match="kubetrain_dynamics"):
        transformers.AutoConfig.from_pretrained(str(trained["export"]))


@pytest.mark.slow
def test_generate_samples_from_a_dynamics_checkpoint(
        trained: dict, capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.torch import load_file

    from kubetrain.trainer.generate import add_arguments, load_model, run, sample

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    loaded = load_model(str(trained["checkpoints"]))
    assert loaded.step == TRAINED_STEPS and loaded.model.has_dynamics
    exported = load_file(str(trained["export"] / "model.safetensors"))
    state = loaded.model.state_dict()
    for i in range(DIMS.n_layers):
        for name in ("equilibrium", "controller_out.bias"):
            assert torch.equal(state[f"layers.{i}.dynamics.{name}"],
                               exported[f"model.layers.{i}.dynamics.{name}"])
    prompt = loaded.tokenizer.encode("def ", add_special_tokens=False).ids
    produced = sample(loaded.model, prompt, max_tokens=8, temperature=0, top_k=None)
    assert len(produced) == 8
    # And the command itself, as a user runs it.
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--checkpoint", str(trained["checkpoints"]), "--prompt", "def ",
                              "--max-tokens", "8", "--temperature", "0"])
    assert run(args) == 0
    assert capsys.readouterr().out.startswith("def ")
