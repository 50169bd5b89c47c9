"""Learning-rate schedules draw the documented curves; the optimizer decays matrices only."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
import torch
from torch.amp import GradScaler
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from kubetrain.api.trainingjob import ModelSpec, OptimizationSpec
from kubetrain.trainer.model import Transformer
from kubetrain.trainer.optim import build_optimizer, build_schedule, learning_rate_at

PEAK, WARMUP, STEPS = 1e-3, 10, 110


def curve(schedule: str, **spec: float) -> list[float]:
    options = OptimizationSpec(**{"schedule": schedule, "max_steps": STEPS, "min_lr_ratio": 0.1,
                                  **spec})
    return [learning_rate_at(step, peak=PEAK, warmup_steps=WARMUP, max_steps=STEPS,
                             spec=options) for step in range(STEPS)]


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant", "wsd", "cosine-restarts"])
def test_every_schedule_warms_up_linearly_to_the_peak(schedule: str) -> None:
    lrs = curve(schedule)
    assert lrs[:WARMUP] == pytest.approx([PEAK * (s + 1) / WARMUP for s in range(WARMUP)])
    assert lrs[WARMUP] == pytest.approx(PEAK)


def test_cosine_falls_from_peak_through_the_midpoint_towards_the_floor() -> None:
    lrs = curve("cosine")[WARMUP:]
    floor = 0.1 * PEAK
    assert all(a >= b for a, b in pairwise(lrs))
    assert lrs[50] == pytest.approx((PEAK + floor) / 2)  # halfway through the decay
    assert lrs[-1] == pytest.approx(floor + (PEAK - floor) * (1 + math.cos(math.pi * 0.99)) / 2)


def test_linear_falls_by_equal_steps_and_constant_stays() -> None:
    lrs = curve("linear")[WARMUP:]
    drops = {round(a - b, 12) for a, b in pairwise(lrs)}
    assert drops == {round(0.9 * PEAK / 100, 12)}
    assert set(curve("constant")[WARMUP:]) == {PEAK}


def test_warmup_stable_decay_holds_the_peak_then_decays_linearly_in_the_last_fraction() -> None:
    lrs = curve("wsd", decay_fraction=0.2)[WARMUP:]
    assert set(lrs[:80]) == {PEAK}  # 80% of the 100 post-warmup steps are stable
    assert all(a > b for a, b in pairwise(lrs[80:]))
    assert lrs[-1] == pytest.approx(PEAK - 0.9 * PEAK * 19 / 20)


def test_cosine_with_restarts_returns_to_the_peak_at_each_cycle() -> None:
    lrs = curve("cosine-restarts", restart_cycles=4)[WARMUP:]
    peaks = [step for step, lr in enumerate(lrs) if lr == pytest.approx(PEAK)]
    assert peaks == [0, 25, 50, 75]
    assert lrs[12] == pytest.approx(lrs[37]) == pytest.approx(lrs[62])


def test_the_scheduler_applies_the_curve_step_by_step() -> None:
    spec = OptimizationSpec(schedule="cosine", max_steps=STEPS, min_lr_ratio=0.1)
    model = Transformer(ModelSpec(preset="tiny").resolve(), max_seq_len=8)
    optimizer = build_optimizer(model, spec, PEAK, torch.device("cpu"))
    scheduler = build_schedule(optimizer, peak=PEAK, warmup_steps=WARMUP, max_steps=STEPS,
                               spec=spec)
    seen = []
    for _ in range(STEPS):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx(curve("cosine"))


def test_weight_decay_applies_to_matrices_and_not_to_norm_scales() -> None:
    spec = OptimizationSpec(weight_decay=0.1)
    model = Transformer(ModelSpec(preset="tiny").resolve(), max_seq_len=8)
    optimizer = build_optimizer(model, spec, PEAK, torch.device("cpu"))
    decayed, undecayed = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and undecayed["weight_decay"] == 0.0
    assert all(p.ndim == 2 for p in decayed["params"])
    norms = {id(m.weight) for name, m in model.named_modules() if name.endswith("norm")}
    assert {id(p) for p in undecayed["params"]} == norms
    assert isinstance(optimizer, torch.optim.AdamW)
    assert all(group["fused"] for group in optimizer.param_groups)  # the CPU's fused kernel
    # fp16 under FSDP: the sharded scaler's found-inf flag has a shape the fused kernel
    # cannot take (`test_sigterm_saves_one_checkpoint...` trains with it).
    sharded = build_optimizer(model, spec, PEAK, torch.device("cpu"), ShardedGradScaler("cpu"))
    assert not any(group["fused"] for group in sharded.param_groups)
    plain = build_optimizer(model, spec, PEAK, torch.device("cpu"), GradScaler("cpu"))
    assert all(group["fused"] for group in plain.param_groups)
    sgd = build_optimizer(model, OptimizationSpec(optimizer="sgd"), PEAK, torch.device("cpu"))
    assert isinstance(sgd, torch.optim.SGD)
