"""model.init: Hugging Face Llama folders load into kubetrain, as the inverse of the export.

A tiny `LlamaForCausalLM` made by transformers (random weights, `save_pretrained` as
one file and as shards) computes the same logits in kubetrain; export(import(x)) is
x; dimensions that disagree with config.json, missing or misshapen tensors and
unsupported configs are refused; two FSDP2 ranks each read only their shards; and a
job started from another job's export starts at that job's validation loss. Exports
of a model with INL dynamics load too, with the folder's dynamics settings.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from forked_torchrun import command as forked_torchrun  # (tests/) torchrun, ranks forked
from safetensors.torch import load_file, save_file

from kubetrain.api.manifest import parse_job
from kubetrain.api.trainingjob import DynamicsSpec, StorageSpec, TrainingJobSpec
from kubetrain.pod_conventions import ATTEMPT_STARTED_ENV
from kubetrain.trainer.export import _interleaved_to_halves, export_model
from kubetrain.trainer.hf_families import ROTATED_ROWS
from kubetrain.trainer.loop import Trainer
from kubetrain.trainer.model import Transformer
from kubetrain.trainer.prepare import PreparedDataset
from kubetrain.trainer.pretrained import _halves_to_interleaved, load_pretrained, pretrained_dims
from kubetrain.trainer.pretrained_config import (
    PretrainedError,
    dynamics_config,
    read_config,
    trained_model,
)
from kubetrain.trainer.storage import open_storage

WORKER = Path(__file__).with_name("pretrained_worker.py")
LOGIT_TOLERANCE = 1e-5  # absolute and relative, fp32 on CPU

# Two shapes of model: grouped-query attention with an untied head in one file, and a
# tied one in shards whose sizes split unevenly over two ranks (vocabulary 255, three
# heads of 16 rows: a rank's half of the query rows ends inside a head).
MODELS = {
    "single": dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, rope_theta=5000.0,
                   tie_word_embeddings=False),
    "sharded": dict(vocab_size=255, hidden_size=48, intermediate_size=100, num_hidden_layers=2,
                    num_attention_heads=3, num_key_value_heads=1, rope_theta=10_000.0,
                    tie_word_embeddings=True),
}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Folders written by transformers' save_pretrained: "single" file and "sharded"."""
    root = tmp_path_factory.mktemp("hf")
    folders = {}
    for layout, options in MODELS.items():
        torch.manual_seed(1)
        config = transformers.LlamaConfig(max_position_embeddings=128, **options)
        model = transformers.LlamaForCausalLM(config)
        with torch.no_grad():  # non-trivial norms, so a swapped norm weight would show
            for name, parameter in model.named_parameters():
                if name.endswith("norm.weight"):
                    parameter.uniform_(0.5, 1.5)
        folders[layout] = root / layout
        model.save_pretrained(folders[layout], max_shard_size="20KB" if layout == "sharded"
                              else "1GB")
    assert (folders["sharded"] / "model.safetensors.index.json").exists()
    assert (folders["single"] / "model.safetensors").exists()
    return folders


def _imported(folder: Path | str, storage: StorageSpec | None = None) -> Transformer:
    config = read_config(str(folder), storage)
    model = Transformer(config.dims, max_seq_len=128, dynamics=config.dynamics)
    load_pretrained(model, str(folder), storage)
    return model


