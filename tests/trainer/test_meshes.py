"""Meshes from the pod shape (mesh.py, tensor_parallel.py): HSDP and tensor parallelism train
what one process trains, and checkpoints reshard between meshes.

The torchrun tests play two pods of two processes (workers.replicas 2, procsPerWorker 2)
as four gloo ranks on CPU. Tolerances: the losses of fp32 runs over different meshes
differ only by the order of floating-point reductions (all-reduces, reduce-scatters, the
vocabulary-parallel softmax's sums), so they are compared at a relative 1e-4 over 20
steps, as the existing split-batch test does for fsdp and ddp.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from kubetrain.api.manifest import parse_job
from kubetrain.trainer.estimate import GIB, auto_shape, estimate_memory, job_plan
from kubetrain.trainer.mesh_shape import MeshError, MeshShape, mesh_shape
from kubetrain.trainer.model import Transformer

sys.path.insert(0, str(Path(__file__).parent))
from conftest import Launcher, deep_merge  # the trainer tests' launcher
from forked_torchrun import command as forked_torchrun  # (tests/) torchrun, ranks forked
from mesh_worker import SEQ, dims  # the worker's model and batch

WORKER = Path(__file__).with_name("mesh_worker.py")
STEPS = 20
RESUME_AT = 10


def _spec(**parallelism: Any) -> Any:
    return parse_job({
        "apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "m"},
        "spec": {"image": "x", "model": {"preset": "llama-8b"},
                 "data": {"train": "s3://d/train", "seqLen": 4096},
                 "workers": {"replicas": 4, "procsPerWorker": 8},
                 # 32 data-parallel ranks' micro-batches of 8 sequences make one step.
                 "optimization": {"microBatchSize": 8, "globalBatchTokens": 32 * 8 * 4096},
                 "parallelism": parallelism, "checkpoint": {"uri": "s3://c/m"}}}).spec


# --- the shape rule, torch-free ---------------------------------------------------------

@pytest.mark.parametrize(("strategy", "tp", "expected"), [
    ("fsdp", 1, MeshShape("fsdp", shard=32)),
    ("ddp", 1, MeshShape("ddp", replicate=32)),
    ("hsdp", 1, MeshShape("hsdp", replicate=4, shard=8)),
    ("fsdp", 4, MeshShape("fsdp", shard=8, tensor_parallel=4)),
    ("hsdp", 2, MeshShape("hsdp", replicate=4, shard=4, tensor_parallel=2)),
])
def test_the_mesh_keeps_tensor_parallelism_and_hsdp_shards_inside_a_pod(
        strategy: str, tp: int, expected: MeshShape) -> None:
    spec = _spec(strategy=strategy, tensorParallel=tp)
    shape = mesh_shape(spec.parallelism, 8, 32)
    assert shape == expected
    assert shape.world_size == 32 and shape.dp_size == 32 // tp
    # A pod is 8 ranks: the shard group and the tensor-parallel group fit in one.
    assert shape.shard * shape.tensor_parallel <= 8 or strategy == "fsdp"


def test_hsdp_rescales_only_the_replicate_dimension_and_one_pod_is_fsdp() -> None:
    spec = _spec(strategy="hsdp", tensorParallel=2)
    shapes = [mesh_shape(spec.parallelism, 8, 8 * pods) for pods in (1, 2, 3, 4)]
    assert [(s.replicate, s.shard, s.tensor_parallel) for s in shapes] == [
        (1, 4, 2), (2, 4, 2), (3, 4, 2), (4, 4, 2)]
    assert shapes[0].strategy == "fsdp" and shapes[1].strategy == "hsdp"
    with pytest.raises(MeshError, match="procsPerWorker"):
        mesh_shape(spec.parallelism, 8, 12)  # one pod and a half


def test_auto_prefers_hsdp_then_fsdp_then_tensor_parallelism_as_memory_runs_out() -> None:
    """llama-8b on 4 pods of 8: hsdp fits a large GPU, fsdp a middling one, and only tensor
    parallelism fits a small one; on CPU (no bound) the first candidate wins."""
    spec = _spec(strategy="auto")
    model = spec.model.resolve()
    figures = {}
    for shape in (MeshShape("hsdp", 4, 8), MeshShape("fsdp", shard=32),
                  MeshShape("fsdp", shard=16, tensor_parallel=2)):
        figures[shape] = estimate_memory(spec, 32, job_plan(spec, 32, shape), dims=model,
                                         mesh=shape).total
    hsdp, fsdp, tp2 = figures
    assert figures[hsdp] > figures[fsdp] > figures[tp2]
    assert auto_shape(spec, model, 32, None)[0] == hsdp
    assert auto_shape(spec, model, 32, figures[hsdp] + GIB)[0] == hsdp
    assert auto_shape(spec, model, 32, figures[fsdp] + GIB)[0] == fsdp
    assert auto_shape(spec, model, 32, figures[tp2] + GIB)[0] == tp2
    # Nothing fits: the most sharded mesh the model allows (8 kv heads: tensorParallel 8).
    assert auto_shape(spec, model, 32, GIB)[0] == MeshShape("fsdp", shard=4, tensor_parallel=8)


def test_estimate_splits_weights_and_activations_by_tensor_parallelism() -> None:
    spec = _spec(tensorParallel=4)
    model = spec.model.resolve()
    flat = MeshShape("fsdp", shard=32)
    split = MeshShape("fsdp", shard=8, tensor_parallel=4)
    hsdp = MeshShape("hsdp", replicate=4, shard=8)
    plan = job_plan(spec, 32, split)
    assert plan.gradient_accumulation == 4 * job_plan(spec, 32, flat).gradient_accumulation
    on_flat = estimate_memory(spec, 32, plan, dims=model, mesh=flat)
    on_split = estimate_memory(spec, 32, plan, dims=model, mesh=split)
    on_hsdp = estimate_memory(spec, 32, plan, dims=model, mesh=hsdp)
    # The same 32 pieces of every parameter; a quarter of the activations, but for the
    # gathered inputs; the loss holds a quarter of the vocabulary per chunk.
    assert on_split.optimizer == on_flat.optimizer
    assert on_flat.activations / 4 < on_split.activations < on_flat.activations / 2
    assert on_split.fsdp_working_set == on_flat.fsdp_working_set // 4
    # HSDP shards within the pod only: four times the sharded state of flat fsdp.
    assert on_hsdp.optimizer == 4 * on_flat.optimizer


def test_estimate_says_which_mesh_fits_a_70b_model_on_8_nodes_of_8_gpus(tmp_path: Path) -> None:
    """llama-70b, 8 x 8 H100s, 8192-token sequences without checkpointing: flat fsdp does
    not fit, fsdp 8 x tp 8 does, and the command says so; under auto it picks that mesh."""
    job = {"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
           "metadata": {"name": "big"},
           "spec": {"image": "x", "model": {"preset": "llama-70b"},
                    "data": {"train": "s3://d/train", "seqLen": 8192},
                    "workers": {"replicas": 8, "procsPerWorker": 8},
                    "optimization": {"microBatchSize": 1},
                    "checkpoint": {"uri": "s3://c/big"}}}
    path = tmp_path / "job.yaml"

    def estimate(**parallelism: Any) -> subprocess.CompletedProcess[str]:
        path.write_text(yaml.safe_dump(deep_merge(job, {"spec": {"parallelism": parallelism}})))
        return subprocess.run([sys.executable, "-m", "kubetrain", "estimate", str(path)],
                              capture_output=True, text=True, timeout=120)

    flat = estimate()
    assert flat.returncode == 1, flat.stderr
    assert "fsdp 8 x tp 8 fits at the job's micro-batch" in flat.stdout, flat.stdout
    assert "parallelism.tensorParallel: 8" in flat.stdout
    chosen = estimate(strategy="auto")
    assert chosen.returncode == 0, chosen.stdout
    assert "parallelism.strategy auto chose fsdp 8 x tp 8" in chosen.stdout, chosen.stdout


# --- real meshes, four gloo ranks -----------------------------------------------------

MESHES = [
    ("hsdp", 1, "untied", "hsdp 2 x 2 (replicate x shard)"),
    ("fsdp", 2, "untied", "fsdp 2 x tp 2"),
    ("hsdp", 2, "tied", "hsdp 2 x 1 (replicate x shard) x tp 2"),
]


@pytest.fixture(scope="module")
def mesh_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """mesh_worker.py's forward and backward over every mesh of MESHES, in one launch."""
    out = tmp_path_factory.mktemp("mesh-worker") / "result.pt"
    meshes = ",".join(f"{strategy}:{tp}:{tied}" for strategy, tp, tied, _ in MESHES)
    done = subprocess.run(
        forked_torchrun("--standalone", "--nproc-per-node=4", str(WORKER), str(out), meshes,
                        "llama,gemma3"),
        env=Launcher().env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return torch.load(out)


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "tp", "tied", "shape"), MESHES)
def test_each_mesh_computes_the_loss_and_gradients_of_one_process(
        mesh_results: dict[str, Any], strategy: str, tp: int, tied: str, shape: str) -> None:
    """For a Llama and, in the same launch, a Gemma 3 (per-head q/k norms on split heads,
    norms after each branch on split sequences, a sliding window, wide heads)."""
    got = mesh_results["meshes"][f"{strategy}:{tp}:{tied}"]
    assert got["shape"] == shape
    assert got["dp_ranks"] == ([0, 0, 1, 1] if tp == 2 else [0, 1, 2, 3])
    assert got["dp_size"] == 4 // tp
    tokens = mesh_results["tokens"]
    assert set(got["families"]) == {"llama", "gemma3"}
    for family, found in got["families"].items():
        torch.manual_seed(0)
        alone = Transformer(dims(tied == "tied", family), max_seq_len=SEQ)
        loss = alone(tokens[:, :-1], tokens[:, 1:]) / tokens[:, 1:].numel()
        loss.backward()
        assert float(found["loss"]) == pytest.approx(loss.item(), rel=1e-5), family
        for name, parameter in alone.named_parameters():
            assert parameter.grad is not None
            torch.testing.assert_close(found["grads"][name], parameter.grad, rtol=1e-4,
                                       atol=1e-6, msg=lambda m, n=f"{family} {name}": f"{n}: {m}")


