"""Model families on one block (kubetrain.api.families): presets, windows, sizing, the spec's
refusals, and parallelize's compile and activation checkpointing per family.

Every family preset is checked against transformers itself: its config (export's) builds
the family's *ForCausalLM on the meta device with exactly the tensors, under the mapped
names and shapes, that kubetrain's model has, and as many parameters as sizing counts.
The estimate's per-family activation terms are checked against what autograd keeps.
Equivalence of imported and exported weights with transformers is tests/storage/
test_families.py's; the meshes' (fsdp, hsdp, tensor parallel) test_meshes.py's.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from kubetrain.api.families import FAMILIES
from kubetrain.api.manifest import InvalidManifest, parse_job
from kubetrain.api.presets import PRESETS, ModelDims
from kubetrain.api.trainingjob import TrainingJobSpec
from kubetrain.sizing import parameter_count
from kubetrain.trainer.estimate import block_activations, mesh_estimates, window_masks
from kubetrain.trainer.export import hf_config, hf_name
from kubetrain.trainer.hf_families import HF_FAMILIES, read_dims
from kubetrain.trainer.model import Transformer, window_mask

sys.path.insert(0, str(Path(__file__).parent))
from compiled_check import assert_compiled_computes_what_eager_does
from saved_tensors import bytes_saved_for_backward

FAMILY_PRESETS = [name for name, preset in PRESETS.items() if preset.dims.family != "llama"]
SMALL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=96,
             tie_embeddings=False, rope_theta=10_000.0)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)  # tiny matrices: threads only contend with parallel tests


def _refuse(message: str) -> Exception:
    return AssertionError(message)


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
def test_every_family_preset_is_its_familys_transformers_model_with_the_counted_parameters(
        preset: str) -> None:
    dims = PRESETS[preset].dims
    config = hf_config(dims, 4096, 0)
    assert read_dims(config, dims.family, _refuse) == dims  # the config says all of it
    options = {key: value for key, value in config.items() if key != "model_type"}
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(config["model_type"], **options))
        ours = Transformer(dims, max_seq_len=4096)
    assert type(hf).__name__ == HF_FAMILIES[dims.family].architecture
    theirs = {name: tuple(p.shape) for name, p in hf.named_parameters()}
    mapped = {hf_name(name, dims): tuple(p.shape) for name, p in ours.named_parameters()}
    mapped.pop(None, None)  # a tied output projection: the embedding, as in transformers
    assert mapped == theirs
    assert sum(p.numel() for p in hf.parameters()) == parameter_count(dims) == sum(
        p.numel() for p in ours.parameters())
    print(f"{preset}: {parameter_count(dims) / 1e9:.3f}B parameters")


def test_a_local_layer_sees_only_its_window() -> None:
    """One Mistral layer with a window of 4: a token changes its own and the next three
    tokens' outputs, none after; a global layer's reach is the whole rest."""
    dims = ModelDims(**{**SMALL, "n_layers": 1}, family="mistral", sliding_window=4)
    torch.manual_seed(0)
    model = Transformer(dims, max_seq_len=16).eval()
    tokens = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[0, 5] = (changed[0, 5] + 1) % 256
    with torch.no_grad():
        moved = (model(tokens) - model(changed)).abs().amax(-1)[0] > 0
    assert moved.tolist() == [False] * 5 + [True] * 4 + [False] * 7
    assert window_mask(5, 2, torch.device("cpu")).sum(-1).tolist() == [1, 2, 2, 2, 2]


# Each family's block beside a Llama block of the same widths (heads of dim / heads, so
# that only the family's own pieces differ).
VARIANTS = {
    "qwen2": ModelDims(**SMALL, family="qwen2"),
    "qwen3": ModelDims(**SMALL, family="qwen3"),
    "gemma3": ModelDims(**SMALL, family="gemma3"),
    "mistral": ModelDims(**SMALL, family="mistral", sliding_window=8),
}


def _kept_by_blocks(dims: ModelDims, tokens: torch.Tensor) -> int:
    """Bytes autograd keeps from the blocks' forward (parameters aside), fp32."""
    torch.manual_seed(0)
    model = Transformer(dims, max_seq_len=tokens.shape[1])
    seq = tokens.shape[1]
    x = model.tok_embeddings(tokens).detach().requires_grad_()

    def blocks() -> None:
        hidden = x
        for block, local in zip(model.layers, model.local_layers, strict=True):
            if local:
                hidden, _ = block(hidden, None, model.local_rope_cos[:seq],
                                  model.local_rope_sin[:seq], window_mask(seq, 8, x.device))
            else:
                hidden, _ = block(hidden, None, model.rope_cos[:seq], model.rope_sin[:seq])

    return bytes_saved_for_backward(model, blocks)


@pytest.mark.parametrize("family", list(VARIANTS))
def test_the_estimate_counts_what_each_familys_block_keeps_for_backward(family: str) -> None:
    """What a family's block keeps beyond a Llama block's, measured in fp32, is what
    `block_activations` and `window_masks` add, within 3 % (left out: the norms' 1 + w, a
    few numbers per layer rather than per token)."""
    dims, llama = VARIANTS[family], ModelDims(**SMALL)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    measured = _kept_by_blocks(dims, tokens) - _kept_by_blocks(llama, tokens)
    estimated = (4 * (block_activations(dims, seq_len=32) - block_activations(llama))
                 * tokens.numel() * dims.n_layers + window_masks(dims, 32, 4))
    print(f"{family}: measured {measured} bytes more than Llama's blocks, estimated {estimated}")
    assert estimated == pytest.approx(measured, rel=0.03, abs=4 * tokens.numel())


