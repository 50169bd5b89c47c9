"""The model: its parameter count and FLOPs per token, causality, and grouped-query attention."""

from __future__ import annotations

import pytest
import torch

from kubetrain.api.trainingjob import ModelSpec
from kubetrain.sizing import flops_per_token, parameter_count
from kubetrain.trainer.model import Transformer


def test_flops_per_token_of_an_untied_gqa_model_matches_a_hand_count() -> None:
    dims = ModelSpec(preset="custom", dim=128, n_layers=3, n_heads=8, n_kv_heads=2,
                     vocab_size=1000, ffn_dim=320, tie_embeddings=False).resolve()
    seq_len = 256
    # By hand: head size 16, so keys and values are 2 x 16 = 32 wide.
    attention = 128 * 128 + 128 * 32 + 128 * 32 + 128 * 128  # wq, wk, wv, wo = 40_960
    feed_forward = 3 * 128 * 320  # w1, w2, w3 = 122_880
    norms = 2 * 128
    per_layer = attention + feed_forward + norms  # 164_096
    output = 1000 * 128  # the input embedding is a lookup: no FLOPs
    matmul_params = 3 * per_layer + 128 + output  # 620_416 (final norm included)
    attention_flops = 12 * 3 * 8 * 16 * 256  # 12 * layers * heads * head size * seq
    assert flops_per_token(dims, seq_len) == 6 * matmul_params + attention_flops == 4_902_144


@pytest.mark.parametrize("spec", [ModelSpec(preset="tiny"),
                                  ModelSpec(preset="custom", dim=96, n_layers=2, n_heads=6,
                                            n_kv_heads=3, vocab_size=300,
                                            tie_embeddings=False)])
def test_parameter_count_is_what_the_model_builds(spec: ModelSpec) -> None:
    dims = spec.resolve()
    model = Transformer(dims, max_seq_len=32)
    assert sum(p.numel() for p in model.parameters()) == parameter_count(dims)


def test_a_token_never_sees_the_tokens_after_it() -> None:
    torch.manual_seed(0)
    model = Transformer(ModelSpec(preset="tiny").resolve(), max_seq_len=32).eval()
    tokens = torch.randint(0, 2048, (2, 32))
    changed = tokens.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % 2048
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :20], after[:, :20])
    assert not torch.allclose(before[:, 20:], after[:, 20:])


def test_grouped_query_attention_equals_attention_with_repeated_key_value_heads() -> None:
    """n_kv_heads=2 behaves as 4 heads whose key/value projections repeat each group's."""
    torch.manual_seed(0)
    grouped = Transformer(ModelSpec(preset="tiny").resolve(), max_seq_len=16).eval()
    full_dims = ModelSpec(preset="tiny", n_kv_heads=4).resolve()
    full = Transformer(full_dims, max_seq_len=16).eval()
    state = grouped.state_dict()
    for name in [n for n in state if n.endswith(("attention.wk.weight", "attention.wv.weight"))]:
        # [2 heads x 16, dim] -> [4 heads x 16, dim]: each kv head serves 2 query heads.
        state[name] = state[name].view(2, 16, -1).repeat_interleave(2, dim=0).reshape(64, -1)
    full.load_state_dict(state)
    tokens = torch.randint(0, 2048, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(grouped(tokens), full(tokens))


def test_sequences_longer_than_the_rotary_table_are_refused() -> None:
    model = Transformer(ModelSpec(preset="tiny").resolve(), max_seq_len=8)
    with pytest.raises(ValueError, match="longer than the model's max_seq_len"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_dropout_acts_only_while_training_and_off_is_todays_model() -> None:
    dims = ModelSpec(preset="tiny").resolve()
    tokens = torch.randint(0, dims.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    plain = Transformer(dims, max_seq_len=32)
    torch.manual_seed(0)
    off = Transformer(dims, max_seq_len=32, dropout=0.0)
    torch.manual_seed(0)
    dropped = Transformer(dims, max_seq_len=32, dropout=0.2)
    # Off draws nothing from the generator and computes exactly what the plain model does.
    state = torch.get_rng_state()
    assert torch.equal(off(tokens), plain(tokens))
    assert torch.equal(torch.get_rng_state(), state)
    # On: two training passes draw different masks; the same generator state, the same masks.
    torch.manual_seed(7)
    first, second = dropped(tokens), dropped(tokens)
    torch.manual_seed(7)
    assert not torch.equal(first, second) and torch.equal(dropped(tokens), first)
    assert not torch.equal(first, plain(tokens))
    # Evaluation runs without it.
    dropped.eval()
    plain.eval()
    assert torch.equal(dropped(tokens), plain(tokens))
