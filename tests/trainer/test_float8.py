"""`parallelism.precision: fp8` is refused, naming the field, where float8 cannot run.

These run on CPU. The GPUs in the middle two cases are described to the code
through torch.cuda's device queries (capability and name), the only thing it
asks of them before torchao is imported.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

from kubetrain.api.trainingjob import ModelDims, ParallelismSpec
from kubetrain.trainer.model import Transformer
from kubetrain.trainer.parallelize import (
    FLOAT8_RECIPE_ENV,
    PrecisionUnsupported,
    convert_to_float8,
    float8_unsupported,
    parallelize,
)

DIMS = ModelDims(dim=32, n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=64, ffn_dim=64,
                 tie_embeddings=False, rope_theta=10000.0)


class _FakeMesh:
    def size(self) -> int:
        return 1


def _gpu(monkeypatch: pytest.MonkeyPatch, name: str, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


def test_fp8_on_a_cpu_is_refused_naming_the_field_and_the_device() -> None:
    model = Transformer(DIMS, max_seq_len=8)
    spec = ParallelismSpec(precision="fp8")
    mesh: DeviceMesh = _FakeMesh()  # type: ignore[assignment]
    with pytest.raises(PrecisionUnsupported,
                       match=r"parallelism.precision: fp8 is not supported here: this process "
                             r"trains on cpu.*Use precision bf16"):
        parallelize(model, spec, mesh, torch.device("cpu"))


def test_fp8_on_a_gpu_without_float8_tensor_cores_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _gpu(monkeypatch, "NVIDIA A100-SXM4-80GB", (8, 0))
    with pytest.raises(PrecisionUnsupported,
                       match=r"parallelism.precision: fp8 .* NVIDIA A100-SXM4-80GB has compute "
                             r"capability 8.0, and float8 tensor cores need 8.9 or newer"):
        convert_to_float8(Transformer(DIMS, max_seq_len=8), torch.device("cuda", 0), False)


def test_fp8_without_torchao_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpu(monkeypatch, "NVIDIA H100 80GB HBM3", (9, 0))
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao now raises ImportError
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(PrecisionUnsupported,
                       match=r"parallelism.precision: fp8 needs torchao.*"
                             r"pip install 'kubetrain\[gpu\]'"):
        convert_to_float8(Transformer(DIMS, max_seq_len=8), torch.device("cuda", 0), False)


def test_an_unknown_float8_recipe_is_refused_naming_the_variable_and_the_choices(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _gpu(monkeypatch, "NVIDIA H100 80GB HBM3", (9, 0))
    monkeypatch.setenv(FLOAT8_RECIPE_ENV, "blockwise")
    with pytest.raises(ValueError, match=r"KUBETRAIN_FLOAT8_RECIPE='blockwise' is not one of "
                                         r"tensorwise, rowwise, rowwise_with_gw_hp"):
        convert_to_float8(Transformer(DIMS, max_seq_len=8), torch.device("cuda", 0), False)


def test_float8_is_supported_from_ada_on(monkeypatch: pytest.MonkeyPatch) -> None:
    assert float8_unsupported(torch.device("cpu")) is not None
    for capability, supported in [((8, 6), False), ((8, 9), True), ((9, 0), True),
                                  ((10, 0), True)]:
        _gpu(monkeypatch, "GPU", capability)
        assert (float8_unsupported(torch.device("cuda", 0)) is None) == supported, capability


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available()
                    or float8_unsupported(torch.device("cuda", 0)) is not None,
                    reason="needs a GPU with float8 tensor cores")
def test_fp8_trains_the_blocks_in_float8_and_keeps_the_loss_close_to_bf16() -> None:
    pytest.importorskip("torchao.float8")
    dims = ModelDims(dim=256, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=512,
                     ffn_dim=512, tie_embeddings=False, rope_theta=10000.0)
    device = torch.device("cuda", 0)
    mesh: DeviceMesh = _FakeMesh()  # type: ignore[assignment]
    tokens = torch.randint(0, 512, (4, 129), device=device)
    losses = {}
    for precision in ("bf16", "fp8"):
        torch.manual_seed(0)
        parallel = parallelize(Transformer(dims, max_seq_len=128),
                               ParallelismSpec(precision=precision), mesh, device)
        with parallel.autocast():
            loss = parallel.module(tokens[:, :-1], tokens[:, 1:]) / tokens[:, 1:].numel()
        loss.backward()
        losses[precision] = float(loss)
        kinds = {type(m).__name__ for n, m in parallel.module.named_modules()
                 if n.startswith("layers.") and isinstance(m, torch.nn.Linear)}
        assert kinds == ({"Float8Linear"} if precision == "fp8" else {"Linear"})
        assert type(parallel.module.output).__name__ == "Linear"
        assert all(p.grad is not None and torch.isfinite(p.grad).all()
                   for p in parallel.module.parameters())
    assert abs(losses["fp8"] - losses["bf16"]) < 0.02 * losses["bf16"], losses
