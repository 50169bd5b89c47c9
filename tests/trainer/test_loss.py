"""The output projection + cross-entropy without full logits (loss.py) equals the plain one.

Loss and gradients of the chunked implementation against the full logits: as
functions, through the model (tied and untied output, fp32 and bf16 autocast),
and under FSDP2 with two gloo ranks started by torchrun. And the point of it:
autograd never keeps a tensor as large as the full logits.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from forked_torchrun import command as forked_torchrun  # (tests/) torchrun, ranks forked

from kubetrain.api.trainingjob import ModelDims
from kubetrain.sizing import loss_chunk_tokens
from kubetrain.trainer.loss import (
    OUTPUT_LOSS_ENV,
    OutputLoss,
    chunked_cross_entropy,
    full_cross_entropy,
    preload_fused_loss,
    select_output_loss,
)
from kubetrain.trainer.model import Transformer

WORKER = Path(__file__).with_name("fsdp_loss_worker.py")
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


def _dims(tie: bool) -> ModelDims:
    return ModelDims(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=500, ffn_dim=64,
                     tie_embeddings=tie, rope_theta=10000.0)


def assert_close_in(precision: str, actual: torch.Tensor, expected: torch.Tensor,
                    key: str = "") -> None:
    """fp32: element by element. bf16: as a whole, relative to its norm, since each side
    rounds its matmul outputs to bf16 at different places (per chunk, or once)."""
    if precision == "fp32":
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=key or None)
    else:
        error = float((actual.detach().float() - expected.float()).norm() / expected.float().norm())
        assert error < 1e-2, f"{key}: relative error {error:.2e}"


def _grad(parameter: torch.Tensor) -> torch.Tensor:
    assert parameter.grad is not None
    return parameter.grad.clone()


def _loss_and_grads(fn, hidden, weight, targets):  # type: ignore[no-untyped-def]
    hidden = hidden.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    loss = fn(hidden, weight, targets)
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("chunk", [1, 7, 64, 100, 1000])
def test_chunked_loss_and_gradients_equal_the_full_logits_in_fp32(chunk: int) -> None:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(100, 16, generator=generator)
    weight = torch.randn(300, 16, generator=generator)
    targets = torch.randint(0, 300, (100,), generator=generator)
    reference = F.cross_entropy(hidden @ weight.t(), targets, reduction="sum")

    full = _loss_and_grads(full_cross_entropy, hidden, weight, targets)
    chunked = _loss_and_grads(functools.partial(chunked_cross_entropy, chunk=chunk),
                              hidden, weight, targets)
    torch.testing.assert_close(full[0], reference)
    for a, b in zip(full, chunked, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_model_given_targets_returns_the_loss_of_its_logits(tie: bool,
                                                                  dtype: torch.dtype) -> None:
    """model(tokens, targets) against cross-entropy of model(tokens), as the loop used to."""
    torch.manual_seed(0)
    model = Transformer(_dims(tie), max_seq_len=32)
    tokens = torch.randint(0, 500, (3, 33))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    autocast = torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)

    with autocast:
        logits = model(inputs)
        expected = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                   reduction="sum")
    expected.backward()
    expected_grads = {k: _grad(p) for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    model.output_loss = OutputLoss("chunked", functools.partial(chunked_cross_entropy, chunk=10))
    with autocast:
        loss = model(inputs, targets)
    loss.backward()

    assert loss.dtype == torch.float32
    precision = "fp32" if dtype == torch.float32 else "bf16"
    assert_close_in(precision, loss, expected)
    for key, parameter in model.named_parameters():
        assert_close_in(precision, _grad(parameter), expected_grads[key], key)


def test_chunked_loss_never_keeps_a_tensor_as_large_as_the_logits() -> None:
    """What autograd saves for backward, by size: the full loss keeps [tokens, vocab]."""
    tokens, vocab = 256, 2000
    hidden = torch.randn(tokens, 32, requires_grad=True)
    weight = torch.randn(vocab, 32, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))

    def largest_saved(fn) -> int:  # type: ignore[no-untyped-def]
        sizes = [0]

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            sizes.append(tensor.numel())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = fn(hidden, weight, targets)
        loss.backward()
        return max(sizes)

    assert largest_saved(full_cross_entropy) >= tokens * vocab
    assert largest_saved(functools.partial(chunked_cross_entropy, chunk=32)) <= vocab * 32


def test_chunks_hold_about_a_quarter_gib_of_fp32_logits() -> None:
    assert loss_chunk_tokens(128_256) == 523
    assert loss_chunk_tokens(10) == 256 * 1024**2 // 40


def test_the_cpu_gets_the_chunked_loss_and_the_environment_can_choose(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(OUTPUT_LOSS_ENV, raising=False)
    chosen, why = select_output_loss(torch.device("cpu"))
    assert chosen.name == "chunked" and "CUDA" in why
    monkeypatch.setenv(OUTPUT_LOSS_ENV, "full")
    assert select_output_loss(torch.device("cpu"))[0].name == "full"
    monkeypatch.setenv(OUTPUT_LOSS_ENV, "liger")
    with pytest.raises(ValueError, match="KUBETRAIN_OUTPUT_LOSS=liger needs a CUDA device"):
        select_output_loss(torch.device("cpu"))
    monkeypatch.setenv(OUTPUT_LOSS_ENV, "fused")
    with pytest.raises(ValueError, match="'fused' is not one of auto, full, chunked, liger"):
        select_output_loss(torch.device("cpu"))


@pytest.fixture(scope="module")
def two_rank_losses(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """fsdp_loss_worker.py's losses and gradients on two gloo ranks, fp32 then bf16, in one
    launch."""
    out = tmp_path_factory.mktemp("fsdp-loss") / "results.pt"
    done = subprocess.run(
        forked_torchrun("--standalone", "--nproc-per-node=2", str(WORKER), str(out), "fp32,bf16"),
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return torch.load(out)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_chunked_loss_equals_the_full_logits_under_fsdp2_with_two_ranks(
        two_rank_losses: dict[str, Any], precision: str) -> None:
    results = two_rank_losses[precision]
    full, chunked = results["full"], results["chunked"]
    assert_close_in(precision, chunked["loss"], full["loss"])
    assert full["grads"].keys() == chunked["grads"].keys()
    for key, grad in full["grads"].items():
        assert grad.abs().sum() > 0, key
        assert_close_in(precision, chunked["grads"][key], grad, key)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_every_loss_equals_the_full_logits_under_fsdp2_with_nccl(tmp_path: Path) -> None:
    """On the GPU machine: FSDP2 over NCCL (one rank per GPU), bf16; chunked and, when
    liger-kernel is installed, Liger's fused loss against the full logits."""
    ranks = torch.cuda.device_count()
    out = tmp_path / "results.pt"
    done = subprocess.run(
        forked_torchrun("--standalone", f"--nproc-per-node={ranks}", str(WORKER), str(out),
                        "bf16"),
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    results = torch.load(out)["bf16"]
    print("implementations compared on CUDA:", sorted(results))
    for name, result in results.items():
        assert_close_in("bf16", result["loss"], results["full"]["loss"], name)
        for key, grad in results["full"]["grads"].items():
            assert_close_in("bf16", result["grads"][key], grad, f"{name}: {key}")


@pytest.fixture
def fake_packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder on sys.path for stand-ins of Liger Kernel, and NVML's check unset."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(NVML_CHECK, "")  # recorded, so that the deletion is undone after
    monkeypatch.delenv(NVML_CHECK)
    return tmp_path


def _package(folder: Path, name: str, body: str) -> str:
    (folder / name).mkdir()
    (folder / name / "__init__.py").write_text("")
    (folder / name / "functional.py").write_text(body)
    return f"{name}.functional"


def test_the_fork_server_preloads_a_loss_whose_import_leaves_cuda_alone(
        fake_packages: Path) -> None:
    module = _package(fake_packages, "kt_fake_liger_clean",
                      "import torch\nAVAILABLE = torch.cuda.is_available()\n")
    assert preload_fused_loss(module) is True
    assert module in sys.modules
    assert os.environ[NVML_CHECK] == "1"  # is_available() asks NVML, which forks safely


def test_a_loss_import_that_initialises_cuda_is_refused_and_left_to_the_rank(
        fake_packages: Path) -> None:
    lazy_init = torch.cuda._lazy_init
    module = _package(fake_packages, "kt_fake_liger_device",
                      "import torch\nDEVICE = torch.cuda.current_device()\n")
    assert preload_fused_loss(module) is False
    assert module not in sys.modules  # the rank imports it again, after its preflight
    assert torch.cuda._lazy_init is lazy_init
    assert not torch.cuda.is_initialized()


def test_a_refusal_that_a_library_catches_still_reports_the_preload_as_degraded(
        fake_packages: Path) -> None:
    module = _package(fake_packages, "kt_fake_liger_catches", (
        "import torch\ntry:\n    FITS = torch.cuda.get_device_properties(0).major >= 7\n"
        "except ImportError:\n    FITS = False\n"))
    assert preload_fused_loss(module) is False
    assert sys.modules[module].FITS is False  # what the library decided without the GPU


def test_nothing_is_preloaded_where_liger_is_not_installed(fake_packages: Path) -> None:
    assert preload_fused_loss("kt_no_such_package.functional") is False
    assert NVML_CHECK not in os.environ