def _spec(model: dict[str, Any], **sections: Any) -> TrainingJobSpec:
    return parse_job({
        "apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "f"},
        "spec": {"image": "x", "model": model, "data": {"train": "s3://d/train", "seqLen": 4096},
                 "checkpoint": {"uri": "s3://c/f"}, **sections}}).spec


@pytest.mark.parametrize(("model", "sections", "message"), [
    ({"preset": "qwen3-8b", "family": "gemma3"}, {},
     "spec.model.family (gemma3) is not preset qwen3-8b's (qwen3): a preset's family is its "
     "own; set preset custom to build a gemma3 model"),
    ({"preset": "gemma3-1b", "architecture": "ssm"}, {},
     "spec.model.architecture: ssm builds its own block, with no attention for the gemma3 "
     "family to differ in"),
    ({"preset": "qwen3-0.6b", "dynamics": {"enabled": True}}, {},
     "spec.model.dynamics.enabled: INL dynamics are built on the Llama block"),
    ({"preset": "custom", "family": "qwen3", "dim": 64, "nLayers": 2, "nHeads": 4,
      "headDim": 7}, {},
     "spec.model.headDim: head size (7) must be even"),
    ({"preset": "gemma3-1b"}, {"parallelism": {"tensorParallel": 2},
                               "workers": {"procsPerWorker": 2}},
     "parallelism.tensorParallel (2) must divide model.nKvHeads (1)"),
])
def test_what_cannot_work_is_refused_naming_the_field_and_why(
        model: dict[str, Any], sections: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidManifest) as refused:
        _spec(model, **sections)
    assert message in str(refused.value)


def test_a_custom_model_of_a_family_and_its_head_size_resolve_from_the_spec() -> None:
    dims = _spec({"preset": "custom", "family": "qwen3", "dim": 64, "nLayers": 2,
                  "nHeads": 4, "headDim": 32}).model.resolve()
    assert (dims.family, dims.head_size, dims.n_heads * dims.head_size) == ("qwen3", 32, 128)


# The tensor-parallel degrees a pod of 8 allows each preset: its heads and key/value heads
# (and feed-forward width and sequence) split evenly.
DEGREES = {"qwen3-0.6b": {1, 2, 4, 8}, "qwen3-1.7b": {1, 2, 4, 8}, "qwen3-4b": {1, 2, 4, 8},
           "qwen3-8b": {1, 2, 4, 8}, "qwen2.5-7b": {1, 2, 4},  # 28 heads, 4 key/value heads
           "mistral-7b": {1, 2, 4, 8}, "gemma3-1b": {1},  # one key/value head
           "gemma3-4b": {1, 2, 4}, "gemma3-12b": {1, 2, 4, 8}}


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
def test_kubetrain_estimate_sizes_each_preset_and_offers_the_meshes_it_allows(
        preset: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    from kubetrain.cli import main

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "e"},
        "spec": {"image": "x", "model": {"preset": preset},
                 "data": {"train": "s3://d/train", "seqLen": 4096},
                 "workers": {"replicas": 2, "procsPerWorker": 8},
                 "checkpoint": {"uri": "s3://c/e"}}}))
    assert main(["estimate", str(job)]) in (0, 1)  # fits an 80 GiB GPU, or says what would
    shown = capsys.readouterr().out
    dims = PRESETS[preset].dims
    assert shown.startswith(f"{preset} ({dims.family}): "
                            f"{parameter_count(dims) / 1e9:.2f}B parameters, 16 processes")
    spec = _spec({"preset": preset}, workers={"replicas": 2, "procsPerWorker": 8})
    found = mesh_estimates(spec, 16, spec.model.resolve())
    assert {shape.tensor_parallel for shape, _ in found} == DEGREES[preset]
    for shape, _ in found:
        assert shape.describe() in shown


@pytest.mark.slow
def test_compiled_and_checkpointed_the_family_with_most_switches_computes_what_eager_does(
) -> None:
    """parallelize's compile and full activation checkpointing on a Gemma 3 block (every
    switch but Qwen2's biases, in a local layer whose window is shorter than the sequence):
    the same loss and gradients as the plain model (fp32, CPU inductor). One family and one
    block: compiling one costs most of a minute on a busy CPU with a cold inductor cache."""
    dims = ModelDims(**{**SMALL, "n_layers": 1}, family="gemma3", sliding_window=8,
                     local_rope_theta=1000.0)
    traits = FAMILIES[dims.family]
    assert traits.qk_norm and traits.post_norms and traits.gelu and traits.scaled_embeddings
    torch.manual_seed(0)
    eager = Transformer(dims, max_seq_len=32)
    compiled = Transformer(dims, max_seq_len=32)
    compiled.load_state_dict(eager.state_dict())
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1))
    assert_compiled_computes_what_eager_does(eager, compiled, tokens)
