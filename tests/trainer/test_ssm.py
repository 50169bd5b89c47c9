"""The state-space student (model.architecture: ssm): the chunked scan and the recurrence
compute the same model, it has the parameters sizing.py counts, and the job fields that
build it are checked."""

from __future__ import annotations

import pytest
import torch

from kubetrain.api.presets import PRESETS
from kubetrain.trainer.sizing import ssm_parameter_count, ssm_state_elements
from kubetrain.trainer.ssm import StateSpaceModel

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
