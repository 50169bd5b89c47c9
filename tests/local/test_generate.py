"""`kubetrain generate`: loading a checkpoint's model and sampling from it."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from kubetrain.api.manifest import parse_job
from kubetrain.trainer.checkpoint import Checkpointer, ModelState
from kubetrain.trainer.generate import load_model, sample
from kubetrain.trainer.model import Transformer
from kubetrain.trainer.prepare import TOKENIZER_NAME, train_tokenizer

TEXTS = ["def add(a, b):\n    return a + b\n", "class Point:\n    x: int\n    y: int\n"] * 20


@pytest.fixture(autouse=True)
def _single_process() -> None:
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    torch.set_num_threads(1)  # tiny matrices: threads only contend with parallel tests


@pytest.fixture
def model() -> Transformer:
    torch.manual_seed(0)
    job = parse_job({"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
                     "metadata": {"name": "g"},
                     "spec": {"image": "x", "model": {"preset": "tiny"},
                              "data": {"train": "d/train", "seqLen": 32},
                              "checkpoint": {"uri": "c"}}})
    return Transformer(job.spec.model.resolve(), max_seq_len=job.spec.data.seq_len).eval()


def test_loads_the_newest_checkpoint_and_its_tokenizer(tmp_path: Path) -> None:
    tokenizer = train_tokenizer(iter(TEXTS), vocab_size=300)
    (tmp_path / "data" / "train").mkdir(parents=True)
    (tmp_path / "data" / "train" / TOKENIZER_NAME).write_text(tokenizer.to_str())
    job = parse_job({"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
                     "metadata": {"name": "g"},
                     "spec": {"image": "x", "model": {"preset": "tiny", "vocabSize": 300},
                              "data": {"train": str(tmp_path / "data" / "train"), "seqLen": 32},
                              "checkpoint": {"uri": str(tmp_path / "checkpoints")}}})
    dims = job.spec.model.resolve()
    checkpointer = Checkpointer(job.spec, rank=0, world_size=1)
    trained = {}
    for step in (10, 20):
        torch.manual_seed(step)
        model = Transformer(dims, max_seq_len=32)
        checkpointer.save(step, {"model": ModelState(model, torch.optim.AdamW(
            model.parameters()))})
        trained[step] = model
    checkpointer.close()

    loaded = load_model(str(tmp_path / "checkpoints"))
    assert loaded.step == 20
    for name, value in trained[20].state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], value), name
    assert loaded.tokenizer.get_vocab_size() == tokenizer.get_vocab_size()
    assert load_model(loaded.uri.replace("00000020", "00000010")).step == 10


def test_temperature_zero_takes_the_likeliest_token_each_time(model: Transformer) -> None:
    prompt = [1, 2, 3]
    produced = sample(model, prompt, max_tokens=5, temperature=0, top_k=None)
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(5):
            tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    assert produced == tokens[len(prompt):]


def test_top_1_sampling_is_greedy_whatever_the_temperature(model: Transformer) -> None:
    greedy = sample(model, [5], max_tokens=6, temperature=0, top_k=None)
    assert sample(model, [5], max_tokens=6, temperature=5.0, top_k=1) == greedy


def test_a_seed_makes_samples_repeatable(model: Transformer) -> None:
    def draw(seed: int) -> list[int]:
        return sample(model, [7], max_tokens=8, temperature=1.0, top_k=50,
                      generator=torch.Generator().manual_seed(seed))

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)


def test_sampling_stops_at_the_stop_token_and_outgrows_the_context(model: Transformer) -> None:
    first = sample(model, [9], max_tokens=1, temperature=0, top_k=None)[0]
    assert sample(model, [9], max_tokens=10, temperature=0, top_k=None, stop_token=first) == []
    # Longer than max_seq_len: the context slides instead of failing.
    assert len(sample(model, [9], max_tokens=36, temperature=0, top_k=None)) == 36
