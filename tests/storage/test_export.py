"""The exported model loads in Hugging Face transformers and computes the same logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from kubetrain.api.manifest import parse_job
from kubetrain.trainer.export import export_model
from kubetrain.trainer.model import Transformer
from kubetrain.trainer.prepare import PreparedDataset

# Checkpoints are collectives: these tests run in a one-process group.
pytestmark = pytest.mark.usefixtures("process_group")


@pytest.mark.parametrize("tied", [True, False])
def test_transformers_loads_the_export_and_computes_the_same_logits(
        tied: bool, tmp_path: Path, prepared_corpus: PreparedDataset) -> None:
    spec = parse_job({
        "apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "export"},
        "spec": {"image": "trainer",
                 "model": {"preset": "tiny", "tieEmbeddings": tied, "nKvHeads": 2},
                 "data": {"train": prepared_corpus.train_uri, "seqLen": 64},
                 "optimization": {"maxSteps": 10},
                 "checkpoint": {"uri": str(tmp_path / "ckpt")}},
    }).spec
    dims = spec.model.resolve()
    torch.manual_seed(0)
    model = Transformer(dims, max_seq_len=64)
    with torch.no_grad():  # non-trivial norms too, so a swapped norm weight would show
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)

    uri = export_model(model, dims, spec, rank=0)
    folder = uri.removeprefix("file://")
    assert sorted(p.name for p in Path(folder).iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json"]

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    tokens = torch.tensor([tokenizer.encode("def add(a, b):\n    return a + b\n")[:64]])
    with torch.no_grad():
        expected = model(tokens)
        got = hf(tokens).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
