"""parallelize's compile and full activation checkpointing, checked against the plain
model: the check the transformer families' and the state-space model's tests share."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kubetrain.api.trainingjob import ParallelismSpec
from kubetrain.trainer.parallelize import parallelize


class _OneProcess:
    def size(self) -> int:
        return 1


def assert_compiled_computes_what_eager_does(eager: nn.Module, compiled: nn.Module,
                                             tokens: torch.Tensor) -> None:
    """`compiled` (with `eager`'s weights), through parallelize with compile and full
    activation checkpointing (fp32, CPU inductor), gives the same loss on `tokens` as
    `eager`, and the same gradients."""
    spec = ParallelismSpec(precision="fp32", compile=True, activation_checkpointing="full")
    parallel = parallelize(compiled, spec, _OneProcess(), torch.device("cpu"))  # type: ignore[arg-type]
    losses = []
    # Scalar C++ kernels: what is checked is kubetrain's part (compile per block under
    # checkpointing, the model's code traced and lowered), not inductor's vectoriser, and
    # gcc builds them in half the time (the SSM's 36 kernels: 27 s against 48 s here).
    with torch._inductor.config.patch({"cpp.vec_isa_ok": False}):
        for model in (eager, parallel.module):
            loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            losses.append(float(loss.detach()))
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters(),
                                 strict=True):
        assert a.grad is not None and b.grad is not None, name
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=name)