@pytest.fixture(scope="module")
def runs(prepared_corpus: Any, tmp_path_factory: pytest.TempPathFactory,
         launcher: Launcher) -> dict[str, list[dict[str, Any]]]:
    """The same 20 fp32 steps of the tiny model (16 sequences a step) on one process and on
    4 ranks under fsdp, hsdp 2 x 2 and fsdp 2 x tp 2; then the fsdp run's step-10
    checkpoint resumed under hsdp and under tensor parallelism. Each run's step events."""
    root = tmp_path_factory.mktemp("meshes")

    def train(name: str, ranks: int, **parallelism: Any) -> list[dict[str, Any]]:
        resume = parallelism.pop("resume_from", None)
        spec = {
            "image": "kubetrain/trainer:test", "model": {"preset": "tiny"},
            "data": {"train": prepared_corpus.train_uri, "seqLen": 64},
            "workers": {"replicas": 2, "procsPerWorker": 2},
            "optimization": {"maxSteps": STEPS, "microBatchSize": 4,
                             "globalBatchTokens": 16 * 64, "warmupSteps": 5},
            "evaluation": {"everySteps": 0},
            "parallelism": {"precision": "fp32", **parallelism},
            "checkpoint": {"uri": str(root / name / "checkpoints"), "everySteps": RESUME_AT,
                           "export": False, **({"resumeFrom": resume} if resume else {})},
            "metrics": {"port": launcher.free_port(), "logEverySteps": 1},
        }
        job = root / name / "job.yaml"
        job.parent.mkdir(parents=True)
        job.write_text(yaml.safe_dump({"apiVersion": "kubetrain.io/v1alpha1",
                                       "kind": "TrainingJob", "metadata": {"name": name},
                                       "spec": spec}))
        return [e for e in launcher.train(job, ranks, timeout=300) if e["event"] == "step"]

    found = {"alone": train("alone", 1),
             "fsdp": train("fsdp", 4, strategy="fsdp"),
             "hsdp": train("hsdp", 4, strategy="hsdp"),
             "tp": train("tp", 4, strategy="fsdp", tensorParallel=2)}
    saved = str(root / "fsdp" / "checkpoints" / f"step-{RESUME_AT:08d}")
    found["resumed-hsdp"] = train("resumed-hsdp", 4, strategy="hsdp", resume_from=saved)
    found["resumed-tp"] = train("resumed-tp", 4, strategy="hsdp", tensorParallel=2,
                                resume_from=saved)
    return found