def _job(corpus: PreparedDataset, checkpoints: Path, **spec: Any) -> TrainingJobSpec:
    base: dict[str, Any] = {
        "image": "trainer", "model": {"preset": "tiny"},
        "data": {"train": corpus.train_uri, "seqLen": 64},
        "optimization": {"maxSteps": 10, "warmupSteps": 2, "microBatchSize": 8},
        "evaluation": {"everySteps": 0, "batches": 4},
        "parallelism": {"precision": "fp32"},
        "checkpoint": {"uri": str(checkpoints), "everySteps": 1000},
    }
    for section, values in spec.items():
        base[section] = {**base.get(section, {}), **values}
    return parse_job({"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
                      "metadata": {"name": "init"}, "spec": base}).spec


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_a_transformers_llama_loads_with_the_same_logits(
        layout: str, hf_models: dict[str, Path]) -> None:
    folder = hf_models[layout]
    model = _imported(folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokens = torch.randint(0, MODELS[layout]["vocab_size"], (2, 100),
                           generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    print(f"{layout}: max |logit difference| = {(ours - theirs).abs().max().item():.3g}")
    torch.testing.assert_close(ours, theirs, rtol=LOGIT_TOLERANCE, atol=LOGIT_TOLERANCE)


def test_halves_to_interleaved_inverts_the_exports_permutation() -> None:
    weight = torch.randn(6 * 8, 5)
    halves = _interleaved_to_halves(weight, 6)
    assert not torch.equal(halves, weight)
    assert torch.equal(_halves_to_interleaved(halves, 6), weight)


def _same_tensors(expected: Path, actual: Path) -> dict[str, torch.Tensor]:
    """Assert both folders' model.safetensors hold the same tensors (names, dtypes,
    values); returns them."""
    first, second = (load_file(folder / "model.safetensors") for folder in (expected, actual))
    assert first.keys() == second.keys()
    for name, tensor in first.items():
        assert tensor.dtype == second[name].dtype and torch.equal(tensor, second[name]), name
    return first


@pytest.mark.usefixtures("process_group")
def test_export_of_the_import_is_the_exported_folder_bit_for_bit(
        tmp_path: Path, prepared_corpus: PreparedDataset) -> None:
    spec = _job(prepared_corpus, tmp_path / "first", model={"tieEmbeddings": False})
    dims = spec.model.resolve()
    torch.manual_seed(0)
    model = Transformer(dims, max_seq_len=64)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
    exported = Path(export_model(model, dims, spec, rank=0).removeprefix("file://"))

    again_spec = _job(prepared_corpus, tmp_path / "second", model={"init": str(exported)})
    again = Transformer(trained_model(again_spec)[1], max_seq_len=64)
    load_pretrained(again, str(exported), None)
    reexported = Path(export_model(again, again.dims, again_spec, rank=0).removeprefix("file://"))

    tensors = _same_tensors(exported, reexported)
    assert all(tensor.dtype == torch.float32 for tensor in tensors.values())
    assert (exported / "model.safetensors").read_bytes() == (
        reexported / "model.safetensors").read_bytes()
    for name in ("config.json", "generation_config.json", "tokenizer_config.json",
                 "tokenizer.json"):
        assert (exported / name).read_bytes() == (reexported / name).read_bytes(), name


@pytest.mark.usefixtures("process_group")
def test_a_transformers_folder_exports_back_to_its_own_tensors(
        tmp_path: Path, prepared_corpus: PreparedDataset, hf_models: dict[str, Path]) -> None:
    folder = hf_models["single"]
    spec = _job(prepared_corpus, tmp_path / "ckpt", model={"init": str(folder)})
    model = Transformer(trained_model(spec)[1], max_seq_len=64)
    load_pretrained(model, str(folder), None)
    exported = Path(export_model(model, model.dims, spec, rank=0).removeprefix("file://"))
    _same_tensors(folder, exported)
    config = json.loads((folder / "config.json").read_text())
    config_out = json.loads((exported / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "vocab_size", "intermediate_size", "tie_word_embeddings", "rms_norm_eps",
                "head_dim", "model_type"):
        assert config_out[key] == config[key], key
    assert config_out["rope_theta"] == config["rope_parameters"]["rope_theta"]


@pytest.mark.parametrize(("model", "named"), [
    ({"dim": 32}, ["spec.model.dim is 32", "hidden_size 64", "remove model.dim"]),
    ({"preset": "custom", "nKvHeads": 4, "tieEmbeddings": True},
     ["spec.model.nKvHeads is 4", "num_key_value_heads 2",
      "spec.model.tieEmbeddings is true", "tie_word_embeddings false"]),
    ({"normEps": 1e-3}, ["spec.model.normEps is 0.001", "rms_norm_eps 1e-06"]),
])
def test_dimensions_that_disagree_with_config_json_are_refused_naming_both(
        tmp_path: Path, prepared_corpus: PreparedDataset, hf_models: dict[str, Path],
        model: dict[str, Any], named: list[str]) -> None:
    folder = hf_models["single"]
    spec = _job(prepared_corpus, tmp_path, model={"init": str(folder), **model})
    with pytest.raises(PretrainedError) as refused:
        trained_model(spec)
    for text in [*named, f"config.json at file://{folder}"]:
        assert text in str(refused.value), (text, str(refused.value))


def test_matching_dimensions_and_the_default_norm_eps_are_accepted(
        tmp_path: Path, prepared_corpus: PreparedDataset, hf_models: dict[str, Path]) -> None:
    spec = _job(prepared_corpus, tmp_path, model={
        "init": str(hf_models["single"]), "dim": 64, "nKvHeads": 2, "normEps": 1e-5})
    dims = trained_model(spec)[1]
    assert (dims.dim, dims.n_kv_heads, dims.norm_eps) == (64, 2, 1e-6)


def test_a_sequence_longer_than_the_models_positions_is_refused(
        tmp_path: Path, prepared_corpus: PreparedDataset, hf_models: dict[str, Path]) -> None:
    spec = _job(prepared_corpus, tmp_path, model={"init": str(hf_models["single"])},
                data={"seqLen": 256})
    with pytest.raises(PretrainedError, match=r"spec.data.seqLen \(256\) is longer than "
                       r"max_position_embeddings \(128\)"):
        trained_model(spec)


def _copy(folder: Path, to: Path) -> Path:
    shutil.copytree(folder, to)
    return to


def _edit_config(folder: Path, **changes: Any) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(("changes", "message"), [
    ({"model_type": "gemma2"}, "has model_type 'gemma2'"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
     "needs rope_parameters.low_freq_factor as a positive number for rope_type 'llama3'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 2.0}},
     "rope_parameters with rope_type 'yarn'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}},
     "has rope_parameters and rope_scaling that disagree"),
    ({"attention_bias": True}, "has attention_bias: true"),
    ({"hidden_act": "gelu"}, "has hidden_act 'gelu'"),
    ({"head_dim": 15}, "a head size of 15"),
    ({"kubetrain": {"mixtureOfExperts": {"experts": 8}}},
     "marks the model with kubetrain.mixtureOfExperts: it was exported by a kubetrain with a "
     "feature this version does not build"),
    (dynamics_config(DynamicsSpec(enabled=True)) | {"model_type": "llama"},
     "marks kubetrain.dynamics but has model_type 'llama'"),
    ({"model_type": "kubetrain_dynamics"},
     "has model_type kubetrain_dynamics but no kubetrain.dynamics entry"),
    ({"model_type": "kubetrain_dynamics",
      "kubetrain": {"dynamics": {"betaMax": 2.0, "velocityMax": 10.0, "controllerWidth": 32}}},
     "has kubetrain.dynamics.controllerWidth 32, but this kubetrain builds the dynamics "
     "controller 64 wide"),
    ({"model_type": "kubetrain_dynamics", "kubetrain": {"dynamics": {"betaMax": 2.0}}},
     "kubetrain reads exactly betaMax, velocityMax, controllerWidth"),
    ({"model_type": "kubetrain_dynamics", "kubetrain": {"dynamics": {
        "betaMax": -1.0, "velocityMax": 10.0, "controllerWidth": 64}}},
     "needs kubetrain.dynamics.betaMax as a positive number, found -1.0"),
    (dynamics_config(DynamicsSpec(enabled=True)) | {"architectures": ["LlamaForCausalLM"]},
     "kubetrain needs a KubetrainDynamicsForCausalLM"),
])
def test_unsupported_configs_are_refused_saying_what(
        tmp_path: Path, hf_models: dict[str, Path], changes: dict[str, Any],
        message: str) -> None:
    folder = _copy(hf_models["single"], tmp_path / "model")
    _edit_config(folder, **changes)
    with pytest.raises(PretrainedError) as refused:
        pretrained_dims(str(folder), None)
    assert str(refused.value).startswith(f"model.init: config.json at file://{folder} ")
    assert message in str(refused.value)


def test_a_missing_tensor_is_refused_naming_it(tmp_path: Path,
                                              hf_models: dict[str, Path]) -> None:
    folder = _copy(hf_models["single"], tmp_path / "model")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    model = Transformer(pretrained_dims(str(folder), None), max_seq_len=128)
    with pytest.raises(PretrainedError, match=r"lacks 1 tensor\(s\).*"
                       r"model.layers.1.mlp.up_proj.weight"):
        load_pretrained(model, str(folder), None)


def test_a_tensor_of_the_wrong_shape_is_refused_with_both_shapes(
        tmp_path: Path, hf_models: dict[str, Path]) -> None:
    folder = _copy(hf_models["single"], tmp_path / "model")
    _edit_config(folder, intermediate_size=128)  # the weights say 96
    model = Transformer(pretrained_dims(str(folder), None), max_seq_len=128)
    with pytest.raises(PretrainedError, match=r"tensor model.layers.0.mlp.\w+_proj.weight .* "
                       r"has shape \[(96, 64|64, 96)\], but .* needs \[(128, 64|64, 128)\]"):
        load_pretrained(model, str(folder), None)


def test_an_unknown_tensor_is_refused_rather_than_dropped(
        tmp_path: Path, hf_models: dict[str, Path]) -> None:
    folder = _copy(hf_models["single"], tmp_path / "model")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.dynamics.mu"] = torch.zeros(64)
    save_file(tensors, folder / "model.safetensors")
    model = Transformer(pretrained_dims(str(folder), None), max_seq_len=128)
    with pytest.raises(PretrainedError, match=r"model\.layers\.0\.dynamics\.mu; refusing"):
        load_pretrained(model, str(folder), None)


@pytest.fixture(scope="module")
def sharded_dynamics_model(hf_models: dict[str, Path],
                           tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The "sharded" folder as a kubetrain dynamics export would have it: marked in
    config.json, with random dynamics tensors in every block, in a shard of their own."""
    folder = _copy(hf_models["sharded"], tmp_path_factory.mktemp("dynamics") / "model")
    _edit_config(folder, **dynamics_config(DynamicsSpec(enabled=True)))
    config = read_config(str(folder), None)
    shapes = {"equilibrium": [config.dims.dim],
              "controller_in.weight": [64, config.dims.dim], "controller_in.bias": [64],
              "controller_out.weight": [3 * config.dims.dim, 64],
              "controller_out.bias": [3 * config.dims.dim]}
    generator = torch.Generator().manual_seed(2)
    save_file({f"model.layers.{i}.dynamics.{name}": torch.randn(shape, generator=generator)
               for i in range(config.dims.n_layers) for name, shape in shapes.items()},
              folder / "model-dynamics.safetensors", metadata={"format": "pt"})
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"].update({f"model.layers.{i}.dynamics.{name}": "model-dynamics.safetensors"
                                for i in range(config.dims.n_layers) for name in shapes})
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


@pytest.fixture(scope="module")
def sharded_family_models(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The "sharded" shape as a Qwen2 (q/k/v biases: rows of one value each) and a Gemma 3
    (per-head q/k norms, heads of 20 wider than hidden / heads), in uneven shards."""
    root = tmp_path_factory.mktemp("families")
    options = {key: value for key, value in MODELS["sharded"].items() if key != "rope_theta"}
    configs = {"qwen2": transformers.Qwen2Config(**options),
               "gemma3": transformers.Gemma3TextConfig(**options, head_dim=20,
                                                       layer_types=["sliding_attention",
                                                                    "full_attention"])}
    folders = []
    for family, config in configs.items():
        torch.manual_seed(1)
        model = transformers.AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith(("norm.weight", ".bias")):
                    parameter.uniform_(-0.5, 0.5)
        model.save_pretrained(root / family, max_shard_size="20KB")
        folders.append(root / family)
    return folders


@pytest.mark.slow
@pytest.mark.parametrize("dynamics", [False, True], ids=["llama-qwen2-gemma3", "dynamics"])
def test_two_fsdp_ranks_each_read_only_their_shards_and_equal_one_process(
        tmp_path: Path, hf_models: dict[str, Path], dynamics: bool,
        request: pytest.FixtureRequest) -> None:
    """For a Llama, and in the same launch a Qwen2 and a Gemma 3, whose biases and head
    norms are permuted per head like the q/k projections; and for a dynamics export."""
    folders = ([request.getfixturevalue("sharded_dynamics_model")] if dynamics
               else [hf_models["sharded"], *request.getfixturevalue("sharded_family_models")])
    done = subprocess.run(
        forked_torchrun("--standalone", "--nproc-per-node=2", str(WORKER), str(tmp_path),
                        *map(str, folders)),
        timeout=120, capture_output=True, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, f"the workers failed:\n{done.stdout}\n{done.stderr}"
    for index, folder in enumerate(folders):
        _check_sharded_load(folder, tmp_path / str(index), dynamics)


def _check_sharded_load(folder: Path, written: Path, dynamics: bool) -> None:
    # The gathered state of the two ranks is the one-process import's.
    single = _imported(folder)
    assert single.has_dynamics == dynamics
    sharded = torch.load(written / "state.pt")
    expected = single.state_dict()
    assert sharded.keys() == expected.keys()
    for name, value in sharded.items():
        assert torch.equal(value, expected[name]), name

    # Each rank read the rows of its own half of every tensor (FSDP2 splits dim 0 as
    # torch.chunk does), widened to whole heads for the query/key projections (and their
    # biases and head norms) only.
    head_dim = single.dims.head_size
    shapes = {name: tensor.shape for name, tensor in _all_tensors(folder).items()}
    whole = sum(shape.numel() * 4 for name, shape in shapes.items()
                if name != "lm_head.weight")
    covered: dict[str, set[int]] = {}
    for rank in range(2):
        reads = json.loads((written / f"reads-{rank}.json").read_text())
        assert {name for name, *_ in reads} <= shapes.keys()
        for name, start, stop, _bytes in reads:
            rows = shapes[name][0]
            chunk = -(-rows // 2)
            own_start, own_stop = rank * chunk, min(rows, (rank + 1) * chunk)
            if name.endswith(ROTATED_ROWS):
                own_start = own_start // head_dim * head_dim
                own_stop = -(-own_stop // head_dim) * head_dim
            assert (start, stop) == (own_start, own_stop), (rank, name, start, stop)
            covered.setdefault(name, set()).update(range(start, stop))
        read_bytes = sum(size for *_, size in reads)
        print(f"{folder.name} rank {rank} read {read_bytes} of {whole} bytes")
        assert read_bytes < 0.6 * whole
    assert covered.keys() == shapes.keys() - {"lm_head.weight"}
    for name, rows in covered.items():
        assert rows == set(range(shapes[name][0])), name


def _all_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in folder.glob("*.safetensors"):
        tensors.update(load_file(file))
    return tensors


def test_an_s3_folder_loads_the_same_weights_as_the_local_one(
        hf_models: dict[str, Path], s3_bucket: str, s3_spec: StorageSpec) -> None:
    folder = hf_models["sharded"]
    uri = f"s3://{s3_bucket}/models/tiny"
    store = open_storage(uri, s3_spec)
    for path in folder.iterdir():
        store.upload_file(path, path.name)
    remote, local = _imported(uri, s3_spec), _imported(folder)
    for (name, theirs), ours in zip(local.state_dict().items(), remote.state_dict().values(),
                                    strict=True):
        assert torch.equal(theirs, ours), name


@pytest.fixture
def attempt_starts_now(monkeypatch: pytest.MonkeyPatch) -> None:
    """An in-process Trainer books its startup since the attempt began (by default, since
    the process did) into the process-wide wall-time counter, which later tests in the
    same session read exactly: begin the attempt now, so that it books seconds only."""
    monkeypatch.setenv(ATTEMPT_STARTED_ENV, str(time.time()))


def _events(log: Path, kind: str) -> list[dict[str, Any]]:
    events = [json.loads(line) for line in log.read_text().splitlines()]
    return [event for event in events if event["event"] == kind]


def _evaluations(log: Path) -> list[dict[str, Any]]:
    return _events(log, "eval")


@pytest.mark.usefixtures("process_group", "attempt_starts_now")
def test_a_job_started_from_another_jobs_export_starts_at_its_validation_loss(
        tmp_path: Path, prepared_corpus: PreparedDataset) -> None:
    first = _job(prepared_corpus, tmp_path / "first",
                 optimization={"maxSteps": 8, "microBatchSize": 4},
                 evaluation={"everySteps": 8, "batches": 2})
    done = Trainer(first, metrics_log=tmp_path / "first.jsonl", serve_metrics=False).fit()
    assert done.export_uri is not None
    first_evals = _evaluations(tmp_path / "first.jsonl")
    final = first_evals[-1]["val_loss"]
    assert final < first_evals[0]["val_loss"] - 0.2  # it learned: not a fresh model's loss

    # The second job leaves the preset's dimensions unset: they come from config.json.
    second = _job(prepared_corpus, tmp_path / "second", model={"init": done.export_uri},
                  optimization={"maxSteps": 1, "warmupSteps": 0, "microBatchSize": 4},
                  evaluation={"everySteps": 1, "batches": 2}, checkpoint={"export": False})
    Trainer(second, metrics_log=tmp_path / "second.jsonl", serve_metrics=False).fit()
    started = _evaluations(tmp_path / "second.jsonl")[0]
    print(f"first job's final validation loss {final:.6f}, second job's at step 0 "
          f"{started['val_loss']:.6f}")
    assert started["step"] == 0
    assert started["val_loss"] == pytest.approx(final, rel=1e-5)
    assert [e["uri"] for e in _events(tmp_path / "second.jsonl", "initialised")] == [
        done.export_uri]

    # Resumed, the job continues from its own checkpoint: the pretrained weights are not read
    # again (they are gone: reading them would fail).
    Path(done.export_uri.removeprefix("file://"), "model.safetensors").unlink()
    resumed = second.model_copy(update={"optimization": second.optimization.model_copy(
        update={"max_steps": 2})})
    Trainer(resumed, metrics_log=tmp_path / "resumed.jsonl", serve_metrics=False).fit()
    assert [e["step"] for e in _events(tmp_path / "resumed.jsonl", "resumed")] == [1]
    assert not _events(tmp_path / "resumed.jsonl", "initialised")


def test_the_trainer_exits_2_a_configuration_error_on_a_conflicting_job(
        tmp_path: Path, prepared_corpus: PreparedDataset, hf_models: dict[str, Path],
        capsys: pytest.CaptureFixture[str]) -> None:
    from kubetrain.trainer.__main__ import EXIT_INVALID_MANIFEST, main

    spec = _job(prepared_corpus, tmp_path / "ckpt", model={"init": str(hf_models["single"]),
                                                           "nLayers": 3})
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps({"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
                                "metadata": {"name": "conflict"}, "spec": spec.wire()}))
    assert main([str(path), "--metrics-log", str(tmp_path / "log.jsonl")]) == \
        EXIT_INVALID_MANIFEST
    assert "spec.model.nLayers is 3 but config.json at" in capsys.readouterr().err


# Not the defaults, so that the import can only have them from the folder's config.json.
EXPORTED_DYNAMICS = DynamicsSpec(enabled=True, beta_max=3.0, velocity_max=5.0)


def _dynamics_export(corpus: PreparedDataset, checkpoints: Path) -> tuple[Transformer, Path]:
    """A tiny model with INL dynamics, its every tensor non-trivial, exported by export_model."""
    spec = _job(corpus, checkpoints, model={"tieEmbeddings": False, "dynamics": {
        "enabled": True, "betaMax": EXPORTED_DYNAMICS.beta_max,
        "velocityMax": EXPORTED_DYNAMICS.velocity_max}})
    torch.manual_seed(0)
    model = Transformer(spec.model.resolve(), max_seq_len=64, dynamics=spec.model.dynamics)
    with torch.no_grad():  # norms, mu and the controller's biases start as constants
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight") or ".dynamics." in name:
                parameter.uniform_(0.5, 1.5)
    exported = export_model(model, model.dims, spec, rank=0)
    return model.eval(), Path(exported.removeprefix("file://"))


@pytest.mark.usefixtures("process_group")
def test_a_dynamics_export_imports_with_its_dynamics_and_exports_back_bit_for_bit(
        tmp_path: Path, prepared_corpus: PreparedDataset) -> None:
    original, exported = _dynamics_export(prepared_corpus, tmp_path / "first")

    # The spec leaves model.dynamics unset: enabled, betaMax and velocityMax are the folder's.
    spec, dims = trained_model(
        _job(prepared_corpus, tmp_path / "second", model={"init": str(exported)}))
    assert spec.model.dynamics == EXPORTED_DYNAMICS
    again = Transformer(dims, max_seq_len=64, dynamics=spec.model.dynamics)
    load_pretrained(again, str(exported), None)
    assert again.has_dynamics

    tokens = torch.randint(0, original.dims.vocab_size, (2, 64),
                           generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(again.eval()(tokens), original(tokens))

    reexported = Path(export_model(again, again.dims, spec, rank=0).removeprefix("file://"))
    names = sorted(path.name for path in exported.iterdir())
    assert names == sorted(path.name for path in reexported.iterdir())
    assert "model.layers.1.dynamics.controller_out.weight" in load_file(
        reexported / "model.safetensors")
    for name in names:
        assert (exported / name).read_bytes() == (reexported / name).read_bytes(), name


@pytest.mark.usefixtures("process_group")
def test_a_dynamics_export_does_not_load_into_a_model_built_without_them(
        tmp_path: Path, prepared_corpus: PreparedDataset) -> None:
    original, exported = _dynamics_export(prepared_corpus, tmp_path / "first")
    plain = Transformer(original.dims, max_seq_len=64)
    with pytest.raises(PretrainedError, match=r"built with dynamics .*enabled=False.* but "
                       r"config.json at .* describes .*enabled=True"):
        load_pretrained(plain, str(exported), None)


def _dynamics_folder(hf_models: dict[str, Path], to: Path, dynamics: DynamicsSpec) -> Path:
    """A folder whose config.json marks INL dynamics (its weights do not matter here)."""
    folder = _copy(hf_models["single"], to)
    _edit_config(folder, **dynamics_config(dynamics))
    return folder


@pytest.mark.parametrize(("folder_dynamics", "asked", "named"), [
    (None, {"enabled": True},
     ["spec.model.dynamics.enabled is true but config.json at", "has no kubetrain.dynamics",
      "remove model.dynamics or set enabled to false"]),
    (DynamicsSpec(enabled=True, beta_max=2.5), {"betaMax": 3.0},
     ["spec.model.dynamics.betaMax is 3.0 but config.json at",
      "says kubetrain.dynamics.betaMax 2.5", "set it to 2.5"]),
    (DynamicsSpec(enabled=True), {"enabled": True, "velocityMax": 4.0},
     ["spec.model.dynamics.velocityMax is 4.0", "kubetrain.dynamics.velocityMax 10.0"]),
])
def test_dynamics_that_disagree_with_config_json_are_refused_naming_both(
        tmp_path: Path, prepared_corpus: PreparedDataset, hf_models: dict[str, Path],
        folder_dynamics: DynamicsSpec | None, asked: dict[str, Any], named: list[str]) -> None:
    folder = (hf_models["single"] if folder_dynamics is None
              else _dynamics_folder(hf_models, tmp_path / "model", folder_dynamics))
    spec = _job(prepared_corpus, tmp_path, model={"init": str(folder), "dynamics": asked})
    with pytest.raises(PretrainedError) as refused:
        trained_model(spec)
    for text in named:
        assert text in str(refused.value), (text, str(refused.value))


@pytest.mark.parametrize("asked", [{}, {"enabled": False}, {"enabled": True},
                                   {"enabled": True, "betaMax": 2.5}])
def test_dynamics_left_at_their_defaults_or_matching_are_the_folders(
        tmp_path: Path, prepared_corpus: PreparedDataset, hf_models: dict[str, Path],
        asked: dict[str, Any]) -> None:
    """enabled: false is the default, which the API server writes into a spec that leaves
    model.dynamics out: it cannot be told from "unset", so the folder's dynamics win."""
    folder_dynamics = DynamicsSpec(enabled=True, beta_max=2.5)
    folder = _dynamics_folder(hf_models, tmp_path / "model", folder_dynamics)
    spec = _job(prepared_corpus, tmp_path, model={"init": str(folder), "dynamics": asked})
    assert trained_model(spec)[0].model.dynamics == folder_dynamics


@pytest.mark.usefixtures("process_group", "attempt_starts_now")
def test_a_job_started_from_a_dynamics_export_trains_checkpoints_and_exports_with_them(
        tmp_path: Path, prepared_corpus: PreparedDataset) -> None:
    _, exported = _dynamics_export(prepared_corpus, tmp_path / "first")
    spec = _job(prepared_corpus, tmp_path / "second", model={"init": str(exported)},
                optimization={"maxSteps": 1, "warmupSteps": 0, "microBatchSize": 4},
                metrics={"logEverySteps": 1})
    done = Trainer(spec, metrics_log=tmp_path / "log.jsonl", serve_metrics=False).fit()
    (step,) = _events(tmp_path / "log.jsonl", "step")
    assert 0 <= step["dynamics_beta_mean"] <= EXPORTED_DYNAMICS.beta_max  # a dynamics model
    assert done.export_uri is not None
    config = json.loads(Path(done.export_uri.removeprefix("file://"), "config.json").read_text())
    assert config["kubetrain"]["dynamics"]["betaMax"] == EXPORTED_DYNAMICS.beta_max
    # The checkpoint records the dynamics, so `kubetrain generate` builds the same model.
    from kubetrain.trainer.generate import load_model

    assert load_model(str(tmp_path / "second")).model.has_dynamics