def _curve(events: list[dict[str, Any]]) -> list[float]:
    return [e["loss"] for e in events] + [e["grad_norm"] for e in events]


@pytest.mark.slow
def test_fsdp_hsdp_and_tensor_parallel_train_the_curve_of_one_process(runs) -> None:
    alone = runs["alone"]
    assert [e["step"] for e in alone] == list(range(1, STEPS + 1))
    for mesh in ("fsdp", "hsdp", "tp"):
        assert [e["step"] for e in runs[mesh]] == list(range(1, STEPS + 1)), mesh
        assert _curve(runs[mesh]) == pytest.approx(_curve(alone), rel=1e-4), mesh
        # The same global batch however it was split: the same share of the data each step.
        assert [e["epoch"] for e in runs[mesh]] == [e["epoch"] for e in alone], mesh
    assert alone[-1]["loss"] < alone[0]["loss"] - 0.5  # it learned: equal curves are not flat


@pytest.mark.slow
def test_a_checkpoint_saved_under_fsdp_resumes_under_hsdp_and_tensor_parallelism(runs) -> None:
    """Saved by 4 fsdp ranks at step 10; resumed by hsdp 2 x 2 and by hsdp 2 x 1 x tp 2
    (DCP reshards the model, the optimizer state and the data position): steps 11-20
    continue the uninterrupted fsdp curve."""
    uninterrupted = runs["fsdp"][RESUME_AT:]
    for mesh in ("resumed-hsdp", "resumed-tp"):
        assert [e["step"] for e in runs[mesh]] == list(range(RESUME_AT + 1, STEPS + 1)), mesh
        assert _curve(runs[mesh]) == pytest.approx(_curve(uninterrupted), rel=1e-4), mesh
